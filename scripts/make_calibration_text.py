"""Write minillm/data/calibration_generated.txt: essays the default model writes itself, the
calibration text of weight_calibration="autoround" (with data/calibration.txt before it).

Learned rounding needs more calibration tokens than the ~1,100 of calibration.txt: with so few
it fits them and generalises worse than AWQ (docs/notes/performance-history.md). No dataset can be downloaded
here, so the model writes its own, as data-free quantization does (LLM-QAT, Liu et al. 2023): two
essays per topic, sampled from the model's full distribution (temperature 1, no top-p), with a
seed each: text as varied as the model's own predictions, not the repetitive, low-perplexity prose
that temperature 0.8 gave (perplexity 2-3 under the model, against ~25 on corpus.txt). The
topics stay clear of data/corpus.txt's (lighthouses, bread, the water cycle, bicycle gears, night
trains, libraries, memory hierarchies, vegetable gardens, a harbour market), which the quality
harness scores. --from-round 1 appends the second round to a file that holds the first.

    .venv/bin/python scripts/make_calibration_text.py      # about 13 minutes on 2 CPU cores
"""

from __future__ import annotations

import sys
from pathlib import Path

TOPICS = [
    "how bees make honey", "the physics of sailing", "why the sky changes colour at dusk", "the first telescopes",
    "the science of sleep", "mountain weather", "how volcanoes form", "the life cycle of a star",
    "how a violin is made", "the migration of birds", "life on a coral reef", "the chemistry of soap",
    "the history of chess", "how glass is blown", "the rules of cricket", "how maps were drawn before satellites",
    "how clocks keep time", "the anatomy of a spider web", "the history of coffee", "how submarines dive",
    "the building of the pyramids", "how vaccines teach the immune system", "the geography of deserts",
    "how a piano makes its sound", "the history of the Olympic games", "the life of an octopus",
    "how paper is made", "the origins of counting and numbers", "the art of origami", "the story of the Silk Road",
    "how earthquakes are measured", "the invention of photography",
    "how rivers carve canyons", "the history of the printing press", "how suspension bridges carry their load",
    "a forest through the four seasons", "how the human heart pumps blood", "the history of writing systems",
    "how wind turbines make electricity", "the discovery of penicillin", "how ants organise their colonies",
    "how a magnetic compass works", "the life of a salmon", "how the moon causes the tides",
    "the history of the postal service", "how glaciers move", "the architecture of cathedrals",
    "how a camera lens focuses light", "the history of money", "how radio waves carry sound", "the life of elephants",
    "how cheese is made", "the history of the calendar", "how the eye sees colour", "the ecology of wetlands",
    "how rockets reach orbit", "medicine in ancient Greece", "how languages change over time", "the craft of blacksmithing",
    "how tea is grown and processed", "the history of the theatre", "how snowflakes form",
    "how the internet routes a message", "the migration of the monarch butterfly",
]
BATCH = 16  # essays generated together (the engine's max_num_seqs)
ROUNDS = 2  # each topic is written ROUNDS times; seed = round * len(TOPICS) + the topic's index
MAX_TOKENS = 512
OUT = Path(__file__).resolve().parent.parent / "minillm" / "data" / "calibration_generated.txt"


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-round", type=int, default=0,
                        help="keep the file's text (rounds before this one) and append the later rounds")
    args = parser.parse_args(argv)
    if not 0 <= args.from_round < ROUNDS:
        parser.error(f"--from-round {args.from_round} is not in 0..{ROUNDS - 1}")
    sys.path.insert(0, str(OUT.parents[2]))
    from minillm import LLM, SamplingParams

    llm = LLM(max_num_seqs=BATCH)
    blocks = [OUT.read_text().rstrip("\n") + "\n"] if args.from_round else []
    for round_ in range(args.from_round, ROUNDS):
        for start in range(0, len(TOPICS), BATCH):  # one block of essays per batch, blocks apart by a blank line
            topics = TOPICS[start:start + BATCH]
            prompts = [{"prompt_token_ids": llm.chat_token_ids([{"role": "user", "content": f"Write a long, detailed essay about {t}."}])}
                       for t in topics]
            seed = round_ * len(TOPICS) + start
            params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed + i) for i in range(len(topics))]
            outs = llm.generate(prompts, params, use_tqdm=True)
            blocks.append("\n\n".join(o.outputs[0].text.strip() for o in outs) + "\n")
    text = "\n\n".join(blocks)
    OUT.write_text(text)
    print(f"wrote {OUT} ({len(llm.tokenizer.encode(text, add_special_tokens=False))} tokens)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

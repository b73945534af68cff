"""minillm against the CPU engines people use instead: batch-1 decode on the same prompts and token counts, in one run.

    python -m minillm.bench.peers                      # minillm fp32 / int8 / int4, transformers, CTranslate2
    minillm bench --compare-peers --gguf default       # + llama.cpp on the default model's shipped Q4_1 GGUF
    python -m minillm.bench.peers --rounds 5 --json peers.json

Rows: minillm in each weight format (`LLM.with_levers(weight_dtype=...)` of one loaded model, the
settings of bench/quant_speed.py); transformers `generate` (fp32, the same model directory);
CTranslate2 float32 and int8 (`pip install -e '.[peers]'`; the model is converted once, offline,
into the minillm cache); llama.cpp through llama-cpp-python when it is installed and --gguf is given.
Every request is greedy, batch 1, EOS ignored, N new tokens. Decode tokens/s = (N - 1) / (t_N - t_1),
t_1 and t_N the times of the first and the N-th token (transformers has no token timestamps here, so
as in bench/compare.py t_1 is a 1-token request's time and t_N an N-token one's). Engines run
interleaved, prompt by prompt, round after round, and each row reports the median over rounds of
its per-round median over prompts, so a noisy shared CPU hurts all rows alike.
% of bound: the row's decode rate over the read-bandwidth bound of ITS format (measured read
bandwidth / bytes of weights that format reads per token).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .peer_engines import build_peers
from .peer_rows import Run, best_minillm_vs, format_peers, format_peers_markdown, result_json, summarize
from .quant_speed import SETTINGS

ENGINES = frozenset({"minillm", "transformers", "ctranslate2", "llama.cpp"})


# ------------------------------------------------------------------ one run
def prompt_ids_for(llm, num_prompts: int) -> list[list[int]]:
    """The chat workload's prompts (data/prompts.txt in the chat template) as token ids; a model without a
    tokenizer (random:...) gets fixed 16-token prompts."""
    from .workloads import chat_workload

    if llm.tokenizer is None:
        vocab = llm.engine.model_config.vocab_size
        return [[(37 * p + 11 * j) % (vocab - 3) + 3 for j in range(16)] for p in range(num_prompts)]
    return [r.prompt["prompt_token_ids"] if isinstance(r.prompt, dict) else llm.tokenizer.encode(r.prompt)
            for r in chat_workload(num_prompts, 1, llm.tokenizer)]


def compare_peers(llm, prompt_ids: list[list[int]], new_tokens: int = 64, rounds: int = 3,
                  settings: dict[str, dict] | None = None, engines=ENGINES, gguf: str | None = None, progress: bool = True) -> dict:
    """Run every engine on every prompt, round after round (engines interleaved prompt by prompt); the result
    holds rows (see Row), the hardware and the settings."""
    import torch
    from tqdm.auto import tqdm

    from ..hardware import cpu_name, measure_memory_bandwidth

    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens}: need at least 2 (decode rate = (N - 1) / (t_N - t_1))")
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: need at least 1")
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: give at least one prompt")
    unknown = set(engines) - ENGINES
    if unknown:
        raise ValueError(f"engines {sorted(unknown)} unknown; choose from {sorted(ENGINES)}")
    threads = torch.get_num_threads()
    n_ctx = max(len(ids) for ids in prompt_ids) + new_tokens + 8
    peers, skipped, weight_bytes = build_peers(llm, settings or SETTINGS, set(engines), gguf, threads, n_ctx)
    for peer in peers:   # warm up: first-call allocations, kernel dispatch, thread pools
        peer.run(prompt_ids[0], 2)
    before = measure_memory_bandwidth()
    runs: dict[str, list[list[Run]]] = {p.name: [] for p in peers}
    bar = tqdm(total=rounds * len(prompt_ids) * len(peers), desc="peers", disable=not progress)
    for _ in range(rounds):
        for p in runs:
            runs[p].append([])
        for ids in prompt_ids:
            for peer in peers:
                bar.set_postfix_str(peer.name)
                runs[peer.name][-1].append(peer.run(ids, new_tokens))
                bar.update()
    bar.close()
    # Best of before and after the rounds (a second call with another `repeats` is a new measurement, not the
    # cached one): a burst of other work during one of them would otherwise lower the bound and flatter every row.
    bandwidth = max(before, measure_memory_bandwidth(repeats=6))
    rows = summarize(runs, weight_bytes, skipped, bandwidth)
    return {"cpu": cpu_name(), "threads": threads, "torch": torch.__version__, "bandwidth_gb_s": bandwidth / 1e9,
            "prompts": len(prompt_ids), "new_tokens": new_tokens, "rounds": rounds, "rows": rows,
            "best_minillm_vs_ct2_int8": best_minillm_vs(rows)}


def run(model: str | None = None, num_prompts: int = 4, new_tokens: int = 64, rounds: int = 3,
        gguf: str | None = None, json_path: str | None = None, engines=None, levers: dict | None = None,
        threads: int | None = None, progress: bool = True, markdown: bool = False) -> dict:
    """Load the model, compare, print the table; write the rows to `json_path` when given."""
    import torch

    from ..llm import LLM

    if not 1 <= num_prompts <= 32:
        raise ValueError(f"num_prompts={num_prompts}: choose 1 to 32 (data/prompts.txt has 32)")
    if threads:
        torch.set_num_threads(threads)
    if gguf == "default":
        from ..models.default import gguf_path

        gguf = str(gguf_path())
    elif gguf is not None and not Path(gguf).is_file():
        raise ValueError(f"--gguf {gguf!r}: no such file (give a GGUF path, or 'default' for the shipped Q4_1)")
    llm = LLM(model, **(levers or {}))
    result = compare_peers(llm, prompt_ids_for(llm, num_prompts), new_tokens, rounds,
                           engines=set(engines or ENGINES), gguf=gguf, progress=progress)
    print(format_peers(result))
    if markdown:
        print()
        print(format_peers_markdown(result))
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result_json(result), indent=1))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench.peers", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="HF directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--prompts", type=int, default=4, help="prompts from data/prompts.txt (1-32)")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the median is reported)")
    parser.add_argument("--gguf", default=None, metavar="PATH",
                        help="a GGUF of the same model for the llama.cpp row ('default': the shipped Q4_1)")
    parser.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=None, help="only these rows")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the rows to this file")
    parser.add_argument("--markdown", action="store_true", help="also print the rows as a Markdown table")
    parser.add_argument("--no-progress", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    run(args.model, args.prompts, args.tokens, args.rounds, args.gguf, args.json, args.engines,
        threads=args.threads, progress=not args.no_progress, markdown=args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

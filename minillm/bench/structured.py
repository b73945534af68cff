"""What a grammar's token mask costs per decode step: the same batch with and without a JSON schema, side by side.

    python -m minillm.bench.structured                 # default model, 8 requests, 3 interleaved rounds
    python -m minillm.bench.structured --batch 16 --repeats 5

Each round runs the batch twice on one engine: once constrained to a JSON schema (xgrammar fills each request's
bitmask and masks its logits before the sampler), once unconstrained with the same prompts and the same number
of output tokens per request (`min_tokens = max_tokens` = the constrained answer's length, so both runs do the same
decode steps). Reported: the mask's own time per step and per row (the GrammarBackend's timer), and decode step
time with and without it (medians over rounds), so the mask's share of a step is a ratio measured in one process.
"""

from __future__ import annotations

import argparse
import statistics
import time

from ..sampling import SamplingParams
from ..structured import StructuredOutputs

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0},
                   "city": {"type": "string", "maxLength": 24}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


def compare(llm, batch: int = 8, repeats: int = 3, max_tokens: int = 64) -> dict:
    """Per round: the constrained batch, then the same output lengths unconstrained; medians over rounds."""
    prompts = [llm.apply_chat_template([{"role": "user", "content": f"Invent person {i} and describe them as JSON."}])
               for i in range(batch)]
    constrained = SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputs(json=SCHEMA))
    engine = llm.engine
    on_step, off_step, mask_step, mask_row, tokens = [], [], [], [], []
    for _ in range(repeats):
        engine.reset_stats()
        grammars = engine.runner.grammars
        before = (grammars.mask_s, grammars.mask_rows, grammars.mask_steps) if grammars else (0.0, 0, 0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, constrained)
        steps_on = max(1, len(engine.stats.steps))
        on_step.append((time.perf_counter() - t0) / steps_on)
        grammars = engine.runner.grammars
        mask_s, rows, steps = (grammars.mask_s - before[0], grammars.mask_rows - before[1],
                               grammars.mask_steps - before[2])
        mask_step.append(mask_s / max(steps, 1))
        mask_row.append(mask_s / max(rows, 1))
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        tokens.append(sum(lengths))
        plain = [SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True) for n in lengths]
        engine.reset_stats()
        t0 = time.perf_counter()
        llm.generate(prompts, plain)
        off_step.append((time.perf_counter() - t0) / max(1, len(engine.stats.steps)))
    return {"batch": batch, "repeats": repeats, "tokens": statistics.median(tokens),
            "step_on_s": statistics.median(on_step), "step_off_s": statistics.median(off_step),
            "mask_step_s": statistics.median(mask_step), "mask_row_s": statistics.median(mask_row),
            "device": engine.device_label}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch", type=int, default=8, help="requests in the batch")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians)")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    from ..llm import LLM

    llm = LLM(args.model)
    r = compare(llm, args.batch, args.repeats, args.max_tokens)
    print(f"a JSON schema on {r['batch']} requests ({r['tokens']:.0f} output tokens), median of {r['repeats']} rounds "
          f"on {r['device']}")
    print(f"  step with the mask    {r['step_on_s'] * 1e3:8.2f} ms")
    print(f"  step without          {r['step_off_s'] * 1e3:8.2f} ms   ({r['step_on_s'] / r['step_off_s']:.2f}x)")
    print(f"  the mask itself       {r['mask_step_s'] * 1e3:8.2f} ms per step, {r['mask_row_s'] * 1e6:.0f} us per "
          f"request ({r['mask_step_s'] / r['step_on_s']:.0%} of a constrained step)")


if __name__ == "__main__":
    main()

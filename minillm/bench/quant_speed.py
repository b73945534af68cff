"""Decode tokens/s at batch 1 for each weight_dtype, side by side in one process.

    python -m minillm.bench.quant_speed                 # default model: fp32 vs int8 vs int4 (g128) vs int4 g32
    python -m minillm.bench.quant_speed --tokens 64 --repeats 5
    python -m minillm.bench.quant_speed --fuse-compare   # + each setting with its decode layers one call at a time

Every setting is an `LLM.with_levers(weight_dtype=...)` of one loaded model (the quantized
engines quantize its float weights in memory). Settings run interleaved, round after round, and
each reports the median over rounds of (tokens - 1) / (time of last token - time of first token)
for one greedy request, so a noisy shared CPU hurts all settings alike. With --fuse-compare every
setting also runs with `runner.fuse_cpu_decode = False` ("layer by layer"): the CPU kernels called
from each layer's Python, instead of a decode step's layers in one C call (models/cpu_decode.py).
"""

from __future__ import annotations

import argparse
import statistics

from ..sampling import SamplingParams

SETTINGS: dict[str, dict] = {
    "model dtype": {},
    "int8": {"weight_dtype": "int8"},
    "int4 g128": {"weight_dtype": "int4", "weight_group_size": 128},
    "int4 g32": {"weight_dtype": "int4", "weight_group_size": 32},
}


def greedy_request(llm, prompt_ids: list[int], tokens: int):
    """One greedy request alone (batch 1, EOS ignored), stepped to the end; its Sequence carries the timings
    (arrival_s, token_times_s) and output_token_ids."""
    engine = llm.engine
    seq = engine.add_request(prompt_ids, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return seq


def decode_tokens_per_s(llm, prompt: str = "Write a short story about a lighthouse keeper.", tokens: int = 32) -> float:
    """One greedy request at batch 1; decode tokens/s from the token timestamps (prefill excluded)."""
    ids = llm.tokenizer.encode(prompt) if llm.tokenizer is not None else list(range(1, 17))
    times = greedy_request(llm, ids, tokens).token_times_s
    return (len(times) - 1) / (times[-1] - times[0])


def compare(llm=None, settings: dict[str, dict] | None = None, tokens: int = 32, repeats: int = 3,
            fuse_compare: bool = False) -> list[dict]:
    """Rows of {setting, weight_MB, tok_s (median), tok_s_all, paths} for every setting (fuse_compare: and
    every setting again as "<setting>, layer by layer", with its runner's fuse_cpu_decode off)."""
    from ..llm import LLM

    llm = llm or LLM()
    settings = settings or SETTINGS
    engines, fused = {}, {}
    for name, levers in settings.items():
        engines[name] = llm.with_levers(**levers) if levers else llm
        fused[name] = True
        if fuse_compare:
            engines[f"{name}, layer by layer"], fused[f"{name}, layer by layer"] = engines[name], False
    for engine in engines.values():  # warm up (first-call allocations, kernel dispatch)
        decode_tokens_per_s(engine, tokens=4)
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            runner = engine.engine.runner
            runner.fuse_cpu_decode = fused[name]
            try:
                runs[name].append(decode_tokens_per_s(engine, tokens=tokens))
            finally:
                runner.fuse_cpu_decode = True
    rows = []
    for name, engine in engines.items():
        paths = sorted({m.path for m in engine.engine.model.modules() if hasattr(m, "path")})
        rows.append({"setting": name, "weight_MB": engine.weight_bytes / 1e6, "tok_s": statistics.median(runs[name]),
                     "tok_s_all": runs[name], "paths": paths})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--fuse-compare", action="store_true",
                        help="also run every setting with its decode layers one call at a time (fuse_cpu_decode off)")
    args = parser.parse_args(argv)
    import torch

    from ..llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)

    llm = LLM(args.model)
    rows = compare(llm, tokens=args.tokens, repeats=args.repeats, fuse_compare=args.fuse_compare)
    base = rows[0]["tok_s"]
    print(f"decode at batch 1, {args.tokens} tokens, median of {args.repeats} interleaved rounds "
          f"on {llm.engine.device_label}, torch threads {torch.get_num_threads()}")
    width = max(13, max(len(r["setting"]) for r in rows) + 1)
    print(f"{'setting':<{width}}{'weights MB':>11}{'tok/s':>8}{'vs base':>9}  runs            path")
    for r in rows:
        runs = " ".join(f"{v:.1f}" for v in r["tok_s_all"])
        print(f"{r['setting']:<{width}}{r['weight_MB']:>11.1f}{r['tok_s']:>8.1f}{r['tok_s'] / base:>8.2f}x  {runs:<15} "
              f"{','.join(r['paths']) or 'F.linear'}")


if __name__ == "__main__":
    main()

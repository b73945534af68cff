"""Batch-1 decode and a long prompt's prefill on a quiet CPU and beside a second CPU-bound process, with the
thread policy and without.

    python -m minillm.bench.busy                 # default model, fp32: decode, and TTFT of a 2048-token prompt
    python -m minillm.bench.busy --weight-dtype int8 --tokens 32 --prompt-tokens 4096

A learner's laptop is rarely idle (JupyterLab, a browser, another notebook). The busy process here is
one Python loop keeping one core busy (`python -c 'while True: pass'`). Rows:

  cpu_threads="auto"   the engine's default (engine/thread_policy.py): one thread fewer while another
                       process keeps a core busy
  cpu_threads=N        N fixed threads (N = the usable cores): every parallel region waits for the
                       thread that shares its core with the busy process

Each row: decode tokens/s idle, then busy (the busy process started before the engine's next interval),
and busy / idle; then the time to first token of one long prompt, idle and busy. The policy re-decides at
most once a second, between steps: a long prompt is prefilled in chunks (chunked prefill, the engine's
default), so a prefill of several seconds is re-decided between its chunks. What to expect: the busy process
may take about its share (one core of two: the busy rate near the one-thread rate, TTFT within 2x of idle),
not 10-20x.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch

from ..threads import usable_cpus
from .prefill import prompt_ids
from .quant_speed import decode_tokens_per_s, greedy_request


def _rate(llm, tokens: int, repeats: int) -> float:
    return statistics.median(decode_tokens_per_s(llm, tokens=tokens) for _ in range(repeats))


def _ttft(llm, ids: list[int], repeats: int) -> float:
    """The median time to first token of one greedy request on `ids` (its prefill)."""
    runs = [greedy_request(llm, ids, 1) for _ in range(repeats)]
    return statistics.median(seq.token_times_s[0] - seq.arrival_s for seq in runs)


def measure(llm, tokens: int = 32, repeats: int = 3, settle_s: float = 2.5, prompt_tokens: int = 2048) -> list[dict]:
    """Rows {setting, idle, busy, ratio, threads_busy, ttft_idle, ttft_busy, ttft_ratio} for cpu_threads="auto" and
    the fixed count (ttft: one prompt of prompt_tokens, at most the context; 0 leaves TTFT out)."""
    prompt_tokens = min(prompt_tokens, llm.engine.max_model_len - 1)
    ids = prompt_ids(prompt_tokens, llm.engine.model_config.vocab_size) if prompt_tokens > 0 else None
    cores = len(usable_cpus())
    engines = {'cpu_threads="auto"': llm if llm.config.cpu_threads == "auto" else llm.with_levers(cpu_threads="auto"),
               f"cpu_threads={cores}": llm.with_levers(cpu_threads=cores)}
    rows = []
    for name, engine in engines.items():
        torch.set_num_threads(cores)
        if engine.engine.thread_policy is not None:       # a fresh policy: idle, all cores
            engine.engine.thread_policy.reset()
        decode_tokens_per_s(engine, tokens=4)            # warm-up
        idle = _rate(engine, tokens, repeats)
        ttft_idle = _ttft(engine, ids, repeats) if ids else None
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            end = time.monotonic() + settle_s            # the policy sees the busy core within its interval
            while time.monotonic() < end:
                decode_tokens_per_s(engine, tokens=2)
            busy = _rate(engine, max(tokens // 2, 4), repeats)
            threads_busy = torch.get_num_threads()
            ttft_busy = _ttft(engine, ids, repeats) if ids else None
        finally:
            hog.kill()
            hog.wait()
        rows.append({"setting": name, "idle": idle, "busy": busy, "ratio": busy / idle, "threads_busy": threads_busy,
                     "prompt_tokens": prompt_tokens, "ttft_idle": ttft_idle, "ttft_busy": ttft_busy,
                     "ttft_ratio": ttft_busy / ttft_idle if ids else None})
    torch.set_num_threads(cores)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--weight-dtype", default=None, choices=["int8", "int4"])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=2048,
                        help="the long prompt whose time to first token is measured (0: decode only)")
    args = parser.parse_args(argv)
    from ..llm import LLM

    levers = {"weight_dtype": args.weight_dtype} if args.weight_dtype else {}
    llm = LLM(args.model, **levers)
    rows = measure(llm, tokens=args.tokens, repeats=args.repeats, prompt_tokens=args.prompt_tokens)
    print(f"batch-1 decode, {args.weight_dtype or 'model dtype'}, on {llm.engine.device_label}, "
          f"{len(usable_cpus())} usable cores; busy = one other process spinning on one core")
    print(f"{'setting':<20}{'idle tok/s':>11}{'busy tok/s':>11}{'busy/idle':>10}{'threads when busy':>19}")
    for r in rows:
        print(f"{r['setting']:<20}{r['idle']:>11.1f}{r['busy']:>11.1f}{r['ratio']:>9.0%}{r['threads_busy']:>19}")
    if rows and rows[0]["ttft_idle"] is not None:
        print(f"time to first token of a {rows[0]['prompt_tokens']}-token prompt (chunked prefill: "
              f"{llm.engine.config.max_num_batched_tokens} tokens a step)")
        print(f"{'setting':<20}{'idle TTFT s':>12}{'busy TTFT s':>12}{'busy/idle':>10}")
        for r in rows:
            print(f"{r['setting']:<20}{r['ttft_idle']:>12.2f}{r['ttft_busy']:>12.2f}{r['ttft_ratio']:>9.2f}x")


if __name__ == "__main__":
    main()

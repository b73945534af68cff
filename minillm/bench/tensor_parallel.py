"""Tensor parallelism's communication, measured: all-reduce bytes and time per step beside the compute.

    python -m minillm.bench.tensor_parallel                       # = minillm bench --tensor-parallel 3
    python -m minillm.bench.tensor_parallel --tensor-parallel 3 --num-requests 4 --max-tokens 16
    python -m minillm.bench.tensor_parallel --quick               # a tiny random model, N = 2: seconds

One workload (num_requests prompts of prompt_tokens, max_tokens each, greedy) runs at N = 1 and at the
N asked, stepping the engine by hand; per step, rank 0's TPGroup counts its collectives. Per N and step
kind (prefill / decode) the table prints: steps; step ms (the whole step: schedule, forward on every rank,
sample); all-reduce ms and its share of the step; all-reduces per step; all-reduce KiB per step; all-gather
(the head's logits) ms and KiB per step; and "other ms" = step - all-reduce - all-gather, what is left for
compute and the call broadcast. The bytes are this rank's tensors (each rank sends and receives about
2 (N-1)/N of them in a ring): a Llama layer all-reduces [tokens, hidden] twice, the embedding once, so
a step moves (2 layers + 1) x tokens x hidden x bytes per value; the last line checks the measured bytes
against that count. Greedy tokens at N equal N = 1's (checked, printed).

On one CPU the N ranks share its cores: on 2 cores N = 3 is slower than N = 1 (three processes on two
cores, and every all-reduce waits for the slowest rank to be scheduled). The point here is the mechanism
and its cost per step; on GPUs with NVLink the all-reduce is microseconds and each rank reads 1/N of the
weights, which is what makes decode faster.
"""

from __future__ import annotations

import argparse
import time

from ..hardware import device_name

QUICK_MODEL = "random:tiny-llama-tp"


def _prompts(llm, num_requests: int, prompt_tokens: int) -> list[dict]:
    """num_requests prompts of prompt_tokens ids (minillm's chat prompts, cut or repeated, when there is a tokenizer)."""
    vocab = llm.model_config.vocab_size
    if llm.tokenizer is not None:
        from ..bench.workloads import chat_workload

        ids = [r.prompt["prompt_token_ids"] for r in chat_workload(num_requests, 1, llm.tokenizer)]   # chat template
        ids = [(x * (-(-prompt_tokens // len(x))))[-prompt_tokens:] for x in ids]   # the end: each question
    else:
        ids = [[(7 * i + 13 * j + 3) % vocab for j in range(prompt_tokens)] for i in range(num_requests)]
    return [{"prompt_token_ids": x} for x in ids]


def measure(model: str | None, tensor_parallel_size: int, prompts: list[dict], max_tokens: int,
            levers: dict | None = None, llm=None) -> dict:
    """Run `prompts` on an engine with tensor_parallel_size; per step: kind, seconds, collectives' bytes and seconds."""
    from .. import LLM, SamplingParams

    own = llm is None
    if own:
        llm = LLM(model, tensor_parallel_size=tensor_parallel_size, **(levers or {}))
    try:
        engine = llm.engine
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))   # warm-up: first-call allocations
        tp = engine.tensor_parallel
        engine.reset_stats()
        seqs = [engine.add_request(p["prompt_token_ids"], params) for p in prompts]
        steps = []
        while engine.has_unfinished():
            comm = tp.group.reset_stats() if tp is not None else None
            t0 = time.perf_counter()
            engine.step()
            step_s = time.perf_counter() - t0
            st = engine.stats.steps[-1]
            steps.append(dict(kind="decode" if st.kind == "decode" else "prefill", step_s=step_s,
                              num_tokens=st.num_tokens,
                              allreduce_s=comm.allreduce_s if comm else 0.0,
                              allreduce_bytes=comm.allreduce_bytes if comm else 0,
                              allreduce_calls=comm.allreduce_calls if comm else 0,
                              allgather_s=comm.allgather_s if comm else 0.0,
                              allgather_bytes=comm.allgather_bytes if comm else 0))
        tokens = [s.output_token_ids for s in seqs]
        cfg = llm.model_config
        value_bytes = llm.dtype.itemsize if hasattr(llm.dtype, "itemsize") else 4
        return dict(n=tensor_parallel_size, steps=steps, tokens=tokens, hidden=cfg.hidden_size,
                    num_layers=cfg.num_layers, value_bytes=value_bytes, device=llm.device)
    finally:
        if own:
            llm.shutdown()


def summarize(run: dict) -> list[dict]:
    """One row per step kind: means per step."""
    rows = []
    for kind in ("prefill", "decode"):
        steps = [s for s in run["steps"] if s["kind"] == kind]
        if not steps:
            continue
        k = len(steps)

        def mean(key):
            return sum(s[key] for s in steps) / k

        rows.append(dict(n=run["n"], kind=kind, steps=k, step_ms=1e3 * mean("step_s"),
                         allreduce_ms=1e3 * mean("allreduce_s"), allreduces=mean("allreduce_calls"),
                         allreduce_kib=mean("allreduce_bytes") / 1024, allgather_ms=1e3 * mean("allgather_s"),
                         allgather_kib=mean("allgather_bytes") / 1024,
                         other_ms=1e3 * (mean("step_s") - mean("allreduce_s") - mean("allgather_s"))))
    return rows


def expected_allreduce_bytes(run: dict, step: dict) -> int:
    """(2 x layers + 1) all-reduces of [tokens, hidden] per step (o_proj and down_proj per layer, the embedding)."""
    return (2 * run["num_layers"] + 1) * step["num_tokens"] * run["hidden"] * run["value_bytes"]


def format_table(rows: list[dict]) -> str:
    head = (f"{'N':>2}  {'step':<7} {'steps':>5} {'step ms':>8} {'all-reduce ms':>13} {'share':>6} "
            f"{'all-reduces':>11} {'all-reduce KiB':>14} {'all-gather ms':>13} {'all-gather KiB':>14} {'other ms':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        share = r["allreduce_ms"] / r["step_ms"] if r["step_ms"] else 0.0
        lines.append(f"{r['n']:>2}  {r['kind']:<7} {r['steps']:>5} {r['step_ms']:>8.1f} {r['allreduce_ms']:>13.1f} "
                     f"{share:>6.0%} {r['allreduces']:>11.0f} {r['allreduce_kib']:>14.1f} {r['allgather_ms']:>13.1f} "
                     f"{r['allgather_kib']:>14.1f} {r['other_ms']:>8.1f}")
    return "\n".join(lines)


def run(model: str | None, tensor_parallel_size: int, num_requests: int, prompt_tokens: int, max_tokens: int,
        levers: dict | None = None) -> dict:
    """The N = 1 and N runs (with tqdm progress), their rows and the checks; prints the table."""
    from tqdm.auto import tqdm

    from .. import LLM

    levers = dict(levers or {})
    results = {}
    for n in tqdm([1, tensor_parallel_size], desc="tensor-parallel bench", unit="engine"):
        llm = LLM(model, tensor_parallel_size=n, **levers)
        try:
            prompts = _prompts(llm, num_requests, prompt_tokens)
            results[n] = measure(model, n, prompts, max_tokens, llm=llm)
        finally:
            llm.shutdown()
    one, many = results[1], results[tensor_parallel_size]
    rows = summarize(one) + summarize(many)
    import torch

    print(f"tensor parallelism: {model or 'default model (SmolLM2-135M-Instruct)'}, {num_requests} requests x "
          f"{prompt_tokens} prompt + {max_tokens} output tokens, greedy; {device_name(torch.device('cpu'))}, "
          f"{torch.get_num_threads()} torch threads in rank 0, 1 in each worker")
    print(format_table(rows))
    by = {(r["n"], r["kind"]): r for r in rows}
    decode_1, decode_n = by.get((1, "decode")), by.get((tensor_parallel_size, "decode"))
    if decode_1 and decode_n:
        print(f"\ndecode step at N={tensor_parallel_size}: {decode_n['step_ms'] / decode_1['step_ms']:.2f}x the N=1 step "
              f"({decode_n['step_ms']:.1f} vs {decode_1['step_ms']:.1f} ms); all-reduce is "
              f"{decode_n['allreduce_ms'] / decode_n['step_ms']:.0%} of it, "
              f"{decode_n['allreduce_ms'] / max(decode_n['allreduces'], 1) * 1e3:.0f} us per all-reduce")
    counted = all(s["allreduce_bytes"] == expected_allreduce_bytes(many, s) for s in many["steps"])
    same = one["tokens"] == many["tokens"]
    print(f"all-reduce bytes = (2 x {many['num_layers']} layers + 1) x tokens x {many['hidden']} x "
          f"{many['value_bytes']} B on every step: {counted}; greedy tokens at N={tensor_parallel_size} equal N=1's: "
          f"{same}")
    return dict(rows=rows, runs=results, bytes_match=counted, tokens_match=same)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench.tensor_parallel",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct; --quick: "
                                                      f"{QUICK_MODEL})")
    parser.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                        help="ranks to compare with N=1 (default 3; --quick: 2)")
    parser.add_argument("--num-requests", type=int, default=None, help="requests in the batch (default 4)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="tokens per prompt (default 32)")
    parser.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 16)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_MODEL}, N=2, 2 requests x 8 + 4 tokens")
    args = parser.parse_args(argv)
    quick = args.quick
    model = args.model or (QUICK_MODEL if quick else None)
    n = args.tensor_parallel or (2 if quick else 3)
    if n < 2:
        parser.error(f"--tensor-parallel {n}: give N >= 2 (N = 1 runs anyway, for comparison)")
    result = run(model, n, args.num_requests or (2 if quick else 4), args.prompt_tokens or (8 if quick else 32),
                 args.max_tokens or (4 if quick else 16), levers=dict(max_model_len=512))
    return 0 if result["tokens_match"] and result["bytes_match"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

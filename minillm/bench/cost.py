"""Cost stack: $ per million output tokens as the levers stack, measured side by side in one run.

    minillm cost                                   # default model, 16 requests x 48 tokens
    minillm cost --num-requests 32 --max-tokens 96 --quant int4 --plot cost.png --json cost.json

One workload goes through four stages on one set of loaded weights (`LLM.with_levers`):

    naive                           max_num_seqs=1, paged=False: one request after another
    + continuous batching + paging  batching="continuous", paged=True, max_num_seqs=16 (--batch)
    + int8 weights                  weight_dtype="int8" (--quant int4 | int8 | fp8)
    + speculative decoding          speculative="ngram", num_speculative_tokens=4

Each stage reports output tokens / wall time (prefill included: what a user pays for) and
$/Mtok = cost_per_million(tokens/s, hourly price). The workload mixes chat questions with
requests that ask for a paragraph back (so n-gram speculation finds its proposals in the
prompt); every request makes exactly --max-tokens greedy tokens (ignore_eos), so every stage
does the same work. Batching and speculation keep greedy output token for token in the model
dtype; quantized weights need not (nor, as measured on the default model, speculation on int8
weights: the int8 matmul returns bfloat16, so two logits are often exactly tied, and a verify pass
over k+1 positions carries hidden states that differ from a one-token decode's in the last fp32
bits, enough to break such a tie the other way; the int8 matmul itself gives each row the same bits
whatever the row count), so each stage prints how many outputs equal the naive stage's and the
stage before's.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

from ..config import WEIGHT_DTYPES
from ..sampling import SamplingParams
from .workloads import Request, shipped_corpus, shipped_prompts

QUANT_CHOICES = WEIGHT_DTYPES   # the quantization stage's weight_dtype


def cost_per_million(tokens_per_s: float, hourly_usd: float) -> float:
    """USD per million output tokens: hourly_usd / 3600 / tokens_per_s * 1e6.

    The course's H100 example at 2.50 $/h (illustrative throughputs):

        stage                          tok/s   $/Mtok
        naive, one request at a time    33.3    20.83   (30 ms per token: 100/3 tok/s)
        + continuous batching            466     1.49
        + quantization                   747     0.93
        + speculative decoding          1335     0.52

    >>> round(cost_per_million(466, 2.50), 2)
    1.49
    """
    if not (isinstance(tokens_per_s, (int, float)) and math.isfinite(tokens_per_s) and tokens_per_s > 0):
        raise ValueError(f"tokens_per_s={tokens_per_s!r} must be a finite number > 0 (nothing was generated?)")
    if not (isinstance(hourly_usd, (int, float)) and math.isfinite(hourly_usd) and hourly_usd >= 0):
        raise ValueError(f"hourly_usd={hourly_usd!r} must be a finite number >= 0 (USD per hour of the device)")
    return hourly_usd / 3600.0 / tokens_per_s * 1e6


@dataclass
class CostStage:
    name: str
    levers: dict                     # the stage's full engine levers (stages stack: each repeats the last's)
    sequential: bool = False         # True: requests one after another (no batching)


def default_stages(batch: int = 16, quant: str = "int8", num_speculative_tokens: int = 4) -> list[CostStage]:
    """naive -> + continuous batching + paging -> + quantized weights -> + n-gram speculation."""
    if quant not in QUANT_CHOICES:
        raise ValueError(f"quant={quant!r} is not one of {QUANT_CHOICES}")
    if not (isinstance(batch, int) and batch >= 2):
        raise ValueError(f"batch={batch!r} must be an integer >= 2 (max_num_seqs of the batched stages)")
    plain = {"weight_dtype": None, "speculative": None, "prefix_caching": False, "kv_cache": True}
    batched = {**plain, "batching": "continuous", "paged": True, "max_num_seqs": batch}
    quantized = {**batched, "weight_dtype": quant}
    return [
        CostStage("naive", {**plain, "max_num_seqs": 1, "paged": False}, sequential=True),
        CostStage("+ continuous batching + paging", batched),
        CostStage(f"+ {quant} weights", quantized),
        CostStage("+ speculative decoding", {**quantized, "speculative": "ngram",
                                             "num_speculative_tokens": num_speculative_tokens}),
    ]


@dataclass
class CostRow:
    stage: str
    levers: dict
    levers_text: str                 # what this stage changed from the one before
    sequential: bool
    num_requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float              # output tokens / wall seconds (prefill included)
    ratio_vs_naive: float            # tokens_per_s / the first stage's
    hourly_usd: float
    usd_per_mtok: float
    same_tokens: int                 # outputs identical to the first stage's, token for token
    same_as_previous: int = 0        # outputs identical to the stage before's (e.g. speculation keeps int8's)
    peak_running: int = 1            # most sequences decoding at once
    acceptance_rate: float | None = None   # speculative stages: accepted / proposed
    outputs: list[list[int]] = field(default_factory=list, repr=False)


def cost_workload(llm, num_requests: int = 16, max_tokens: int = 48) -> list[Request]:
    """Even requests ask for a paragraph of data/corpus.txt back (answers repeat the prompt),
    odd ones ask a question of data/prompts.txt; every request makes max_tokens greedy tokens.
    A model without a chat template gets token ids of the same two kinds (a repeated run; a random one)."""
    import random

    from .speculative import INSTRUCTIONS

    if not (isinstance(num_requests, int) and num_requests >= 1):
        raise ValueError(f"num_requests={num_requests!r} must be an integer >= 1")
    if not (isinstance(max_tokens, int) and max_tokens >= 2):
        raise ValueError(f"max_tokens={max_tokens!r} must be an integer >= 2")
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = []
    if getattr(llm.tokenizer, "chat_template", None):
        paragraphs = [p.strip() for p in shipped_corpus().split("\n\n") if len(p.split()) >= 60]
        questions = shipped_prompts()
        for i in range(num_requests):
            if i % 2 == 0:
                text = f"{INSTRUCTIONS[(i // 2) % len(INSTRUCTIONS)]}\n\n{paragraphs[(i // 2) % len(paragraphs)]}"
            else:
                text = questions[(i // 2) % len(questions)]
            out.append(Request({"prompt_token_ids": llm.chat_token_ids([{"role": "user", "content": text}])}, params))
        return out
    rng = random.Random(0)
    vocab = llm.model_config.vocab_size
    for i in range(num_requests):
        run = [rng.randrange(3, vocab) for _ in range(24 if i % 2 == 0 else 16)]
        out.append(Request({"prompt_token_ids": run * 2 if i % 2 == 0 else run}, params))
    return out


def _levers_text(levers: dict, before: dict | None, sequential: bool) -> str:
    def show(key, value):
        return f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"

    if before is None:
        shown = [show(k, v) for k, v in levers.items() if k in ("max_num_seqs", "paged")]
        return ", ".join(shown) + (", one request at a time" if sequential else "")
    changed = [show(k, v) for k, v in levers.items() if before.get(k, object()) != v]
    return ", ".join(changed) or "(no change)"


def _run_stage(engine, requests: list[Request], sequential: bool, bar) -> tuple[float, list[list[int]], int, tuple]:
    warm = Request(requests[0].prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.generate(warm.prompt, warm.params)   # first-call allocations and kernel choice out of the timing
    proposed = accepted = 0
    t0 = time.perf_counter()
    if sequential:
        outs = []
        for req in requests:
            outs.append(engine.generate(req.prompt, req.params)[0])
            proposed += engine.stats.spec.num_proposed
            accepted += engine.stats.spec.num_accepted
            bar.update(1)
        peak = 1
    else:
        outs = engine.generate([r.prompt for r in requests], [r.params for r in requests])
        proposed, accepted = engine.stats.spec.num_proposed, engine.stats.spec.num_accepted
        peak = engine.stats.peak_running
        bar.update(len(requests))
    wall_s = time.perf_counter() - t0
    return wall_s, [o.outputs[0].token_ids for o in outs], peak, (proposed, accepted)


def cost_stack(llm, *, stages: list[CostStage] | None = None, requests: list[Request] | None = None,
               hourly_usd: float | None = None, progress: bool = True) -> list[CostRow]:
    """Run one workload under each stage's levers (weights loaded once) and price each stage.

    stages: default_stages() when None (the first stage is the reference for ratios and tokens).
    requests: cost_workload(llm) when None. hourly_usd: the engine's price for its device when None."""
    from tqdm.auto import tqdm

    stages = default_stages() if stages is None else [s if isinstance(s, CostStage) else CostStage(*s) for s in stages]
    if not stages:
        raise ValueError("stages is empty: give at least one CostStage")
    requests = cost_workload(llm) if requests is None else list(requests)
    if not requests:
        raise ValueError("requests is empty: give at least one Request")
    hourly = llm.engine.hourly_usd if hourly_usd is None else hourly_usd
    cost_per_million(1.0, hourly)   # validates the price before minutes of work
    rows: list[CostRow] = []
    with tqdm(total=len(stages) * len(requests), desc="cost stack", unit="req", disable=not progress) as bar:
        for i, stage in enumerate(stages):
            bar.set_postfix_str(stage.name)
            engine = llm.with_levers(**stage.levers)
            try:
                wall_s, outputs, peak, (proposed, accepted) = _run_stage(engine, requests, stage.sequential, bar)
            finally:
                del engine   # one KV pool at a time
                gc.collect()
            tokens = sum(len(o) for o in outputs)
            tok_s = tokens / wall_s
            ref = rows[0] if rows else None
            rows.append(CostRow(
                stage=stage.name, levers=dict(stage.levers),
                levers_text=_levers_text(stage.levers, stages[i - 1].levers if i else None, stage.sequential),
                sequential=stage.sequential, num_requests=len(requests), output_tokens=tokens, wall_s=wall_s,
                tokens_per_s=tok_s, ratio_vs_naive=tok_s / ref.tokens_per_s if ref else 1.0, hourly_usd=hourly,
                usd_per_mtok=cost_per_million(tok_s, hourly),
                same_tokens=sum(a == b for a, b in zip(outputs, ref.outputs)) if ref else len(outputs),
                same_as_previous=sum(a == b for a, b in zip(outputs, rows[-1].outputs)) if rows else len(outputs),
                peak_running=peak, acceptance_rate=accepted / proposed if proposed else None, outputs=outputs))
    return rows


def format_cost_stack(rows: list[CostRow], device: str) -> str:
    first = rows[0]
    lines = [f"cost stack on {device} at {first.hourly_usd:.2f} USD/hour: {first.num_requests} requests, "
             f"{first.output_tokens} output tokens per stage (greedy, ignore_eos; tok/s include prefill)"]
    width = max(len(r.stage) for r in rows) + 2
    head = (f"{'stage':<{width}}{'out tok/s':>10}{'vs naive':>10}{'$/Mtok':>10}{'batch':>7}"
            f"{'same tokens':>19}  levers")
    lines += [head, "-" * len(head)]
    for r in rows:
        same = "ref" if r is first else f"{r.same_tokens}/{r.num_requests}"
        if r is not first and r is not rows[1] and r.same_as_previous != r.same_tokens:
            same += f" ({r.same_as_previous} prev)"
        extra = f"; acceptance {r.acceptance_rate:.0%}" if r.acceptance_rate is not None else ""
        lines.append(f"{r.stage:<{width}}{r.tokens_per_s:>10.1f}{r.ratio_vs_naive:>9.2f}x{r.usd_per_mtok:>10.3f}"
                     f"{r.peak_running:>7}{same:>19}  {r.levers_text}{extra}")
    for prev, r in zip(rows, rows[1:]):
        if r.tokens_per_s < prev.tokens_per_s:
            lines.append(f"note: '{r.stage}' is slower here than the stage before it "
                         f"({r.tokens_per_s / prev.tokens_per_s:.2f}x): it costs more per token on {device}")
    lines.append("same tokens: greedy outputs equal to naive's (and to the stage before's, when that differs)")
    lines.append(f"$/Mtok = {first.hourly_usd:.2f} / 3600 / (tok/s) * 1e6; change the price with --hourly-usd")
    return "\n".join(lines)


def plot_cost_stack(rows: list[CostRow], device: str, path: str | None = None, ax=None, log: bool = False):
    """Bars of $/Mtok per stage, each labelled with its value and ratio vs naive. Writes a PNG when
    `path` is given (and returns it); otherwise returns the matplotlib Axes (drawn into `ax` if given)."""
    try:
        import matplotlib

        if ax is None and path is not None:
            matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'minillm[lab]' (or pip install matplotlib)") from exc
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4.2))
    values = [r.usd_per_mtok for r in rows]
    bars = ax.bar([r.stage for r in rows], values, color="tab:green")
    for bar, r in zip(bars, rows):
        ax.annotate(f"${r.usd_per_mtok:.3g}\n{r.ratio_vs_naive:.2f}x tok/s", (bar.get_x() + bar.get_width() / 2,
                    bar.get_height()), ha="center", va="bottom", fontsize=8)
    if log:
        ax.set_yscale("log")
    ax.set_ylim(top=max(values) * (3 if log else 1.25))
    ax.set_ylabel("USD per million output tokens")
    ax.set_title(f"cost stack on {device} at {rows[0].hourly_usd:.2f} USD/h")
    ax.tick_params(axis="x", rotation=15)
    if path is not None:
        from pathlib import Path

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        (fig or ax.figure).tight_layout()
        (fig or ax.figure).savefig(path, dpi=110)
        if fig is not None:
            plt.close(fig)
        return path
    return ax


def rows_to_json(rows: list[CostRow], device: str) -> dict:
    return {"device": device, "hourly_usd": rows[0].hourly_usd,
            "rows": [{k: v for k, v in asdict(r).items() if k != "outputs"} for r in rows]}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minillm cost", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF directory, hub id or random:<preset> (default: SmolLM2-135M-Instruct)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48, help="output tokens per request")
    p.add_argument("--batch", type=int, default=16, help="max_num_seqs of the batched stages")
    p.add_argument("--quant", choices=QUANT_CHOICES, default="int8", help="weight_dtype of the quantization stage")
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="k of the n-gram speculation stage")
    p.add_argument("--hourly-usd", type=float, default=None,
                   help="price of the device per hour (default: the engine's for this device, "
                        "DEFAULT_CPU_HOURLY_USD or DEFAULT_GPU_HOURLY_USD)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--plot", default=None, metavar="PNG", help="also draw $/Mtok per stage into this PNG")
    p.add_argument("--log", action="store_true", help="log-scale $/Mtok axis in --plot")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows to this file")
    p.add_argument("--no-progress", action="store_true")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..llm import LLM

    try:
        stages = default_stages(args.batch, args.quant, args.num_speculative_tokens)
        llm = LLM(args.model, device=args.device)
        requests = cost_workload(llm, args.num_requests, args.max_tokens)
        rows = cost_stack(llm, stages=stages, requests=requests, hourly_usd=args.hourly_usd,
                          progress=not args.no_progress)
    except (ValueError, FileNotFoundError, NotImplementedError, TypeError) as exc:
        print(f"minillm cost: {exc}", file=sys.stderr)
        return 2
    print(format_cost_stack(rows, llm.device))
    if args.plot:
        print(f"plot: {plot_cost_stack(rows, llm.device, args.plot, log=args.log)}")
    if args.json:
        from pathlib import Path

        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows_to_json(rows, llm.device), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

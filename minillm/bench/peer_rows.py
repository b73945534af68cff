"""The peer comparison's rows from its timings: decode tok/s, TTFT, % of the bandwidth bound, agreement; tables.

No engine runs here (minillm/bench/peers.py runs them): summarize turns Runs into Rows, format_peers and
format_peers_markdown print them.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from .compare import _median_rate

BASE = "minillm fp32"
CT2_INT8 = "CTranslate2 int8"
AGREE_TOKENS = 16      # greedy agreement is checked on each prompt's first 16 tokens


@dataclass
class Run:
    """One greedy request, timed from the moment the prompt is handed over."""
    ttft_s: float          # to the first new token
    last_s: float          # to the N-th (last) new token
    tokens: list[int]      # the N new token ids


@dataclass
class Row:
    engine: str
    weight_bytes: int | None = None     # bytes of weights this format reads per decode step
    skipped: str | None = None          # why this row has no numbers ("not installed", ...)
    tok_s: float | None = None          # decode tokens/s: median over rounds of the per-round median over prompts
    tok_s_rounds: list[float] = field(default_factory=list)
    ttft_ms: float | None = None        # median over every request
    pct_of_bound: float | None = None   # tok_s / (bandwidth / weight_bytes), in %
    vs_base: float | None = None        # tok_s / minillm fp32's
    agree: int | None = None            # prompts whose first AGREE_TOKENS tokens equal minillm fp32's


# ------------------------------------------------------------------ the rows from the timings (no engine here)
def summarize(runs: dict[str, list[list[Run]]], weight_bytes: dict[str, int | None], skipped: dict[str, str],
              bandwidth: float, base: str = BASE) -> list[Row]:
    """runs[engine][round][prompt] -> one Row per engine (skipped engines keep their reason), ratios filled in."""
    rows = []
    for name in list(runs) + [n for n in skipped if n not in runs]:
        if name in skipped:
            rows.append(Row(name, weight_bytes.get(name), skipped=skipped[name]))
            continue
        rounds = runs[name]
        per_round = [_median_rate([r.ttft_s for r in rnd], [r.last_s for r in rnd], len(rnd[0].tokens))
                     for rnd in rounds]
        row = Row(name, weight_bytes.get(name), tok_s=statistics.median(per_round), tok_s_rounds=per_round,
                  ttft_ms=1e3 * statistics.median(r.ttft_s for rnd in rounds for r in rnd))
        if row.weight_bytes:
            row.pct_of_bound = 100 * row.tok_s * row.weight_bytes / bandwidth
        rows.append(row)
    by_name = {r.engine: r for r in rows}
    ref = by_name.get(base)
    if ref is not None and ref.tok_s:
        ref_tokens = [r.tokens[:AGREE_TOKENS] for r in runs[base][0]]
        for row in rows:
            if row.tok_s is not None:
                row.vs_base = row.tok_s / ref.tok_s
                row.agree = sum(r.tokens[:AGREE_TOKENS] == want for r, want in zip(runs[row.engine][0], ref_tokens))
    return rows


def best_minillm_vs(rows: list[Row], other: str = CT2_INT8) -> tuple[str, float] | None:
    """(the fastest minillm row, its tok/s over `other`'s), or None when either has no numbers."""
    ours = [r for r in rows if r.engine.startswith("minillm") and r.tok_s]
    theirs = next((r for r in rows if r.engine == other and r.tok_s), None)
    if not ours or theirs is None:
        return None
    best = max(ours, key=lambda r: r.tok_s)
    return best.engine, best.tok_s / theirs.tok_s



def _fmt(value, spec: str, width: int) -> str:
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def format_peers(result: dict) -> str:
    lines = [
        f"batch-1 decode, {result['prompts']} prompts x {result['new_tokens']} new tokens (greedy, EOS ignored), "
        f"median of {result['rounds']} interleaved rounds",
        f"cpu: {result['cpu']}, {result['threads']} threads (torch {result['torch']}); read bandwidth "
        f"{result['bandwidth_gb_s']:.1f} GB/s measured (best of before and after the rounds)",
        f"{'engine':<20}{'weights MB':>11}{'tok/s':>8}{'TTFT ms':>9}{'% bound':>9}{'vs fp32':>9}"
        f"{f'first {AGREE_TOKENS} =fp32':>16}  rounds tok/s",
    ]
    prompts = result["prompts"]
    for r in result["rows"]:
        head = f"{r.engine:<20}{_fmt(r.weight_bytes and r.weight_bytes / 1e6, '.1f', 11)}"
        if r.skipped:
            lines.append(f"{head}  {r.skipped}")
            continue
        lines.append(f"{head}{_fmt(r.tok_s, '.1f', 8)}{_fmt(r.ttft_ms, '.0f', 9)}"
                     f"{_fmt(r.pct_of_bound, '.0f', 8)}%{_fmt(r.vs_base, '.2f', 8)}x"
                     f"{f'{r.agree}/{prompts}' if r.agree is not None else '-':>16}  "
                     + " ".join(f"{v:.1f}" for v in r.tok_s_rounds))
    best = result["best_minillm_vs_ct2_int8"]
    lines.append(f"best minillm ({best[0]}) / CTranslate2 int8: {best[1]:.2f}x" if best else
                 "best minillm / CTranslate2 int8: - (CTranslate2 int8 did not run)")
    lines.append("% bound: decode tok/s over (read bandwidth / that row's weight bytes); greedy agreement is a "
                 "sanity check (quantized formats may part), not a speed claim")
    return "\n".join(lines)


def format_peers_markdown(result: dict) -> str:
    """The same rows as a Markdown table (for docs/PERFORMANCE.md), with the hardware line under it."""
    lines = [f"| engine | weights MB | decode tok/s | TTFT ms | % of bound | vs minillm fp32 | first {AGREE_TOKENS} "
             "tokens = fp32 |", "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        mb = f"{r.weight_bytes / 1e6:.1f}" if r.weight_bytes else ""
        if r.skipped:
            lines.append(f"| {r.engine} | {mb} | {r.skipped} | | | | |")
            continue
        lines.append(f"| {r.engine} | {mb} | {r.tok_s:.1f} | {r.ttft_ms:.0f} | "
                     f"{'' if r.pct_of_bound is None else f'{r.pct_of_bound:.0f}%'} | {r.vs_base:.2f}x | "
                     f"{r.agree}/{result['prompts']} |")
    best = result["best_minillm_vs_ct2_int8"]
    lines.append("")
    lines.append(f"{result['prompts']} prompts x {result['new_tokens']} new tokens, median of {result['rounds']} "
                 f"interleaved rounds; {result['cpu']}, {result['threads']} threads, torch {result['torch']}, "
                 f"read bandwidth {result['bandwidth_gb_s']:.1f} GB/s measured"
                 + (f"; best minillm ({best[0]}) / CTranslate2 int8: **{best[1]:.2f}x**" if best else ""))
    return "\n".join(lines)


def result_json(result: dict) -> dict:
    return {**result, "rows": [asdict(r) for r in result["rows"]]}

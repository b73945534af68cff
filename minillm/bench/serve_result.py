"""What one serving benchmark measured: vLLM's latency summaries (TTFT, TPOT, ITL, E2EL), the table, the JSON."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

from ..serve.client import RequestRecord, percentile

METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


def summarize(values_s: list[float], percentiles=DEFAULT_PERCENTILES) -> dict[str, float]:
    """mean / median / std / p<q> of a list of seconds, in milliseconds (nan when empty)."""
    ms = [v * 1e3 for v in values_s]
    nan = float("nan")
    out = {"mean_ms": statistics.fmean(ms) if ms else nan, "median_ms": statistics.median(ms) if ms else nan,
           "std_ms": statistics.pstdev(ms) if ms else nan}
    for q in percentiles:
        out[f"p{q:g}_ms"] = percentile(ms, q)
    return out


@dataclass
class ServeBenchResult:
    base_url: str
    endpoint: str
    model: str
    num_prompts: int
    request_rate: float
    max_concurrency: int | None
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float           # completed requests / s
    output_throughput: float            # output tokens / s
    total_token_throughput: float       # (input + output) tokens / s
    goodput: float | None               # good requests / s (None without SLOs)
    goodput_slos_ms: dict[str, float]
    num_good: int
    peak_in_flight: int                 # most requests this client had open at once
    percentiles: tuple[float, ...]
    metrics: dict[str, dict[str, float]]   # "ttft" | "tpot" | "itl" | "e2el" -> summarize()
    errors: dict[str, int]              # error message -> count
    records: list[RequestRecord]
    input_tokens_known: bool = True     # False when some successful request had no usage

    def table(self) -> str:
        w = 50

        def line(label: str, value) -> str:
            text = f"{value:.2f}" if isinstance(value, float) else str(value)
            return f"{label:<40}{text:>10}"

        out = ["{s:=^{w}}".format(s=" Serving Benchmark Result ", w=w),
               line("Successful requests:", self.completed),
               line("Failed requests:", self.failed)]
        if self.max_concurrency is not None:
            out.append(line("Maximum request concurrency:", self.max_concurrency))
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        out += [line("Request rate (req/s):", rate),
                line("Benchmark duration (s):", self.duration_s),
                line("Total input tokens:", self.total_input_tokens if self.input_tokens_known
                     else f"{self.total_input_tokens}*"),
                line("Total generated tokens:", self.total_output_tokens),
                line("Request throughput (req/s):", self.request_throughput),
                line("Output token throughput (tok/s):", self.output_throughput),
                line("Total token throughput (tok/s):", self.total_token_throughput)]
        if self.goodput is not None:
            slos = " ".join(f"{k}<={v:g}ms" for k, v in self.goodput_slos_ms.items())
            out.append(line("Request goodput (req/s):", self.goodput))
            out.append(f"  ({self.num_good} of {self.num_prompts} requests met {slos})")
        for name in METRICS:
            m = self.metrics[name]
            out.append("{s:-^{w}}".format(s=METRIC_TITLES[name], w=w))
            out.append(line(f"Mean {name.upper()} (ms):", m["mean_ms"]))
            out.append(line(f"Median {name.upper()} (ms):", m["median_ms"]))
            for q in self.percentiles:
                if q == 50:
                    continue    # the median, printed above
                out.append(line(f"P{q:g} {name.upper()} (ms):", m[f"p{q:g}_ms"]))
        out.append("=" * w)
        if not self.input_tokens_known:
            out.append("* some responses carried no usage: their prompt tokens are not counted")
        for error, count in sorted(self.errors.items(), key=lambda kv: -kv[1])[:5]:
            out.append(f"failed x{count}: {error}")
        return "\n".join(out)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        for r, rec in zip(d["records"], self.records):
            r["tpot_s"] = rec.tpot_s
        return d

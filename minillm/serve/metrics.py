"""Server metrics: counters and histograms the engine thread updates, rendered as Prometheus text.

Names follow vLLM's (`vllm:num_requests_running` -> `minillm_num_requests_running`), with
underscores only, so every Prometheus parser reads them. The engine thread is the only writer;
/metrics reads a consistent-enough snapshot (ints and a list of floats under the GIL).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Seconds. vLLM's TTFT buckets, which span a GPU's milliseconds and a CPU's seconds.
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass
class Histogram:
    """Cumulative buckets as Prometheus wants them: count of observations <= each upper bound."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if list(self.buckets) != sorted(self.buckets):
            raise ValueError(f"histogram buckets {self.buckets} must be increasing")
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, upper in enumerate(self.buckets):
            if value <= upper:
                self.counts[i] += 1
        self.sum += value
        self.count += 1


@dataclass
class ServerMetrics:
    """What the engine thread counts over the server's life."""

    prompt_tokens: int = 0          # prompt tokens of requests that got their first token
    generation_tokens: int = 0      # output tokens streamed to clients
    rejected: int = 0               # requests the engine refused (bad input: HTTP 400)
    step_errors: int = 0            # engine steps that raised (their batch finished with "error")
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    ttft_s: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS_S))
    e2e_s: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS_S))


@dataclass(frozen=True)
class EngineGauges:
    """The engine's state at the moment of the scrape (AsyncEngine.gauges reads the scheduler live)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0      # of those, tokens found
    num_preemptions: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


def _fmt(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _labels(model_name: str, **extra: str) -> str:
    def escape(value) -> str:
        return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in {"model_name": model_name, **extra}.items()) + "}"


def render_prometheus(model_name: str, gauges: EngineGauges, metrics: ServerMetrics) -> str:
    """The Prometheus text exposition format (version 0.0.4): HELP, TYPE, then `name{labels} value`."""
    lines: list[str] = []
    lab = _labels(model_name)

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for sample in samples:  # (value,) for a plain sample, or (sample name, labels, value)
            sample_name, labels, value = sample if len(sample) == 3 else (name, lab, sample[0])
            lines.append(f"{sample_name}{labels} {_fmt(value)}")

    metric("minillm_num_requests_running", "gauge", "Requests in the running batch (holding KV blocks).",
           [(gauges.num_running,)])
    metric("minillm_num_requests_waiting", "gauge", "Requests queued for admission.", [(gauges.num_waiting,)])
    metric("minillm_kv_blocks_used", "gauge", "KV cache blocks held by requests.", [(gauges.kv_blocks_used,)])
    metric("minillm_kv_blocks_total", "gauge", "KV cache blocks in the pool.", [(gauges.kv_blocks_total,)])
    metric("minillm_kv_cache_usage_ratio", "gauge", "KV blocks used / total (0 to 1).", [(gauges.kv_usage,)])
    metric("minillm_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
           [(gauges.prefix_cache_queries,)])
    metric("minillm_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.",
           [(gauges.prefix_cache_hits,)])
    metric("minillm_prefix_cache_hit_rate", "gauge", "Prefix cache hits / queries, in tokens (0 when none).",
           [(gauges.prefix_cache_hit_rate,)])
    metric("minillm_num_preemptions_total", "counter", "Requests whose KV blocks were taken back (recomputed later).",
           [(gauges.num_preemptions,)])
    metric("minillm_prompt_tokens_total", "counter", "Prompt tokens prefilled.", [(metrics.prompt_tokens,)])
    metric("minillm_generation_tokens_total", "counter", "Output tokens generated.",
           [(metrics.generation_tokens,)])
    metric("minillm_request_success_total", "counter", "Finished requests by finish_reason (stop, length, abort, error).",
           [("minillm_request_success_total", _labels(model_name, finished_reason=r), n)
            for r, n in metrics.finished.items()])
    metric("minillm_requests_rejected_total", "counter", "Requests refused at admission (HTTP 400).",
           [(metrics.rejected,)])
    metric("minillm_engine_step_errors_total", "counter", "Engine steps that raised (their batch failed).",
           [(metrics.step_errors,)])
    for name, help_text, hist in (
            ("minillm_time_to_first_token_seconds", "Time from the request's arrival to its first token.",
             metrics.ttft_s),
            ("minillm_e2e_request_latency_seconds", "Time from the request's arrival to its end.", metrics.e2e_s)):
        samples = [(f"{name}_bucket", _labels(model_name, le=_fmt(b)), c) for b, c in zip(hist.buckets, hist.counts)]
        samples.append((f"{name}_bucket", _labels(model_name, le="+Inf"), hist.count))
        samples.append((f"{name}_sum", lab, hist.sum))
        samples.append((f"{name}_count", lab, hist.count))
        metric(name, "histogram", help_text, samples)
    return "\n".join(lines) + "\n"

"""Run a workload on an LLM and summarise it: latency percentiles, throughput, memory, cost, bounds."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from ..hardware import measure_memory_bandwidth
from ..serve.client import percentile
from .workloads import Request


@dataclass
class BenchResult:
    label: str
    device: str
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    peak_kv_bytes: int = 0
    peak_kv_reserved_bytes: int = 0
    weight_bytes: int = 0
    usd_per_hour: float = 0.0
    bandwidth_bytes_per_s: float = 0.0
    mean_context_tokens: float = 0.0
    kv_bytes_per_token: int = 0
    max_batch: int = 1

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def usd_per_million_tokens(self) -> float:
        return self.usd_per_hour / 3600 * self.wall_s / self.output_tokens * 1e6

    @property
    def bytes_per_decode_step(self) -> float:
        """Every weight once, plus each running sequence's K/V (batch 1 at the mean context)."""
        return self.weight_bytes + self.kv_bytes_per_token * self.mean_context_tokens

    @property
    def bound_tokens_per_s(self) -> float:
        """Memory-bandwidth bound on batch-1 decode: bandwidth / bytes read per step."""
        return self.bandwidth_bytes_per_s / self.bytes_per_decode_step

    def row(self) -> dict:
        return {
            "label": self.label,
            "ttft_p50_ms": 1e3 * percentile(self.ttft_s, 50),
            "ttft_p90_ms": 1e3 * percentile(self.ttft_s, 90),
            "tpot_p50_ms": 1e3 * percentile(self.tpot_s, 50),
            "tpot_p90_ms": 1e3 * percentile(self.tpot_s, 90),
            "output_tok_per_s": self.output_tokens_per_s,
            "peak_kv_mib": self.peak_kv_bytes / 2**20,
            "usd_per_mtok": self.usd_per_million_tokens,
            "bound_tok_per_s_b1": self.bound_tokens_per_s,
            "decode_tok_per_s_per_seq": 1.0 / statistics.median(self.tpot_s) if self.tpot_s else float("nan"),
        }


def run_workload(llm, requests: list[Request], label: str = "minillm", warmup: bool = True) -> BenchResult:
    if warmup:  # first calls pay for allocations and kernel selection
        llm.generate([requests[0].prompt], requests[0].params.__class__(max_tokens=2, ignore_eos=True))
    outs = llm.generate([r.prompt for r in requests], [r.params for r in requests])
    stats = llm.stats
    ctx = [o.metrics.num_prompt_tokens + o.metrics.num_output_tokens / 2 for o in outs]
    return BenchResult(
        label=label,
        device=stats.device,
        num_requests=len(outs),
        prompt_tokens=stats.num_prompt_tokens,
        output_tokens=stats.num_output_tokens,
        wall_s=stats.wall_s,
        ttft_s=[o.metrics.ttft_s for o in outs if o.metrics.ttft_s is not None],
        tpot_s=[o.metrics.tpot_s for o in outs if o.metrics.tpot_s is not None],
        peak_kv_bytes=stats.peak_kv_bytes,
        peak_kv_reserved_bytes=stats.peak_kv_reserved_bytes,
        weight_bytes=llm.weight_bytes,
        usd_per_hour=stats.hourly_usd,
        bandwidth_bytes_per_s=measure_memory_bandwidth(),
        mean_context_tokens=sum(ctx) / len(ctx),
        kv_bytes_per_token=llm.engine.kv_bytes_per_token if llm.config.kv_cache else 0,
        max_batch=max((s.num_seqs for s in stats.steps), default=1),
    )

"""Metrics: per-request TTFT / TPOT / ITL / end-to-end, per-step stats, and the cost model."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Times in seconds, measured from the request's arrival (vLLM's definitions)."""

    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float | None        # arrival -> first output token
    tpot_s: float | None        # mean time per output token after the first
    e2e_s: float | None         # arrival -> finish
    queue_s: float | None       # arrival -> first scheduled
    itl_s: list[float] = field(default_factory=list)  # gaps between consecutive tokens
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (prefix_caching=True)

    @classmethod
    def from_sequence(cls, seq) -> "RequestMetrics":
        t0 = seq.arrival_s
        ttft = seq.first_token_s - t0 if seq.first_token_s is not None else None
        e2e = seq.finish_s - t0 if seq.finish_s is not None else None
        times = seq.token_times_s
        itl = [b - a for a, b in zip(times, times[1:])]
        tpot = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        queue = seq.first_scheduled_s - t0 if seq.first_scheduled_s is not None else None
        return cls(seq.num_prompt_tokens, seq.num_output_tokens, ttft, tpot, e2e, queue, itl,
                   seq.prefix_hit_tokens or 0)


@dataclass
class StepStats:
    index: int
    kind: str               # "prefill" | "decode" | "mixed" (chunked prefill: prompt chunks beside decodes)
    num_seqs: int
    num_tokens: int         # tokens fed to the model this step (all of them when kv_cache=False)
    duration_s: float
    kv_bytes_used: int      # bytes of K/V holding real tokens after the step
    kv_bytes_reserved: int = 0  # bytes of pool blocks handed out to sequences after the step
    num_running: int = 0        # sequences holding KV (running) after the step
    # Mixture of experts (models/moe.py): tokens routed to each expert this step, [moe_layer][expert]
    # (a token counts once per expert it chose; every model pass of the step counts). None: a dense model.
    expert_tokens: list[list[int]] | None = None

    @property
    def experts_touched(self) -> list[int] | None:
        """Distinct experts each MoE layer read this step (their weights were loaded), [moe_layer]."""
        return None if self.expert_tokens is None else [sum(n > 0 for n in layer) for layer in self.expert_tokens]


@dataclass
class SpecStats:
    """Counters since the last reset: what speculation proposed, kept, and cost."""
    num_passes: int = 0          # target passes (one per sequence per speculative step)
    num_proposed: int = 0        # proposed tokens
    num_accepted: int = 0        # proposed tokens the verifier kept
    num_emitted: int = 0         # tokens appended (accepted + one corrected / bonus token per pass)
    num_draft_passes: int = 0    # draft model passes (speculative="self"; 0 for n-gram lookup)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens appended per target pass (1.0 = no gain; k + 1 at most)."""
        return self.num_emitted / self.num_passes if self.num_passes else float("nan")

    @property
    def passes_per_token(self) -> float:
        return self.num_passes / self.num_emitted if self.num_emitted else float("nan")


@dataclass
class RunStats:
    """Totals of one generate() call."""

    device: str
    hourly_usd: float
    steps: list[StepStats] = field(default_factory=list)
    wall_s: float = 0.0
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    peak_kv_bytes: int = 0        # bytes of K/V holding real tokens, at the fullest step
    peak_kv_reserved_bytes: int = 0  # bytes of pool blocks handed out, at the fullest step
    # bytes that sharing saved at its peak step: what per-sequence copies of shared blocks (n > 1 forks of one
    # prompt, prefix-cache hits) would add to peak_kv_bytes, which counts a shared block once
    peak_kv_shared_bytes: int = 0
    num_preemptions: int = 0      # sequences whose blocks were taken back and recomputed
    peak_running: int = 0         # most sequences running (holding KV) at once
    # Prefix caching, in tokens (vLLM's counters): every admission queries its whole sequence and
    # hits the tokens found in the cache (a preempted request's re-admission counts again).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the cache, summed over requests
    spec: SpecStats = field(default_factory=SpecStats)   # speculative decoding (speculative= lever)

    def expert_tokens_total(self, kind: str | None = None) -> list[list[int]] | None:
        """Tokens routed to each expert, [moe_layer][expert], summed over the steps (of `kind`, e.g.
        "decode", when given). None: no step recorded expert counts (a dense model)."""
        counted = [s.expert_tokens for s in self.steps if s.expert_tokens is not None and kind in (None, s.kind)]
        if not counted:
            return None
        return [[sum(step[layer][e] for step in counted) for e in range(len(counted[0][layer]))]
                for layer in range(len(counted[0]))]

    def mean_experts_touched(self, kind: str | None = "decode") -> float:
        """Distinct experts a MoE layer read per step, averaged over layers and steps (of `kind`); nan
        when no step recorded expert counts."""
        touched = [sum(s.experts_touched) / len(s.experts_touched) for s in self.steps
                   if s.expert_tokens and kind in (None, s.kind)]
        return sum(touched) / len(touched) if touched else float("nan")

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Fraction of queried tokens found in the prefix cache (nan when nothing was queried)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else float("nan")

    @property
    def kv_utilization(self) -> float:
        """Fraction of reserved KV memory holding real tokens, averaged over the steps.

        The vLLM paper measured 20.4-38.2% in systems that reserve a contiguous region per request."""
        steps = [s for s in self.steps if s.kv_bytes_reserved]
        if not steps:
            return float("nan")
        return sum(s.kv_bytes_used / s.kv_bytes_reserved for s in steps) / len(steps)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cost_per_million_tokens_usd(self) -> float:
        """What the device's time costs per million output tokens at this throughput."""
        if self.num_output_tokens == 0:
            return float("nan")
        return self.hourly_usd / 3600.0 * self.wall_s / self.num_output_tokens * 1e6

    @property
    def prefill_s(self) -> float:
        return sum(s.duration_s for s in self.steps if s.kind == "prefill")

    @property
    def decode_s(self) -> float:
        return sum(s.duration_s for s in self.steps if s.kind == "decode")

    def summary(self) -> dict:
        return {
            "device": self.device,
            "wall_s": self.wall_s,
            "steps": len(self.steps),
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "output_tokens_per_s": self.output_tokens_per_s,
            "peak_kv_bytes": self.peak_kv_bytes,
            "peak_kv_reserved_bytes": self.peak_kv_reserved_bytes,
            "kv_utilization": self.kv_utilization,
            "peak_running": self.peak_running,
            "preemptions": self.num_preemptions,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hit_rate,
            "cached_prompt_tokens": self.num_cached_prompt_tokens,
            "mean_experts_touched_per_decode_step": self.mean_experts_touched("decode"),
            "usd_per_hour": self.hourly_usd,
            "usd_per_million_output_tokens": self.cost_per_million_tokens_usd,
        }

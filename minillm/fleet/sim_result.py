"""SimResult: a finished simulation's requests, replica lives and timeline; TTFT percentiles, cost, tables, plots.

Cost is replica-seconds (starting, serving and draining) x `hourly_usd` / 3600, per million output tokens
served (minillm's cost model, bench/cost.py's cost_per_million).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..serve.client import percentile
from .traffic import SimRequest


@dataclass
class SimResult:
    """A finished simulation: every request's times, the replicas' lives, and a timeline."""

    requests: list[SimRequest]
    replica_spans: list[tuple[float, float]]     # (billed from, billed until) per replica ever started
    timeline: list[dict]                          # every sample_interval_s: t_s, queue, waiting, running, replicas, starting
    scale_events: list[tuple[float, int]]         # (time, new target) whenever the clamped decision changed
    duration_s: float                              # until the last request finished (or the horizon, if later)
    horizon_s: float                               # the traffic's length (duration_s given to simulate)
    hourly_usd: float
    hour_s: float = 3600.0

    def ttfts(self, start_s: float = 0.0, end_s: float = math.inf) -> list[float]:
        return [r.ttft_s for r in self.requests if start_s <= r.arrival_s < end_s and r.ttft_s is not None]

    def ttft_percentile(self, q: float, start_s: float = 0.0, end_s: float = math.inf) -> float:
        """TTFT percentile (seconds) of the requests that arrived in [start_s, end_s)."""
        return percentile(self.ttfts(start_s, end_s), q)

    def replica_seconds(self, start_s: float = 0.0, end_s: float = math.inf) -> float:
        return sum(max(0.0, min(b, end_s) - max(a, start_s)) for a, b in self.replica_spans)

    def output_tokens(self, start_s: float = 0.0, end_s: float = math.inf) -> int:
        return sum(r.output_tokens for r in self.requests if r.finish_s is not None and start_s <= r.finish_s < end_s)

    def usd(self, start_s: float = 0.0, end_s: float = math.inf) -> float:
        return self.replica_seconds(start_s, end_s) * self.hourly_usd / 3600.0

    def usd_per_mtok_between(self, start_s: float = 0.0, end_s: float = math.inf) -> float:
        """Replica cost over output tokens finished in [start_s, end_s), per million (inf if none)."""
        tokens = self.output_tokens(start_s, end_s)
        return self.usd(start_s, end_s) / tokens * 1e6 if tokens else math.inf

    @property
    def usd_per_mtok(self) -> float:
        return self.usd_per_mtok_between()

    def hourly(self) -> list[dict]:
        """One row per simulated hour: arrivals/s, mean and max replicas, mean queue, TTFT p50/p99, $/Mtok."""
        rows = []
        for h in range(max(1, math.ceil(self.horizon_s / self.hour_s - 1e-9))):
            a, b = h * self.hour_s, (h + 1) * self.hour_s
            samples = [s for s in self.timeline if a <= s["t_s"] < b] or [{"replicas": 0, "starting": 0, "queue": 0, "waiting": 0}]
            ttfts = self.ttfts(a, b)
            rows.append({
                "hour": h, "arrivals_per_s": sum(a <= r.arrival_s < b for r in self.requests) / self.hour_s,
                "replicas_mean": self.replica_seconds(a, b) / self.hour_s,
                "replicas_max": max(s["replicas"] + s["starting"] for s in samples),
                "queue_mean": sum(s["queue"] + s["waiting"] for s in samples) / len(samples),
                "queue_max": max(s["queue"] + s["waiting"] for s in samples),
                "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
                "usd_per_mtok": self.usd_per_mtok_between(a, b)})
        return rows

    def hourly_table(self, start_hour: float = 0.0) -> str:
        lines = [f"{'hour':>5} {'req/s':>6} {'replicas':>8} {'max':>4} {'queue':>6} {'qmax':>5} "
                 f"{'TTFT p50':>9} {'TTFT p99':>9} {'$/Mtok':>8}"]
        for row in self.hourly():
            lines.append(f"{start_hour + row['hour']:>5.0f} {row['arrivals_per_s']:>6.2f} {row['replicas_mean']:>8.2f} "
                         f"{row['replicas_max']:>4d} {row['queue_mean']:>6.1f} {row['queue_max']:>5d} "
                         f"{row['ttft_p50_s']:>8.2f}s {row['ttft_p99_s']:>8.2f}s {row['usd_per_mtok']:>8.2f}")
        lines.append(f"whole run: {len(self.requests)} requests, TTFT p50 {self.ttft_percentile(50):.2f} s, "
                     f"p99 {self.ttft_percentile(99):.2f} s, {self.replica_seconds() / 3600:.1f} replica-hours, "
                     f"{self.usd():.2f} $, {self.usd_per_mtok:.2f} $/Mtok")
        return "\n".join(lines)

    def plot(self, path: str | Path, title: str = "simulated fleet", start_hour: float = 0.0) -> Path:
        """Queue, replicas, TTFT p50/p99 (per sample interval) and $/Mtok (per hour) over the run, as a PNG."""
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        hours = [start_hour + s["t_s"] / self.hour_s for s in self.timeline]
        step = self.timeline[1]["t_s"] - self.timeline[0]["t_s"] if len(self.timeline) > 1 else self.hour_s
        p50, p99 = [], []
        for s in self.timeline:
            values = self.ttfts(s["t_s"] - step, s["t_s"])
            p50.append(percentile(values, 50))
            p99.append(percentile(values, 99))
        fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
        axes[0].plot(hours, [s["queue"] + s["waiting"] for s in self.timeline], label="waiting (router + engines)")
        axes[0].set_ylabel("requests")
        axes[0].legend()
        axes[1].step(hours, [s["replicas"] for s in self.timeline], where="post", label="serving")
        axes[1].step(hours, [s["replicas"] + s["starting"] for s in self.timeline], where="post", label="+ starting")
        axes[1].set_ylabel("replicas")
        axes[1].legend()
        axes[2].plot(hours, p50, label="TTFT p50")
        axes[2].plot(hours, p99, label="TTFT p99")
        axes[2].set_ylabel("seconds")
        axes[2].set_yscale("log")
        axes[2].legend()
        rows = self.hourly()
        axes[3].bar([start_hour + r["hour"] + 0.5 for r in rows], [r["usd_per_mtok"] for r in rows], width=0.8)
        axes[3].set_ylabel("$ / Mtok")
        axes[3].set_xlabel("hour of the day")
        fig.suptitle(title)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path

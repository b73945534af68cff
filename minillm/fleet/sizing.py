"""The sizing search: the fewest warm replicas that keep the spike's p99 TTFT under a target, run by run."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import finite, need
from .policies import RayServePolicy
from .replica_profile import ReplicaProfile
from .simulate import FleetConfig, simulate
from .traffic import Traffic, day_requests


@dataclass
class WarmRow:
    warm_replicas: int
    spike_ttft_p99_s: float
    spike_ttft_p50_s: float
    usd_per_mtok: float
    max_replicas_used: int


def warm_replicas_for_p99(target_p99_s: float, profile: ReplicaProfile, config: FleetConfig, traffic: Traffic,
                          seed: int = 0, start_h: float | None = None, end_h: float | None = None,
                          progress: bool = False) -> tuple[int | None, list[WarmRow]]:
    """The fewest warm replicas (min_replicas = initial_replicas = n, the autoscaler free above) that keep
    the p99 TTFT of requests arriving in the traffic's spike under target_p99_s, and the rows tried.

    Each n replays the same arrivals from start_h (default: 2 hours before the spike) to end_h (1 hour
    after it); n goes from 1 up to config.max_replicas and stops at the first that meets the target
    (None if none does). A fresh policy object is not made: give a policy without memory across runs,
    or None (a new RayServePolicy with the config's settings is built per n)."""
    need(finite(target_p99_s, strict=True), f"target_p99_s={target_p99_s!r} must be a number of seconds > 0")
    lo, hi = traffic.spike
    start_h = max(0.0, lo - 2) if start_h is None else start_h
    end_h = min(24.0, hi + 1) if end_h is None else end_h
    need(start_h <= lo and hi <= end_h, f"start_h={start_h}, end_h={end_h} must contain the spike {traffic.spike}")
    requests = day_requests(traffic, seed=seed, start_h=start_h, end_h=end_h)
    spike_a, spike_b = (lo - start_h) * traffic.hour_s, (hi - start_h) * traffic.hour_s
    rows: list[WarmRow] = []
    candidates = range(1, config.max_replicas + 1)
    if progress:
        from tqdm.auto import tqdm
        candidates = tqdm(candidates, desc="warm replicas", unit="run")
    for n in candidates:
        policy = config.policy
        if isinstance(policy, RayServePolicy):   # its decision memory must not leak between runs
            policy = RayServePolicy(policy.target_ongoing_requests, policy.upscale_delay_s, policy.downscale_delay_s,
                                    policy.look_back_period_s, policy.upscaling_factor, policy.downscaling_factor)
        cfg = FleetConfig(**{**{k: getattr(config, k) for k in config.__dataclass_fields__},
                             "min_replicas": n, "initial_replicas": n, "policy": policy})
        result = simulate(requests, profile, cfg, duration_s=(end_h - start_h) * traffic.hour_s, hour_s=traffic.hour_s)
        rows.append(WarmRow(n, result.ttft_percentile(99, spike_a, spike_b), result.ttft_percentile(50, spike_a, spike_b),
                            result.usd_per_mtok, max(s["replicas"] + s["starting"] for s in result.timeline)))
        if rows[-1].spike_ttft_p99_s <= target_p99_s:
            return n, rows
    return None, rows

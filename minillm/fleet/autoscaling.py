"""AutoscalingConfig: Ray Serve's autoscaling_config for the fleet's engine replicas, checked with errors in words."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class AutoscalingConfig:
    """Ray Serve's autoscaling_config for the engine replicas, checked here with errors that name the range.

    Serve keeps `ongoing requests per replica` (running + queued in the replica, averaged over `look_back_period_s`)
    near `target_ongoing_requests`: it asks for ceil(total ongoing / target) replicas, clipped to
    [min_replicas, max_replicas], once that wish has held for `upscale_delay_s` (more) or `downscale_delay_s` (fewer).
    """

    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float = 4.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    initial_replicas: int | None = None     # None: min_replicas
    metrics_interval_s: float = 1.0         # how often replicas and handles report their queue lengths
    look_back_period_s: float = 5.0         # the window those reports are averaged over

    def __post_init__(self):
        def check(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"AutoscalingConfig {name}={getattr(self, name)!r} is out of range: {allowed}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN

        check("min_replicas", is_int(self.min_replicas) and self.min_replicas >= 1,
              "an integer >= 1 (a fleet scaled to zero has nobody to answer the first request)")
        check("max_replicas", is_int(self.max_replicas) and self.max_replicas >= self.min_replicas,
              f"an integer >= min_replicas ({self.min_replicas})")
        check("target_ongoing_requests", is_num(self.target_ongoing_requests) and self.target_ongoing_requests > 0,
              "a number > 0 (requests running or queued per replica)")
        check("upscale_delay_s", is_num(self.upscale_delay_s) and 0 <= self.upscale_delay_s < float("inf"),
              "seconds >= 0")
        check("downscale_delay_s", is_num(self.downscale_delay_s) and 0 <= self.downscale_delay_s < float("inf"),
              "seconds >= 0")
        if self.initial_replicas is not None:
            check("initial_replicas", is_int(self.initial_replicas)
                  and self.min_replicas <= self.initial_replicas <= self.max_replicas,
                  f"None or an integer in [min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}]")
        check("metrics_interval_s", is_num(self.metrics_interval_s) and 0 < self.metrics_interval_s < float("inf"),
              "seconds > 0")
        check("look_back_period_s", is_num(self.look_back_period_s) and 0 < self.look_back_period_s < float("inf"),
              "seconds > 0")

    def to_ray(self) -> dict:
        """The dict Ray Serve's `autoscaling_config` takes (ray.serve.config.AutoscalingConfig's field names)."""
        out = dataclasses.asdict(self)
        if out["initial_replicas"] is None:
            del out["initial_replicas"]
        return out

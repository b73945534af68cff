"""The autoscaler's seam: the FleetState a policy sees each tick, Ray Serve's default policy, and a fixed fleet.

Every `control_interval_s` the simulator (simulate.py) hands the policy a `FleetState` and it returns the number
of replicas it wants (running + starting); the simulator clamps it to [min_replicas, max_replicas], starts
replicas (each serves only `startup_s` after it was asked for) or drains them. Any callable `policy(state) ->
int` works; `RayServePolicy` is Ray Serve's default (`replica_queue_length_autoscaling_policy`: desired =
ceil(running * ongoing per replica / target_ongoing_requests), averaged over look_back_period_s; acted on only
after the wish has held for upscale_delay_s / downscale_delay_s). `FixedReplicas(n)` never scales.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Protocol

from .checks import finite, need


class FleetState(NamedTuple):
    """What an autoscaling policy sees at each control tick.

    ongoing_per_replica: ongoing requests (waiting + running in its engine) of each ready replica.
    queue_length: requests waiting at the router (every ready replica at max_ongoing_requests).
    target_replicas: the policy's last decision after clamping (running + starting replicas).
    history: recent (now_s, total_ongoing_requests, running_replicas) samples, oldest first, one per
    tick over the last `FleetConfig.history_s` seconds (the current tick included). Immutable (a NamedTuple:
    one is built every tick, so it is cheap)."""

    now_s: float
    running_replicas: int
    starting_replicas: int
    ongoing_per_replica: tuple[int, ...]
    queue_length: int
    target_replicas: int
    min_replicas: int
    max_replicas: int
    history: tuple[tuple[float, int, int], ...]

    @property
    def total_ongoing_requests(self) -> int:
        """Requests in the fleet: at replicas and queued at the router (what Ray Serve's policy counts)."""
        return sum(self.ongoing_per_replica) + self.queue_length


class AutoscalingPolicy(Protocol):
    def __call__(self, state: FleetState) -> int:
        """How many replicas the fleet should have (running + starting); the simulator clamps it."""


class FixedReplicas:
    """Never scales: always `num_replicas`."""

    def __init__(self, num_replicas: int):
        need(isinstance(num_replicas, int) and num_replicas >= 1, f"num_replicas={num_replicas!r} must be an integer >= 1")
        self.num_replicas = num_replicas

    def __call__(self, state: FleetState) -> int:
        return self.num_replicas


class RayServePolicy:
    """Ray Serve's default autoscaling policy (ray.serve.autoscaling_policy, 2.x), ticked every control interval.

    desired = ceil(running * (1 + (ongoing_per_replica / target_ongoing_requests - 1) * factor)), with
    ongoing requests (replicas + router queue) averaged over the last look_back_period_s and factor the
    upscaling or downscaling factor; a change is made only once the wish to go up (down) has held for
    upscale_delay_s (downscale_delay_s): Ray's decision counter, here in seconds. From zero running
    replicas, any request asks for one at once."""

    def __init__(self, target_ongoing_requests: float = 2.0, upscale_delay_s: float = 30.0,
                 downscale_delay_s: float = 600.0, look_back_period_s: float = 30.0,
                 upscaling_factor: float = 1.0, downscaling_factor: float = 1.0):
        need(finite(target_ongoing_requests, strict=True),
             f"target_ongoing_requests={target_ongoing_requests!r} must be a number > 0")
        for name, value in (("upscale_delay_s", upscale_delay_s), ("downscale_delay_s", downscale_delay_s),
                            ("look_back_period_s", look_back_period_s)):
            need(finite(value), f"{name}={value!r} must be a finite number of seconds >= 0")
        for name, value in (("upscaling_factor", upscaling_factor), ("downscaling_factor", downscaling_factor)):
            need(finite(value, strict=True), f"{name}={value!r} must be a number > 0")
        self.target_ongoing_requests = float(target_ongoing_requests)
        self.upscale_delay_s = float(upscale_delay_s)
        self.downscale_delay_s = float(downscale_delay_s)
        self.look_back_period_s = float(look_back_period_s)
        self.upscaling_factor = float(upscaling_factor)
        self.downscaling_factor = float(downscaling_factor)
        self._wish_since: float | None = None   # when the current wish (up or down) started
        self._wish_up: bool | None = None

    def desired(self, state: FleetState) -> int:
        """The replica count the load asks for now, before delays."""
        recent = [total for t, total, _ in state.history if t >= state.now_s - self.look_back_period_s]
        ongoing = sum(recent) / len(recent) if recent else state.total_ongoing_requests
        running = state.running_replicas
        error = ongoing / running / self.target_ongoing_requests
        factor = self.upscaling_factor if error >= 1 else self.downscaling_factor
        return max(1, math.ceil(running * (1 + (error - 1) * factor) - 1e-9))

    def __call__(self, state: FleetState) -> int:
        target = state.target_replicas
        if state.running_replicas == 0:
            self._wish_since = None
            return max(target, 1) if state.total_ongoing_requests > 0 else target
        desired = min(max(self.desired(state), state.min_replicas), state.max_replicas)
        if desired == target:
            self._wish_since = None
            return target
        up = desired > target
        if self._wish_since is None or self._wish_up != up:
            self._wish_since, self._wish_up = state.now_s, up
        delay = self.upscale_delay_s if up else self.downscale_delay_s
        if state.now_s - self._wish_since >= delay:
            self._wish_since = None
            return desired
        return target

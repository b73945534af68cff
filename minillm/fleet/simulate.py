"""A discrete-event simulator (SimPy) of a minillm fleet: replicas behind Ray Serve's router and autoscaler.

The same fleet as ray_fleet.py, in simulated time: a day of traffic (~50,000 requests) runs in 1-2 s on a 2-core CPU.

    from minillm.fleet.simulate import (FleetConfig, RayServePolicy, ReplicaProfile, daily_traffic,
                                        simulate, simulate_day, warm_replicas_for_p99)

    profile = ReplicaProfile.load("artifacts/fleet_profile.json")   # or measure_profile() (profile.py)
    config = FleetConfig(max_num_seqs=8, min_replicas=1, max_replicas=8, hourly_usd=0.08,
                         policy=RayServePolicy(target_ongoing_requests=2, upscale_delay_s=30))
    traffic = daily_traffic(peak_rps=2.0)
    result = simulate_day(traffic, profile, config, seed=0)    # or simulate([SimRequest(...), ...], profile, config)
    print(result.hourly_table())                 # arrivals/s, replicas, queue, TTFT p50/p99, $/Mtok per hour
    result.ttft_percentile(99), result.usd_per_mtok, result.plot("day.png")
    warm_replicas_for_p99(2.0, profile, config, traffic)   # fewest warm replicas with p99 TTFT <= 2 s in the spike

    def my_policy(state: FleetState) -> int:     # the autoscaler's seam: replicas wanted (running + starting)
        return math.ceil(state.total_ongoing_requests / 4) or 1
    FleetConfig(policy=my_policy)                 # RayServePolicy() is the default; FixedReplicas(n) never scales

The model, piece by piece:

* **Requests** (`SimRequest`): arrival time, prompt tokens, output tokens. `day_requests` draws them from a
  `Traffic` shape (requests/s as a piecewise-linear function of the hour: night, morning ramp, midday
  spike, evening decline) as a Poisson process; the validation replays the real requests' send times.
* **Replica** = minillm's engine with `batching="continuous"` and whole-prompt prefill: between steps the
  engine admits waiting requests (up to `max_num_seqs` running, `max_num_batched_tokens` prompt tokens
  per step) and runs them as one prefill step, which also gives each its first token; otherwise it runs a
  decode step that gives every running request one token. Step times come from a measured
  `ReplicaProfile`: `prefill_s(total prompt tokens)` and `decode_step_s(batch size)`, each a piecewise-linear
  curve through measured points (a step's context length is ignored: at these prompt sizes the MLP
  dominates). A request arriving mid-step waits for the step's end. TTFT = arrival -> end of its prefill
  step + `request_overhead_s` (HTTP / proxy, calibrated). Decode stretches are advanced in one event up
  to the next finish or admissible arrival, so events grow with requests, not with steps. With
  `FleetConfig(record_gaps=True)` each request keeps `gaps_s`, the seconds between its successive tokens
  (a gap holding another request's prefill step included), as a streaming client measures them: the
  validation (minillm/bench/fleet.py) fits the profile's step times to a real fleet's gaps with it, and
  `ReplicaProfile.scaled(decode, prefill)` rescales the curves.
* **Replicas sharing cores** (`FleetConfig(replicas_share_cores=True)`; off by default, as for a day of
  replicas on machines of their own): replicas on one machine slow each other, since they share its cores
  and memory bandwidth (on loopback also with Ray's proxy and the ingress, which relay every token). The
  profile's `busy_slowdown_points` say by how much: (replicas busy at once, step-time factor), measured by
  `calibrate_on_server` as a replica's decode step with k replicas decoding a full batch at once over the
  same with one (on the 2-core CPU: x1.04-1.43 with both of two busy). Each step, when it starts, takes its
  curve's time x slowdown(replicas busy now) / slowdown(replicas busy when that curve was measured)
  (`decode_busy_replicas`, `prefill_busy_replicas`); a replica is busy while it has requests waiting or
  running. Steps are then simulated one per event, since the factor can change at every step.
* **Router** = Ray Serve's default: power of two choices on ongoing requests (waiting + running) among
  the replicas that are ready and below `max_ongoing_requests`; when every replica is at that limit the
  request waits at the router (FIFO) for the first free slot.
* **Autoscaler**: every `control_interval_s` the policy sees a `FleetState` and returns the number of
  replicas it wants; the simulator clamps it to [min_replicas, max_replicas], starts replicas (each
  serves only `startup_s` after it was asked for, and is billed from then on) or drains them (a stopping
  replica takes no new requests, finishes its ongoing ones, then stops being billed; replicas still
  starting are cancelled first). Any callable `policy(state) -> int` works; `RayServePolicy` is Ray
  Serve's default (`replica_queue_length_autoscaling_policy`: desired = ceil(running * ongoing per
  replica / target_ongoing_requests), averaged over look_back_period_s; acted on only after the wish
  has held for upscale_delay_s / downscale_delay_s). `FixedReplicas(n)` never scales.
* **Cost**: replica-seconds (starting, serving and draining) x `hourly_usd` / 3600, per million
  output tokens served (minillm's cost model, bench/cost.py's cost_per_million).

Everything is deterministic for a given seed (arrivals and the router's random choices).
"""

from __future__ import annotations

import bisect
import json
import math
import random
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple, Protocol

import simpy

from ..bench.runner import percentile


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _finite(value, lo: float = 0.0, strict: bool = False) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value > lo if strict else value >= lo))


# ------------------------------------------------------------------ the measured replica
class _Piecewise:
    """Piecewise-linear through sorted (x, y) points; linear extrapolation past either end (never below 0)."""

    def __init__(self, points):
        self.points = list(points)
        self.xs = [p[0] for p in self.points]
        self.cache: dict = {}

    def __call__(self, x: float) -> float:
        points = self.points
        if len(points) == 1:
            return points[0][1]
        i = min(max(bisect.bisect_right(self.xs, x) - 1, 0), len(points) - 2)
        (x0, y0), (x1, y1) = points[i], points[i + 1]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


@dataclass
class ReplicaProfile:
    """What one replica costs in time, measured (profile.py) or written by hand.

    decode_points: (batch size, seconds per decode step), at least one, batch sizes distinct integers >= 1.
    prefill_points: (prompt tokens in the step, seconds for the prefill step), at least one.
    startup_s: from the autoscaler's decision to the replica serving (process start + weight load).
    request_overhead_s: added to every TTFT (HTTP, proxy, tokenization), the part no step explains.
    busy_slowdown_points: (replicas busy at once on one machine, step-time factor), measured
    (calibrate_on_server): how much slower a replica's steps get as more replicas sharing its cores run
    steps at the same time; the default (1, 1.0) says "not measured". decode_busy_replicas /
    prefill_busy_replicas: how many replicas were busy while decode_points / prefill_points were measured
    (1 in-process; calibrate_on_server decodes with every replica busy and prefills with one). They apply
    only under FleetConfig(replicas_share_cores=True).
    conditions: how it was measured (free text / numbers, kept in the JSON)."""

    decode_points: list[tuple[int, float]]
    prefill_points: list[tuple[int, float]]
    startup_s: float = 0.0
    request_overhead_s: float = 0.0
    busy_slowdown_points: list[tuple[int, float]] = ((1, 1.0),)
    decode_busy_replicas: int = 1
    prefill_busy_replicas: int = 1
    conditions: dict = field(default_factory=dict)

    def __post_init__(self):
        self.decode_points = self._check_points("decode_points", self.decode_points, "batch size")
        self.prefill_points = self._check_points("prefill_points", self.prefill_points, "prompt tokens")
        self.busy_slowdown_points = self._check_points("busy_slowdown_points", self.busy_slowdown_points,
                                                       "busy replicas", "step-time factor")
        for name in ("decode_busy_replicas", "prefill_busy_replicas"):
            value = getattr(self, name)
            _need(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                  f"{name}={value!r} must be an integer >= 1 (replicas busy while the {name.split('_')[0]} "
                  f"points were measured)")
        self._decode = _Piecewise(self.decode_points)
        self._prefill = _Piecewise(self.prefill_points)
        self._slowdown = _Piecewise(self.busy_slowdown_points)
        self._scale_cache: dict[tuple[int, int], float] = {}
        self._decode_cache: dict[int, float] = {}
        _need(_finite(self.startup_s), f"startup_s={self.startup_s!r} must be a finite number of seconds >= 0")
        _need(_finite(self.request_overhead_s),
              f"request_overhead_s={self.request_overhead_s!r} must be a finite number of seconds >= 0")

    @staticmethod
    def _check_points(name: str, points, what: str, value: str = "seconds") -> list[tuple[int, float]]:
        _need(isinstance(points, (list, tuple)) and len(points) >= 1,
              f"{name}={points!r} must be a non-empty list of ({what}, {value}) pairs")
        out = []
        for p in points:
            _need(isinstance(p, (list, tuple)) and len(p) == 2, f"{name}: {p!r} is not a ({what}, {value}) pair")
            x, y = p
            _need(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 1 and float(x) == int(x),
                  f"{name}: {what} {x!r} must be an integer >= 1")
            _need(_finite(y, strict=True), f"{name}: {value} {y!r} at {what} {x} must be a finite number > 0")
            out.append((int(x), float(y)))
        out.sort()
        xs = [p[0] for p in out]
        _need(len(set(xs)) == len(xs), f"{name}: {what} values {xs} repeat")
        return out

    def decode_step_s(self, batch_size: int) -> float:
        step = self._decode_cache.get(batch_size)
        if step is None:
            step = self._decode_cache[batch_size] = max(self._decode(batch_size), 1e-6)
        return step

    def prefill_s(self, prompt_tokens: int) -> float:
        return max(self._prefill(prompt_tokens), 1e-6)

    def busy_scale(self, busy_replicas: int, measured_busy: int = 1) -> float:
        """Step-time multiplier when busy_replicas replicas (this one included) run steps on the same machine,
        for a curve measured with measured_busy replicas busy: slowdown(busy_replicas) / slowdown(measured_busy).
        The simulator uses it (with replicas_share_cores=True) through decode_scale and prefill_scale."""
        key = (busy_replicas, measured_busy)
        scale = self._scale_cache.get(key)
        if scale is None:
            scale = self._scale_cache[key] = (max(self._slowdown(busy_replicas), 1e-6)
                                              / max(self._slowdown(measured_busy), 1e-6))
        return scale

    def decode_scale(self, busy_replicas: int) -> float:
        return self.busy_scale(busy_replicas, self.decode_busy_replicas)

    def prefill_scale(self, busy_replicas: int) -> float:
        return self.busy_scale(busy_replicas, self.prefill_busy_replicas)

    def scaled(self, decode: float = 1.0, prefill: float = 1.0) -> "ReplicaProfile":
        """A copy whose decode steps take `decode` x and prefill steps `prefill` x as long (the validation's
        during-ramp fit, minillm/bench/fleet.py); the busy slowdown, start-up and overhead are kept."""
        for name, value in (("decode", decode), ("prefill", prefill)):
            _need(_finite(value, strict=True), f"{name}={value!r} must be a finite step-time factor > 0")
        return ReplicaProfile(decode_points=[(b, s * decode) for b, s in self.decode_points],
                              prefill_points=[(n, s * prefill) for n, s in self.prefill_points],
                              startup_s=self.startup_s, request_overhead_s=self.request_overhead_s,
                              busy_slowdown_points=self.busy_slowdown_points,
                              decode_busy_replicas=self.decode_busy_replicas,
                              prefill_busy_replicas=self.prefill_busy_replicas,
                              conditions={**self.conditions, "scaled": {"decode": decode, "prefill": prefill}})

    @property
    def max_measured_batch(self) -> int:
        return self.decode_points[-1][0]

    def tokens_per_s(self, batch_size: int) -> float:
        """Decode throughput of one replica at this batch size (output tokens per second)."""
        return batch_size / self.decode_step_s(batch_size)

    def to_dict(self) -> dict:
        return {"decode_points": [list(p) for p in self.decode_points],
                "prefill_points": [list(p) for p in self.prefill_points],
                "startup_s": self.startup_s, "request_overhead_s": self.request_overhead_s,
                "busy_slowdown_points": [list(p) for p in self.busy_slowdown_points],
                "decode_busy_replicas": self.decode_busy_replicas, "prefill_busy_replicas": self.prefill_busy_replicas,
                "conditions": self.conditions}

    @classmethod
    def from_dict(cls, data: dict) -> "ReplicaProfile":
        known = {"decode_points", "prefill_points", "startup_s", "request_overhead_s", "busy_slowdown_points",
                 "decode_busy_replicas", "prefill_busy_replicas", "conditions"}
        _need(isinstance(data, dict), f"a profile is a JSON object, got {type(data).__name__}")
        unknown = set(data) - known
        _need(not unknown, f"unknown profile fields {sorted(unknown)} (known: {sorted(known)})")
        return cls(**{k: (tuple(map(tuple, v)) if k.endswith("_points") else v) for k, v in data.items()})

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ReplicaProfile":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"profile {str(path)!r}: no such file (save one with measure_profile(...).save())")
        return cls.from_dict(json.loads(path.read_text()))


# ------------------------------------------------------------------ the autoscaler's seam
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
        _need(isinstance(num_replicas, int) and num_replicas >= 1, f"num_replicas={num_replicas!r} must be an integer >= 1")
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
        _need(_finite(target_ongoing_requests, strict=True),
              f"target_ongoing_requests={target_ongoing_requests!r} must be a number > 0")
        for name, value in (("upscale_delay_s", upscale_delay_s), ("downscale_delay_s", downscale_delay_s),
                            ("look_back_period_s", look_back_period_s)):
            _need(_finite(value), f"{name}={value!r} must be a finite number of seconds >= 0")
        for name, value in (("upscaling_factor", upscaling_factor), ("downscaling_factor", downscaling_factor)):
            _need(_finite(value, strict=True), f"{name}={value!r} must be a number > 0")
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


# ------------------------------------------------------------------ fleet configuration
@dataclass
class FleetConfig:
    """The fleet around the replicas. initial_replicas: ready (warm) at t=0 (None: min_replicas)."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 8192
    max_ongoing_requests: int = 16
    min_replicas: int = 1
    max_replicas: int = 8
    initial_replicas: int | None = None
    hourly_usd: float = 0.08
    policy: Callable[[FleetState], int] | None = None   # None: RayServePolicy()
    control_interval_s: float = 1.0
    history_s: float = 30.0
    sample_interval_s: float = 60.0     # timeline resolution (queue, replicas)
    seed: int = 0
    replicas_share_cores: bool = False  # True: steps x profile.decode_scale / prefill_scale(replicas busy now)
    record_gaps: bool = False           # True: each SimRequest keeps gaps_s, its inter-token gaps (the validation's fit)

    def __post_init__(self):
        def whole(name, lo):
            value = getattr(self, name)
            _need(isinstance(value, int) and not isinstance(value, bool) and value >= lo,
                  f"{name}={value!r} must be an integer >= {lo}")
        whole("max_num_seqs", 1)
        whole("max_num_batched_tokens", 1)
        whole("max_ongoing_requests", 1)
        whole("min_replicas", 0)
        whole("max_replicas", 1)
        _need(self.min_replicas <= self.max_replicas,
              f"min_replicas={self.min_replicas} must be <= max_replicas={self.max_replicas}")
        if self.initial_replicas is None:
            self.initial_replicas = self.min_replicas
        _need(isinstance(self.initial_replicas, int) and self.min_replicas <= self.initial_replicas <= self.max_replicas,
              f"initial_replicas={self.initial_replicas!r} must be an integer in "
              f"[min_replicas={self.min_replicas}, max_replicas={self.max_replicas}]")
        _need(_finite(self.hourly_usd), f"hourly_usd={self.hourly_usd!r} must be a finite number >= 0 (USD per replica-hour)")
        for name in ("control_interval_s", "history_s", "sample_interval_s"):
            _need(_finite(getattr(self, name), strict=True), f"{name}={getattr(self, name)!r} must be a number of seconds > 0")
        for name in ("replicas_share_cores", "record_gaps"):
            _need(isinstance(getattr(self, name), bool), f"{name}={getattr(self, name)!r} must be True or False")
        _need(self.policy is None or callable(self.policy),
              f"policy={self.policy!r} must be a callable policy(state: FleetState) -> int")
        if self.policy is None:
            self.policy = RayServePolicy()


# ------------------------------------------------------------------ requests and traffic
@dataclass
class SimRequest:
    """One request; the simulator fills the times (seconds of simulated time)."""

    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    replica: int = -1                # which replica served it
    dispatched_s: float | None = None   # left the router queue for a replica
    first_token_s: float | None = None  # end of its prefill step (TTFT excludes request_overhead_s here)
    finish_s: float | None = None
    ttft_s: float | None = None      # first_token_s - arrival_s + request_overhead_s
    remaining: int = 0               # output tokens still to decode (while running)
    gaps_s: list[float] | None = None   # with FleetConfig(record_gaps=True): seconds between successive tokens

    def __post_init__(self):
        _need(_finite(self.arrival_s), f"arrival_s={self.arrival_s!r} must be a finite number of seconds >= 0")
        _need(isinstance(self.prompt_tokens, int) and self.prompt_tokens >= 1,
              f"prompt_tokens={self.prompt_tokens!r} must be an integer >= 1")
        _need(isinstance(self.output_tokens, int) and self.output_tokens >= 1,
              f"output_tokens={self.output_tokens!r} must be an integer >= 1")


@dataclass
class Traffic:
    """Requests per second as a piecewise-linear function of the hour of the day, and request sizes.

    points: (hour in [0, 24], requests/s) pairs, hours increasing; hour_s: seconds per simulated hour
    (3600 = real time). spike: the (start, end) hours of the midday spike, where the warm-replica search
    measures p99 TTFT. Prompt and output tokens are uniform in their [lo, hi] ranges."""

    points: list[tuple[float, float]]
    spike: tuple[float, float] = (12.0, 12.5)
    prompt_tokens: tuple[int, int] = (32, 256)
    output_tokens: tuple[int, int] = (16, 128)
    hour_s: float = 3600.0

    def __post_init__(self):
        _need(isinstance(self.points, (list, tuple)) and len(self.points) >= 2,
              f"points={self.points!r} must hold at least two (hour, requests/s) pairs")
        hours = [h for h, _ in self.points]
        _need(all(_finite(h) and h <= 24 for h in hours) and hours == sorted(hours) and len(set(hours)) == len(hours),
              f"points' hours {hours} must increase within [0, 24]")
        for h, rate in self.points:
            _need(_finite(rate), f"the rate {rate!r} at hour {h} must be a finite number of requests/s >= 0")
        lo, hi = self.spike
        _need(_finite(lo) and _finite(hi) and lo < hi <= 24, f"spike={self.spike!r} must be (start, end) hours, start < end <= 24")
        for name in ("prompt_tokens", "output_tokens"):
            a, b = getattr(self, name)
            _need(isinstance(a, int) and isinstance(b, int) and 1 <= a <= b, f"{name}={(a, b)!r} must be integers 1 <= lo <= hi")
        _need(_finite(self.hour_s, strict=True), f"hour_s={self.hour_s!r} must be a number of seconds > 0")
        self._rate = _Piecewise(self.points)

    def rate(self, hour: float) -> float:
        """Requests per second at this hour (the end points' rates outside the points)."""
        if hour <= self.points[0][0] or hour >= self.points[-1][0]:
            return self.points[0][1] if hour <= self.points[0][0] else self.points[-1][1]
        return self._rate(hour)

    @property
    def peak_rps(self) -> float:
        return max(r for _, r in self.points)


def daily_traffic(peak_rps: float = 2.0, base_rps: float | None = None, spike_rps: float | None = None,
                  spike: tuple[float, float] = (12.0, 12.5), ramp_min: float = 5.0, **sizes) -> Traffic:
    """A working day: night at base_rps (peak/10), a morning ramp 6:00-9:00 to a day plateau at peak/2,
    the midday spike to peak_rps (reached in ramp_min minutes at spike[0], held until spike[1]), the
    plateau again, the evening decline 17:00-21:00. spike_rps overrides peak_rps for the spike only."""
    _need(_finite(peak_rps, strict=True), f"peak_rps={peak_rps!r} must be a number of requests/s > 0")
    base = peak_rps / 10 if base_rps is None else base_rps
    top = peak_rps if spike_rps is None else spike_rps
    plateau = peak_rps / 2
    lo, hi = spike
    _need(_finite(ramp_min, strict=True) and 9 < lo - ramp_min / 60 and hi + ramp_min / 60 < 17,
          f"spike={spike!r} with ramp_min={ramp_min!r} must fit between 9:00 and 17:00")
    points = [(0.0, base), (6.0, base), (9.0, plateau), (lo - ramp_min / 60, plateau), (lo, top), (hi, top),
              (hi + ramp_min / 60, plateau), (17.0, plateau), (21.0, base), (24.0, base)]
    return Traffic(points=points, spike=spike, **sizes)


def day_requests(traffic: Traffic, seed: int = 0, start_h: float = 0.0, end_h: float = 24.0) -> list[SimRequest]:
    """Poisson arrivals at traffic.rate(hour) between start_h and end_h (thinning), times from start_h
    (so t=0 is start_h), with uniform prompt / output token counts."""
    _need(_finite(start_h) and _finite(end_h) and start_h < end_h <= 24,
          f"start_h={start_h!r}, end_h={end_h!r} must satisfy 0 <= start_h < end_h <= 24")
    rng = random.Random(seed)
    peak = max(traffic.rate(h) for h in [start_h, end_h] + [p[0] for p in traffic.points if start_h < p[0] < end_h])
    requests = []
    if peak <= 0:
        return requests
    t, horizon = 0.0, (end_h - start_h) * traffic.hour_s
    (plo, phi), (olo, ohi) = traffic.prompt_tokens, traffic.output_tokens
    while True:
        t += rng.expovariate(peak)
        if t >= horizon:
            return requests
        if rng.random() * peak < traffic.rate(start_h + t / traffic.hour_s):
            requests.append(_fresh_values(t, rng.randint(plo, phi), rng.randint(olo, ohi)))


# ------------------------------------------------------------------ the simulation
STALL_LIMIT_S = 86400.0   # a run still unfinished this long after the last arrival is refused (no replica?)

class _Replica:
    """One engine: continuous batching with whole-prompt prefill steps (see the module docstring)."""

    def __init__(self, sim: "_Simulation", index: int, ready_s: float):
        self.sim = sim
        self.index = index
        self.requested_s = sim.env.now       # billed from here
        self.ready_s = ready_s
        self.stop_s: float | None = None     # billing ends (drained, or cancelled while starting)
        self.ready = False
        self.draining = False
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.kick: simpy.Event | None = None  # triggered by an admissible arrival during a decode stretch
        self.steps = 0
        self.prefilling = 0                   # requests in the prefill step under way
        if ready_s <= sim.env.now:   # warm: serving from now (the policy's first tick already sees it)
            self.ready = True
            sim.env.process(self._run())
        else:
            sim.env.process(self._start())

    @property
    def ongoing(self) -> int:
        return len(self.waiting) + len(self.running)

    def _start(self):
        if self.ready_s > self.sim.env.now:
            yield self.sim.env.timeout(self.ready_s - self.sim.env.now)
        if self.stop_s is not None:   # cancelled while starting
            return
        self.ready = True
        self.sim.env.process(self._run())
        self.sim.dispatch()

    def add(self, request: SimRequest) -> None:
        request.replica = self.index
        request.dispatched_s = self.sim.env.now
        self.waiting.append(request)
        if self.kick is not None and not self.kick.triggered and len(self.running) < self.sim.config.max_num_seqs:
            self.kick.succeed()

    def _run(self):
        env, cfg, profile = self.sim.env, self.sim.config, self.sim.profile
        while True:
            if not self.waiting and not self.running:
                if self.draining:
                    self.stop_s = env.now
                    return
                self.kick = env.event()
                yield self.kick
                self.kick = None
                continue
            if self.waiting and len(self.running) < cfg.max_num_seqs:
                admitted, tokens = [], 0
                while self.waiting and len(self.running) + len(admitted) < cfg.max_num_seqs:
                    nxt = self.waiting[0].prompt_tokens
                    if admitted and tokens + nxt > cfg.max_num_batched_tokens:
                        break
                    admitted.append(self.waiting.popleft())
                    tokens += nxt
                self.prefilling = len(admitted)
                yield env.timeout(profile.prefill_s(tokens) * self._scale(profile.prefill_scale))
                self.prefilling = 0
                self.steps += 1
                for r in admitted:
                    r.first_token_s = env.now
                    r.remaining = r.output_tokens - 1
                    if cfg.record_gaps:
                        r.gaps_s = []
                    if r.remaining:
                        self.running.append(r)
                    else:
                        self._finish(r)
                continue
            step = profile.decode_step_s(len(self.running)) * self._scale(profile.decode_scale)
            # sharing cores, the step time moves whenever another replica starts or stops working: one step per event
            steps = 1 if cfg.replicas_share_cores else min(r.remaining for r in self.running)
            start = env.now
            self.kick = None if len(self.running) >= cfg.max_num_seqs else env.event()
            stretch = env.timeout(steps * step)
            yield stretch if self.kick is None else (stretch | self.kick)
            if not stretch.processed and env.now < start + steps * step:
                # an admissible arrival: finish the step in progress, then prefill it
                steps = max(1, math.ceil((env.now - start) / step - 1e-9))
                self.kick = None
                yield env.timeout(start + steps * step - env.now)
            self.kick = None
            self.steps += steps
            still = []
            for r in self.running:
                if cfg.record_gaps:   # tokens at start + step, ..., start + steps x step; the first gap holds any stall
                    last = r.first_token_s + sum(r.gaps_s)
                    r.gaps_s += [start + step - last] + [step] * (min(steps, r.remaining) - 1)
                r.remaining -= steps
                if r.remaining <= 0:
                    self._finish(r)
                else:
                    still.append(r)
            self.running = still

    def _scale(self, curve_scale) -> float:
        """The step-time multiplier for a step starting now: 1, or with replicas_share_cores the profile's
        decode_scale / prefill_scale for the replicas (this one included) that have requests to run."""
        if not self.sim.config.replicas_share_cores:
            return 1.0
        busy = sum(1 for r in self.sim.replicas
                   if r.ready and r.stop_s is None and (r.running or r.waiting or r.prefilling))
        return curve_scale(max(busy, 1))

    def _finish(self, request: SimRequest) -> None:
        request.finish_s = self.sim.env.now
        self.sim.finished += 1
        self.sim.dispatch()


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


class _Simulation:
    def __init__(self, requests: list[SimRequest], profile: ReplicaProfile, config: FleetConfig, hour_s: float):
        self.env = simpy.Environment()
        self.profile = profile
        self.config = config
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.rng = random.Random(config.seed)
        self.replicas: list[_Replica] = []
        self.queue: deque[SimRequest] = deque()
        self.finished = 0
        self.history: deque[tuple[float, int, int]] = deque()
        self.timeline: list[dict] = []
        self.scale_events: list[tuple[float, int]] = []
        self.hour_s = hour_s
        for _ in range(config.initial_replicas):
            self.replicas.append(_Replica(self, len(self.replicas), ready_s=0.0))
        self.active: list[_Replica] = list(self.replicas)
        self.target = config.initial_replicas

    def live(self) -> list[_Replica]:
        """Replicas serving or starting (not draining, not stopped)."""
        return self.active

    def dispatch(self) -> None:
        """Route queued requests while some ready replica is below max_ongoing_requests."""
        limit = self.config.max_ongoing_requests
        while self.queue:
            open_ = [r for r in self.active if r.ready and r.ongoing < limit]
            if not open_:
                return
            if len(open_) == 1:
                choice = open_[0]
            else:
                a, b = self.rng.sample(open_, 2)
                choice = a if a.ongoing <= b.ongoing else b
            choice.add(self.queue.popleft())

    def arrivals(self):
        env = self.env
        for request in self.requests:
            if request.arrival_s > env.now:
                yield env.timeout(request.arrival_s - env.now)
            self.queue.append(request)
            self.dispatch()

    def state(self) -> FleetState:
        """The policy's view now; appends the current (now, total ongoing, running) sample to the history first."""
        cfg, now = self.config, self.env.now
        live = self.live()
        ready = [r for r in live if r.ready]
        ongoing = tuple(r.ongoing for r in ready)
        self.history.append((now, sum(ongoing) + len(self.queue), len(ready)))
        while self.history[0][0] < now - cfg.history_s:
            self.history.popleft()
        return FleetState(now_s=now, running_replicas=len(ready), starting_replicas=len(live) - len(ready),
                          ongoing_per_replica=ongoing, queue_length=len(self.queue),
                          target_replicas=self.target, min_replicas=cfg.min_replicas,
                          max_replicas=cfg.max_replicas, history=tuple(self.history))

    def scale_to(self, target: int) -> None:
        live = self.live()
        if target > len(live):
            for _ in range(target - len(live)):
                self.replicas.append(_Replica(self, len(self.replicas), self.env.now + self.profile.startup_s))
                self.active.append(self.replicas[-1])
        elif target < len(live):
            # cancel starting replicas first (newest first), then drain the least busy ready ones
            order = sorted(live, key=lambda r: (r.ready, r.ongoing, -r.index))
            for replica in order[:len(live) - target]:
                if not replica.ready:
                    replica.stop_s = self.env.now
                else:
                    replica.draining = True
                    if replica.kick is not None and not replica.kick.triggered and not replica.ongoing:
                        replica.kick.succeed()
                self.active.remove(replica)
        self.target = target

    def control(self, end_s: float):
        env, cfg = self.env, self.config
        next_sample = 0.0
        while self.finished < len(self.requests) or env.now < end_s:
            if env.now > end_s + STALL_LIMIT_S:
                raise RuntimeError(f"{len(self.requests) - self.finished} requests still unfinished "
                                   f"{STALL_LIMIT_S:.0f} simulated seconds after the last arrival: the policy keeps "
                                   f"{self.target} replicas (min_replicas={cfg.min_replicas})")
            wanted = cfg.policy(self.state())
            if not (isinstance(wanted, int) and not isinstance(wanted, bool)):
                raise ValueError(f"the autoscaling policy returned {wanted!r}; it must return an integer number of replicas")
            target = min(max(wanted, cfg.min_replicas), cfg.max_replicas)
            if target != self.target:
                self.scale_events.append((env.now, target))
                self.scale_to(target)
            if env.now >= next_sample - 1e-9:   # after this tick's decision
                live = self.live()
                self.timeline.append({"t_s": env.now, "queue": len(self.queue),
                                      "waiting": sum(len(r.waiting) for r in live),
                                      "running": sum(len(r.running) for r in live),
                                      "replicas": sum(r.ready for r in live),
                                      "starting": sum(not r.ready for r in live)})
                next_sample += cfg.sample_interval_s
            yield env.timeout(cfg.control_interval_s)


def _fresh_values(arrival_s: float, prompt_tokens: int, output_tokens: int) -> SimRequest:
    """A SimRequest from values known to be valid (skips __post_init__: a day holds ~10^5 of them)."""
    request = object.__new__(SimRequest)
    request.__dict__.update(arrival_s=arrival_s, prompt_tokens=prompt_tokens, output_tokens=output_tokens, replica=-1,
                            dispatched_s=None, first_token_s=None, finish_s=None, ttft_s=None, remaining=0,
                            gaps_s=None)
    return request


def _fresh(request: SimRequest) -> SimRequest:
    """A copy without the simulated times."""
    return _fresh_values(request.arrival_s, request.prompt_tokens, request.output_tokens)


def simulate(requests: list[SimRequest], profile: ReplicaProfile, config: FleetConfig | None = None,
             duration_s: float | None = None, hour_s: float = 3600.0) -> SimResult:
    """Run the fleet on these requests until every one has finished (and at least duration_s).

    Requests are copied (the inputs keep no times). Raises ValueError if max_num_seqs exceeds the
    profile's largest measured batch size (the decode curve would be extrapolated)."""
    config = config or FleetConfig()
    _need(isinstance(profile, ReplicaProfile), f"profile must be a ReplicaProfile, got {type(profile).__name__}")
    _need(config.max_num_seqs <= profile.max_measured_batch,
          f"max_num_seqs={config.max_num_seqs} is above the profile's largest measured batch size "
          f"{profile.max_measured_batch}: measure the decode curve up to it (measure_profile(batch_sizes=...))")
    for r in requests:
        _need(isinstance(r, SimRequest), f"requests must be SimRequest objects, got {type(r).__name__}")
    copies = [_fresh(r) for r in requests]
    end_s = duration_s if duration_s is not None else max((r.arrival_s for r in copies), default=0.0)
    _need(_finite(end_s), f"duration_s={duration_s!r} must be a finite number of seconds >= 0")
    sim = _Simulation(copies, profile, config, hour_s)
    sim.env.process(sim.arrivals())
    done = sim.env.process(sim.control(end_s))
    sim.env.run(until=done)
    for r in sim.requests:
        r.ttft_s = r.first_token_s - r.arrival_s + profile.request_overhead_s
    end = sim.env.now
    spans = [(rep.requested_s, rep.stop_s if rep.stop_s is not None else end) for rep in sim.replicas]
    return SimResult(requests=sim.requests, replica_spans=spans, timeline=sim.timeline,
                     scale_events=sim.scale_events, duration_s=max(end_s, end), horizon_s=end_s,
                     hourly_usd=config.hourly_usd,
                     hour_s=hour_s)


# ------------------------------------------------------------------ questions
@dataclass
class WarmRow:
    warm_replicas: int
    spike_ttft_p99_s: float
    spike_ttft_p50_s: float
    usd_per_mtok: float
    max_replicas_used: int


def simulate_day(traffic: Traffic, profile: ReplicaProfile, config: FleetConfig | None = None, seed: int = 0,
                 start_h: float = 0.0, end_h: float = 24.0) -> SimResult:
    """The traffic between start_h and end_h through the fleet (t=0 is start_h)."""
    requests = day_requests(traffic, seed=seed, start_h=start_h, end_h=end_h)
    return simulate(requests, profile, config, duration_s=(end_h - start_h) * traffic.hour_s, hour_s=traffic.hour_s)


def warm_replicas_for_p99(target_p99_s: float, profile: ReplicaProfile, config: FleetConfig, traffic: Traffic,
                          seed: int = 0, start_h: float | None = None, end_h: float | None = None,
                          progress: bool = False) -> tuple[int | None, list[WarmRow]]:
    """The fewest warm replicas (min_replicas = initial_replicas = n, the autoscaler free above) that keep
    the p99 TTFT of requests arriving in the traffic's spike under target_p99_s, and the rows tried.

    Each n replays the same arrivals from start_h (default: 2 hours before the spike) to end_h (1 hour
    after it); n goes from 1 up to config.max_replicas and stops at the first that meets the target
    (None if none does). A fresh policy object is not made: give a policy without memory across runs,
    or None (a new RayServePolicy with the config's settings is built per n)."""
    _need(_finite(target_p99_s, strict=True), f"target_p99_s={target_p99_s!r} must be a number of seconds > 0")
    lo, hi = traffic.spike
    start_h = max(0.0, lo - 2) if start_h is None else start_h
    end_h = min(24.0, hi + 1) if end_h is None else end_h
    _need(start_h <= lo and hi <= end_h, f"start_h={start_h}, end_h={end_h} must contain the spike {traffic.spike}")
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

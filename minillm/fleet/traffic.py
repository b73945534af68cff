"""The simulator's requests: SimRequest, a day's Traffic shape, and its Poisson arrivals.

`day_requests` draws requests from a `Traffic` shape (requests/s as a piecewise-linear function of the hour:
night, morning ramp, midday spike, evening decline; `daily_traffic` builds a working day) as a Poisson process,
each with uniform prompt and output token counts; the validation (minillm/bench/fleet_validate.py) builds
SimRequests from the real requests' send times instead.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .checks import Piecewise, finite, need


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
        need(finite(self.arrival_s), f"arrival_s={self.arrival_s!r} must be a finite number of seconds >= 0")
        need(isinstance(self.prompt_tokens, int) and self.prompt_tokens >= 1,
             f"prompt_tokens={self.prompt_tokens!r} must be an integer >= 1")
        need(isinstance(self.output_tokens, int) and self.output_tokens >= 1,
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
        need(isinstance(self.points, (list, tuple)) and len(self.points) >= 2,
             f"points={self.points!r} must hold at least two (hour, requests/s) pairs")
        hours = [h for h, _ in self.points]
        need(all(finite(h) and h <= 24 for h in hours) and hours == sorted(hours) and len(set(hours)) == len(hours),
             f"points' hours {hours} must increase within [0, 24]")
        for h, rate in self.points:
            need(finite(rate), f"the rate {rate!r} at hour {h} must be a finite number of requests/s >= 0")
        lo, hi = self.spike
        need(finite(lo) and finite(hi) and lo < hi <= 24, f"spike={self.spike!r} must be (start, end) hours, start < end <= 24")
        for name in ("prompt_tokens", "output_tokens"):
            a, b = getattr(self, name)
            need(isinstance(a, int) and isinstance(b, int) and 1 <= a <= b, f"{name}={(a, b)!r} must be integers 1 <= lo <= hi")
        need(finite(self.hour_s, strict=True), f"hour_s={self.hour_s!r} must be a number of seconds > 0")
        self._rate = Piecewise(self.points)

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
    need(finite(peak_rps, strict=True), f"peak_rps={peak_rps!r} must be a number of requests/s > 0")
    base = peak_rps / 10 if base_rps is None else base_rps
    top = peak_rps if spike_rps is None else spike_rps
    plateau = peak_rps / 2
    lo, hi = spike
    need(finite(ramp_min, strict=True) and 9 < lo - ramp_min / 60 and hi + ramp_min / 60 < 17,
         f"spike={spike!r} with ramp_min={ramp_min!r} must fit between 9:00 and 17:00")
    points = [(0.0, base), (6.0, base), (9.0, plateau), (lo - ramp_min / 60, plateau), (lo, top), (hi, top),
              (hi + ramp_min / 60, plateau), (17.0, plateau), (21.0, base), (24.0, base)]
    return Traffic(points=points, spike=spike, **sizes)


def day_requests(traffic: Traffic, seed: int = 0, start_h: float = 0.0, end_h: float = 24.0) -> list[SimRequest]:
    """Poisson arrivals at traffic.rate(hour) between start_h and end_h (thinning), times from start_h
    (so t=0 is start_h), with uniform prompt / output token counts."""
    need(finite(start_h) and finite(end_h) and start_h < end_h <= 24,
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
            requests.append(fresh_request(t, rng.randint(plo, phi), rng.randint(olo, ohi)))


def fresh_request(arrival_s: float, prompt_tokens: int, output_tokens: int) -> SimRequest:
    """A SimRequest from values known to be valid (skips __post_init__: a day holds ~10^5 of them)."""
    request = object.__new__(SimRequest)
    request.__dict__.update(arrival_s=arrival_s, prompt_tokens=prompt_tokens, output_tokens=output_tokens, replica=-1,
                            dispatched_s=None, first_token_s=None, finish_s=None, ttft_s=None, remaining=0,
                            gaps_s=None)
    return request

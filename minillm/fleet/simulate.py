"""A discrete-event simulator (SimPy) of a minillm fleet: replicas behind Ray Serve's router and autoscaler.

The same fleet as ray_fleet.py, in simulated time: a day of traffic (~50,000 requests) runs in 1-2 s on a 2-core CPU.

    from minillm.fleet.policies import FleetState, RayServePolicy
    from minillm.fleet.replica_profile import ReplicaProfile
    from minillm.fleet.simulate import FleetConfig, simulate, simulate_day
    from minillm.fleet.sizing import warm_replicas_for_p99
    from minillm.fleet.traffic import daily_traffic

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

The model, piece by piece (this file runs the fleet; each piece is a file beside it):

* **Requests** (`SimRequest`, traffic.py): arrival time, prompt tokens, output tokens. `day_requests` draws
  them from a `Traffic` shape (requests/s as a piecewise-linear function of the hour: night, morning ramp,
  midday spike, evening decline) as a Poisson process; the validation replays the real requests' send times.
* **Replica** (sim_replica.py) = minillm's engine with `batching="continuous"` and whole-prompt prefill:
  between steps the engine admits waiting requests (up to `max_num_seqs` running, `max_num_batched_tokens`
  prompt tokens per step) and runs them as one prefill step, which also gives each its first token; otherwise
  it runs a decode step that gives every running request one token. Step times come from a measured
  `ReplicaProfile` (replica_profile.py): `prefill_s(total prompt tokens)` and `decode_step_s(batch size)`, each
  a piecewise-linear curve through measured points (a step's context length is ignored: at these prompt sizes
  the MLP dominates). A request arriving mid-step waits for the step's end. TTFT = arrival -> end of its
  prefill step + `request_overhead_s` (HTTP / proxy, calibrated). Decode stretches are advanced in one event up
  to the next finish or admissible arrival, so events grow with requests, not with steps. With
  `FleetConfig(record_gaps=True)` each request keeps `gaps_s`, the seconds between its successive tokens
  (a gap holding another request's prefill step included), as a streaming client measures them: the
  validation (minillm/bench/fleet_report.py) fits the profile's step times to a real fleet's gaps with it, and
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
* **Router** (here) = Ray Serve's default: power of two choices on ongoing requests (waiting + running) among
  the replicas that are ready and below `max_ongoing_requests`; when every replica is at that limit the
  request waits at the router (FIFO) for the first free slot.
* **Autoscaler** (here, with the policies of policies.py): every `control_interval_s` the policy sees a
  `FleetState` and returns the number of replicas it wants; the simulator clamps it to [min_replicas,
  max_replicas], starts replicas (each serves only `startup_s` after it was asked for, and is billed from
  then on) or drains them (a stopping replica takes no new requests, finishes its ongoing ones, then stops
  being billed; replicas still starting are cancelled first). Any callable `policy(state) -> int` works;
  `RayServePolicy` is Ray Serve's default (`replica_queue_length_autoscaling_policy`: desired = ceil(running
  * ongoing per replica / target_ongoing_requests), averaged over look_back_period_s; acted on only after
  the wish has held for upscale_delay_s / downscale_delay_s). `FixedReplicas(n)` never scales.
* **Cost** (`SimResult`, sim_result.py): replica-seconds (starting, serving and draining) x `hourly_usd` /
  3600, per million output tokens served (minillm's cost model, bench/cost.py's cost_per_million).
* **Sizing** (sizing.py): `warm_replicas_for_p99`, the fewest warm replicas that meet a p99 TTFT target.

Everything is deterministic for a given seed (arrivals and the router's random choices).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from typing import Callable

import simpy

from .checks import finite, need
from .policies import FleetState, RayServePolicy
from .replica_profile import ReplicaProfile
from .sim_replica import SimReplica
from .sim_result import SimResult
from .traffic import SimRequest, Traffic, day_requests, fresh_request

STALL_LIMIT_S = 86400.0   # a run still unfinished this long after the last arrival is refused (no replica?)


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
            need(isinstance(value, int) and not isinstance(value, bool) and value >= lo,
                 f"{name}={value!r} must be an integer >= {lo}")
        whole("max_num_seqs", 1)
        whole("max_num_batched_tokens", 1)
        whole("max_ongoing_requests", 1)
        whole("min_replicas", 0)
        whole("max_replicas", 1)
        need(self.min_replicas <= self.max_replicas,
             f"min_replicas={self.min_replicas} must be <= max_replicas={self.max_replicas}")
        if self.initial_replicas is None:
            self.initial_replicas = self.min_replicas
        need(isinstance(self.initial_replicas, int) and self.min_replicas <= self.initial_replicas <= self.max_replicas,
             f"initial_replicas={self.initial_replicas!r} must be an integer in "
             f"[min_replicas={self.min_replicas}, max_replicas={self.max_replicas}]")
        need(finite(self.hourly_usd), f"hourly_usd={self.hourly_usd!r} must be a finite number >= 0 (USD per replica-hour)")
        for name in ("control_interval_s", "history_s", "sample_interval_s"):
            need(finite(getattr(self, name), strict=True), f"{name}={getattr(self, name)!r} must be a number of seconds > 0")
        for name in ("replicas_share_cores", "record_gaps"):
            need(isinstance(getattr(self, name), bool), f"{name}={getattr(self, name)!r} must be True or False")
        need(self.policy is None or callable(self.policy),
             f"policy={self.policy!r} must be a callable policy(state: FleetState) -> int")
        if self.policy is None:
            self.policy = RayServePolicy()


class _Simulation:
    def __init__(self, requests: list[SimRequest], profile: ReplicaProfile, config: FleetConfig, hour_s: float):
        self.env = simpy.Environment()
        self.profile = profile
        self.config = config
        self.requests = sorted(requests, key=lambda r: r.arrival_s)
        self.rng = random.Random(config.seed)
        self.replicas: list[SimReplica] = []
        self.queue: deque[SimRequest] = deque()
        self.finished = 0
        self.history: deque[tuple[float, int, int]] = deque()
        self.timeline: list[dict] = []
        self.scale_events: list[tuple[float, int]] = []
        self.hour_s = hour_s
        for _ in range(config.initial_replicas):
            self.replicas.append(SimReplica(self, len(self.replicas), ready_s=0.0))
        self.active: list[SimReplica] = list(self.replicas)
        self.target = config.initial_replicas

    def live(self) -> list[SimReplica]:
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
                self.replicas.append(SimReplica(self, len(self.replicas), self.env.now + self.profile.startup_s))
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


def _fresh(request: SimRequest) -> SimRequest:
    """A copy without the simulated times."""
    return fresh_request(request.arrival_s, request.prompt_tokens, request.output_tokens)


def simulate(requests: list[SimRequest], profile: ReplicaProfile, config: FleetConfig | None = None,
             duration_s: float | None = None, hour_s: float = 3600.0) -> SimResult:
    """Run the fleet on these requests until every one has finished (and at least duration_s).

    Requests are copied (the inputs keep no times). Raises ValueError if max_num_seqs exceeds the
    profile's largest measured batch size (the decode curve would be extrapolated)."""
    config = config or FleetConfig()
    need(isinstance(profile, ReplicaProfile), f"profile must be a ReplicaProfile, got {type(profile).__name__}")
    need(config.max_num_seqs <= profile.max_measured_batch,
         f"max_num_seqs={config.max_num_seqs} is above the profile's largest measured batch size "
         f"{profile.max_measured_batch}: measure the decode curve up to it (measure_profile(batch_sizes=...))")
    for r in requests:
        need(isinstance(r, SimRequest), f"requests must be SimRequest objects, got {type(r).__name__}")
    copies = [_fresh(r) for r in requests]
    end_s = duration_s if duration_s is not None else max((r.arrival_s for r in copies), default=0.0)
    need(finite(end_s), f"duration_s={duration_s!r} must be a finite number of seconds >= 0")
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


def simulate_day(traffic: Traffic, profile: ReplicaProfile, config: FleetConfig | None = None, seed: int = 0,
                 start_h: float = 0.0, end_h: float = 24.0) -> SimResult:
    """The traffic between start_h and end_h through the fleet (t=0 is start_h)."""
    requests = day_requests(traffic, seed=seed, start_h=start_h, end_h=end_h)
    return simulate(requests, profile, config, duration_s=(end_h - start_h) * traffic.hour_s, hour_s=traffic.hour_s)

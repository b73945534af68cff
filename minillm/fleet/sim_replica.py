"""One simulated replica: minillm's engine with continuous batching and whole-prompt prefill, in SimPy time.

Between steps the engine admits waiting requests (up to `max_num_seqs` running, `max_num_batched_tokens` prompt
tokens per step) and runs them as one prefill step, which also gives each its first token; otherwise it runs a
decode step that gives every running request one token. Step times come from the ReplicaProfile
(replica_profile.py). A request arriving mid-step waits for the step's end. Decode stretches are advanced in
one event up to the next finish or admissible arrival, so events grow with requests, not with steps; with
FleetConfig(replicas_share_cores=True) steps are simulated one per event, since the busy slowdown can change
at every step. With FleetConfig(record_gaps=True) each request keeps `gaps_s`, the seconds between its
successive tokens (a gap holding another request's prefill step included), as a streaming client measures them.

`sim` is the running simulation (simulate.py): its env, config, profile and replicas, and its dispatch().
"""

from __future__ import annotations

import math
from collections import deque

import simpy

from .traffic import SimRequest


class SimReplica:
    """One engine: continuous batching with whole-prompt prefill steps (see the module docstring)."""

    def __init__(self, sim, index: int, ready_s: float):
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

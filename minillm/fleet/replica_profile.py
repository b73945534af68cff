"""ReplicaProfile: what one replica costs in time (step-time curves, start-up, busy slowdown), saved as JSON.

Measured by minillm/fleet/profile.py (measure_profile in-process, calibrate_on_server on a running fleet) or
written by hand; the simulator (simulate.py) reads `prefill_s(total prompt tokens)` and `decode_step_s(batch
size)`, each a piecewise-linear curve through measured points (a step's context length is ignored: at these
prompt sizes the MLP dominates), and, with FleetConfig(replicas_share_cores=True), `decode_scale` /
`prefill_scale`: how much slower a replica's steps get while other replicas on its machine run theirs.
`scaled(decode, prefill)` rescales the curves (the validation's during-ramp fit, minillm/bench/fleet_report.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .checks import Piecewise, finite, need


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
            need(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                 f"{name}={value!r} must be an integer >= 1 (replicas busy while the {name.split('_')[0]} "
                 f"points were measured)")
        self._decode = Piecewise(self.decode_points)
        self._prefill = Piecewise(self.prefill_points)
        self._slowdown = Piecewise(self.busy_slowdown_points)
        self._scale_cache: dict[tuple[int, int], float] = {}
        self._decode_cache: dict[int, float] = {}
        need(finite(self.startup_s), f"startup_s={self.startup_s!r} must be a finite number of seconds >= 0")
        need(finite(self.request_overhead_s),
             f"request_overhead_s={self.request_overhead_s!r} must be a finite number of seconds >= 0")

    @staticmethod
    def _check_points(name: str, points, what: str, value: str = "seconds") -> list[tuple[int, float]]:
        need(isinstance(points, (list, tuple)) and len(points) >= 1,
             f"{name}={points!r} must be a non-empty list of ({what}, {value}) pairs")
        out = []
        for p in points:
            need(isinstance(p, (list, tuple)) and len(p) == 2, f"{name}: {p!r} is not a ({what}, {value}) pair")
            x, y = p
            need(isinstance(x, (int, float)) and not isinstance(x, bool) and x >= 1 and float(x) == int(x),
                 f"{name}: {what} {x!r} must be an integer >= 1")
            need(finite(y, strict=True), f"{name}: {value} {y!r} at {what} {x} must be a finite number > 0")
            out.append((int(x), float(y)))
        out.sort()
        xs = [p[0] for p in out]
        need(len(set(xs)) == len(xs), f"{name}: {what} values {xs} repeat")
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
        during-ramp fit, minillm/bench/fleet_report.py); the busy slowdown, start-up and overhead are kept."""
        for name, value in (("decode", decode), ("prefill", prefill)):
            need(finite(value, strict=True), f"{name}={value!r} must be a finite step-time factor > 0")
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
        need(isinstance(data, dict), f"a profile is a JSON object, got {type(data).__name__}")
        unknown = set(data) - known
        need(not unknown, f"unknown profile fields {sorted(unknown)} (known: {sorted(known)})")
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

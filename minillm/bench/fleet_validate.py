"""The fleet validation's run: a real Ray Serve fleet, calibrated before and after a load ramp of streamed requests.

`python -m minillm.bench.fleet --validate [--quick]`; minillm/bench/fleet.py's docstring says why it is built
this way, fleet_report.py predicts and judges the report it returns.
"""

from __future__ import annotations

import os
import random
import statistics
import time

from .fleet_profile import describe_profile
from .fleet_report import TOLERANCE_ABS_S, TOLERANCE_REL, predict_report

QUICK_RAMP_S = 150.0        # --validate --quick: the ramp's length (full: FULL_RAMP_S), and calibration rounds
FULL_RAMP_S = 300.0
QUICK_CALIBRATION_ROUNDS, FULL_CALIBRATION_ROUNDS = 2, 3


def ramp_requests(duration_s: float, rate_from: float, rate_to: float, seed: int = 0,
                  prompt_tokens=(16, 192), output_tokens=(8, 40)) -> list[tuple[float, int, int]]:
    """(send at s, prompt tokens, output tokens): Poisson arrivals whose rate rises linearly over duration_s."""
    rng = random.Random(seed)
    peak = max(rate_from, rate_to)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return out
        if rng.random() * peak < rate_from + (rate_to - rate_from) * t / duration_s:
            out.append((t, rng.randint(*prompt_tokens), rng.randint(*output_tokens)))


def capacity_rps(profile, num_replicas: int, max_num_seqs: int, mean_prompt: float, mean_output: float) -> float:
    """Requests/s the fleet finishes with full batches: each request costs its share of decode steps
    plus a prefill step (which stalls the batch)."""
    replica_s = mean_output * profile.decode_step_s(max_num_seqs) / max_num_seqs + profile.prefill_s(round(mean_prompt))
    return num_replicas / replica_s


def mean_profile(a, b):
    """The pointwise mean of two calibrations of the same fleet (same sizes): a load passing on the machine
    during one of them moves the prediction half as much."""
    from ..fleet.replica_profile import ReplicaProfile

    def mean(pa, pb):
        if [x for x, _ in pa] != [x for x, _ in pb]:
            raise ValueError(f"the two profiles were measured at different sizes: {pa} vs {pb}")
        return [(x, (ya + yb) / 2) for (x, ya), (_, yb) in zip(pa, pb)]

    for name in ("decode_busy_replicas", "prefill_busy_replicas"):
        if getattr(a, name) != getattr(b, name):
            raise ValueError(f"the two profiles differ in {name}: {getattr(a, name)} vs {getattr(b, name)}")
    return ReplicaProfile(decode_points=mean(a.decode_points, b.decode_points),
                          prefill_points=mean(a.prefill_points, b.prefill_points),
                          startup_s=(a.startup_s + b.startup_s) / 2,
                          request_overhead_s=(a.request_overhead_s + b.request_overhead_s) / 2,
                          busy_slowdown_points=mean(a.busy_slowdown_points, b.busy_slowdown_points),
                          decode_busy_replicas=a.decode_busy_replicas,
                          prefill_busy_replicas=a.prefill_busy_replicas,
                          conditions={**a.conditions, "how": "mean of two calibrate_on_server runs"})


def drift(a, b) -> float:
    """The largest relative difference between two calibrations' points."""
    pairs = list(zip(a.decode_points + a.prefill_points + a.busy_slowdown_points,
                     b.decode_points + b.prefill_points + b.busy_slowdown_points))
    return max(abs(ya - yb) / min(ya, yb) for (_, ya), (_, yb) in pairs)


class LoadSampler:
    """The machine's 1-minute load average every 5 s while the ramp runs (os.getloadavg): the fleet itself
    makes about 2-3 on 2 cores; much more means other jobs shared the machine and slowed the real fleet."""

    def __init__(self, interval_s: float = 5.0):
        import threading

        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True)

    def _run(self, interval_s: float) -> None:
        import os

        while not self._stop.wait(interval_s):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def validate(quick: bool = False, num_replicas: int = 2, max_num_seqs: int = 8, max_ongoing_requests: int = 16,
             duration_s: float | None = None, load_from: float = 0.2, load_to: float = 0.65, seed: int = 0,
             progress: bool = True) -> dict:
    """Run the validation (see the module docstring); returns measured and predicted TTFTs and the verdicts."""
    from ..fleet.profile import calibrate_on_server, prompt_ids, send_requests
    from ..serve.client import run_in_thread
    from ..fleet.ray_fleet import start_fleet
    duration_s = duration_s or (QUICK_RAMP_S if quick else FULL_RAMP_S)
    t_start = time.perf_counter()
    print(f"starting a fleet of {num_replicas} replicas (default model, 1 thread each, max_num_seqs {max_num_seqs}) ...",
          flush=True)
    with start_fleet({"max_num_seqs": max_num_seqs}, num_replicas=num_replicas, threads_per_replica=1,
                     max_ongoing_requests=max_ongoing_requests) as fleet:
        startups = fleet.startup_times()
        startup_s = statistics.mean(s["total_s"] for s in startups) if startups else 0.0
        print(f"fleet up at {fleet.base_url} in {time.perf_counter() - t_start:.0f} s "
              f"(replica start-up {startup_s:.1f} s)", flush=True)
        batch_sizes = sorted({1, 2, 4, max_num_seqs} | ({8} if max_num_seqs >= 8 else set()))
        batch_sizes = [b for b in batch_sizes if b <= max_num_seqs]
        def calibrate():
            return calibrate_on_server(fleet.base_url, num_replicas=num_replicas, batch_sizes=batch_sizes,
                                       prompt_tokens=(16, 96, 192), decode_prompt_tokens=104, decode_tokens=16,
                                       repeats=QUICK_CALIBRATION_ROUNDS if quick else FULL_CALIBRATION_ROUNDS,
                                       startup_s=startup_s, progress=progress)

        before = calibrate()
        print("calibrated before the ramp: " + describe_profile(before, max_num_seqs), flush=True)
        mean_prompt, mean_output = (16 + 192) / 2, (8 + 40) / 2
        capacity = capacity_rps(before, num_replicas, max_num_seqs, mean_prompt, mean_output)
        plan = ramp_requests(duration_s, load_from * capacity, load_to * capacity, seed=seed)
        print(f"estimated capacity {capacity:.2f} req/s: sending {len(plan)} requests over {duration_s:.0f} s, "
              f"{load_from * capacity:.2f} -> {load_to * capacity:.2f} req/s", flush=True)
        from ..serve.client import discover_model
        model = discover_model(fleet.base_url)
        with LoadSampler() as load:
            timings = run_in_thread(send_requests, fleet.base_url, model,
                                [(at, prompt_ids(p, seed=i), o) for i, (at, p, o) in enumerate(plan)], progress=progress)
        after = calibrate()
        print("calibrated after the ramp:  " + describe_profile(after, max_num_seqs), flush=True)
    profile = mean_profile(before, after)
    failed = [t.error for t in timings if t.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(timings)} validation requests failed: {failed[0]}")
    report = {"requests": [{"start_s": t.start_s, "prompt_tokens": p, "output_tokens": o, "ttft_s": t.ttft_s,
                            "replica": t.replica, "gaps_s": t.gaps_s}
                           for t, (_, p, o) in sorted(zip(timings, plan), key=lambda x: x[0].start_s)],
              "num_requests": len(timings), "duration_s": duration_s, "capacity_rps": capacity,
              "rate_from": load_from * capacity, "rate_to": load_to * capacity, "num_replicas": num_replicas,
              "max_num_seqs": max_num_seqs, "max_ongoing_requests": max_ongoing_requests,
              "profile": profile.to_dict(), "profile_before": before.to_dict(),
              "profile_after": after.to_dict(), "calibration_drift": drift(before, after),
              "tolerance": {"rel": TOLERANCE_REL, "abs_s": TOLERANCE_ABS_S}, "wall_s": time.perf_counter() - t_start,
              "load_average": {"mean": statistics.mean(load.samples) if load.samples else float("nan"),
                               "max": max(load.samples, default=float("nan")), "cores": os.cpu_count()}}
    predict_report(report)
    return report

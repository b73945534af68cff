"""A fleet validation's report predicted and judged: the during-ramp fit, the simulator's TTFTs, the verdict, the text.

predict_report fills a report (from `python -m minillm.bench.fleet --validate`, fleet_validate.py, or a saved
one: `--replay PATH`) with the simulator's predictions; see minillm/bench/fleet.py's docstring for the method.
Nothing here starts a fleet.
"""

from __future__ import annotations

import statistics

TOLERANCE_REL = 0.30        # the validation's stated tolerance: 30% of the measured value ...
TOLERANCE_ABS_S = 0.25      # ... or 0.25 s, whichever is larger
SIM_SEEDS = 5
STALL_FACTOR = 3.0          # a gap over 3 x the median gap holds a prefill step (another request's admission)
FIT_ITERATIONS = 10         # the during-ramp fit's fixed-point iterations, at most
NOISE_SEEDS = 20            # router seeds for the fitted simulator's own p99 spread


def within(predicted: float, measured: float) -> bool:
    return abs(predicted - measured) <= max(TOLERANCE_REL * measured, TOLERANCE_ABS_S)


def gap_statistics(gaps_s: list[float], stall_factor: float = STALL_FACTOR) -> dict:
    """What a replica's steps looked like to its streams: decode_gap_s, the mean inter-token gap among gaps up
    to stall_factor x the median (decode steps); stall_excess_s, the mean of the longer gaps minus decode_gap_s
    (those stalls hold a prefill step of requests admitted while this one decoded: the prefill time under the
    ramp's real concurrency); num_stalls. None where there are no gaps; stall_excess_s None without stalls."""
    if not gaps_s:
        return None
    median = statistics.median(gaps_s)
    decode = [g for g in gaps_s if g <= stall_factor * median]
    decode_gap_s = statistics.mean(decode)
    stalls = [g - decode_gap_s for g in gaps_s if g > stall_factor * median]
    return {"decode_gap_s": decode_gap_s, "stall_excess_s": statistics.mean(stalls) if stalls else None,
            "num_stalls": len(stalls), "num_gaps": len(gaps_s)}


def fit_ramp_scales(measured_gaps_s: list[float], profile, simulate_gaps,
                    iterations: int = FIT_ITERATIONS) -> dict:
    """Calibrate on the ramp itself: the decode and prefill step-time factors that make the simulated replay's
    inter-token gaps look like the measured ones (gap_statistics: the decode gap and the stall excess).

    simulate_gaps(profile) -> the simulated gaps of the same requests (all router seeds pooled). Fixed-point
    iteration: decode x= measured / simulated decode gap, prefill x= measured / simulated stall excess, the
    replay simulated again with the rescaled profile, until both ratios are within 1% of 1 (at most
    `iterations` rounds; a rescaled step changes the batch sizes and stalls the replay sees, so one ratio
    is not the answer). TTFT is never read here: it is what the validation checks. Without stalls (in the
    measurement or the replay) prefill stays 1 and prefill_fitted is False."""
    measured = gap_statistics(measured_gaps_s)
    if measured is None:
        raise ValueError("the report holds no inter-token gaps (gaps_s): a request needs >= 2 output tokens")
    decode_scale = prefill_scale = 1.0
    prefill_fitted = measured["stall_excess_s"] is not None
    simulated, rounds = None, 0
    for rounds in range(1, iterations + 1):
        simulated = gap_statistics(simulate_gaps(profile.scaled(decode_scale, prefill_scale)))
        decode_ratio = measured["decode_gap_s"] / simulated["decode_gap_s"]
        prefill_fitted = prefill_fitted and simulated["stall_excess_s"] is not None
        prefill_ratio = measured["stall_excess_s"] / simulated["stall_excess_s"] if prefill_fitted else 1.0
        if abs(decode_ratio - 1) < 0.01 and abs(prefill_ratio - 1) < 0.01:
            break
        decode_scale *= decode_ratio
        prefill_scale *= prefill_ratio
    return {"decode_scale": decode_scale, "prefill_scale": prefill_scale, "prefill_fitted": prefill_fitted,
            "iterations": rounds, "measured": measured, "simulated": simulated, "stall_factor": STALL_FACTOR}


def _report_profile(data: dict):
    """A report's profile; reports saved before decode_busy_replicas / prefill_busy_replicas split had one
    measured_busy_replicas for both curves."""
    from ..fleet.replica_profile import ReplicaProfile

    data = dict(data)
    if "measured_busy_replicas" in data:
        data["decode_busy_replicas"] = data["prefill_busy_replicas"] = data.pop("measured_busy_replicas")
    return ReplicaProfile.from_dict(data)


def predict_report(report: dict) -> dict:
    """Fill a validation report's predictions from its requests and profiles (also for a saved report:
    `--replay PATH` predicts again without a fleet): p50 / p99 measured vs predicted with the shared-core
    model from the before/after calibrations (p50 / p99: predicted_s, within), the same without the
    shared-core model (replicas independent) and from each calibration alone; the during-ramp fit
    (report["ramp_fit"], fit_ramp_scales; p50 / p99: predicted_ramp_fit_s, within_ramp_fit), the fitted
    simulator's p99 over NOISE_SEEDS router seeds, and the TTFT p50 by third of the ramp."""
    from ..fleet.policies import FixedReplicas
    from ..fleet.simulate import FleetConfig, simulate
    from ..fleet.traffic import SimRequest
    from ..serve.client import percentile

    rows = report["requests"]
    requests = [SimRequest(r["start_s"], r["prompt_tokens"], r["output_tokens"]) for r in rows]
    measured = [r["ttft_s"] for r in rows]
    num_replicas, duration_s = report["num_replicas"], report["duration_s"]

    def run(profile, shared: bool, seed: int = 0, record_gaps: bool = False):
        config = FleetConfig(max_num_seqs=report["max_num_seqs"], max_ongoing_requests=report["max_ongoing_requests"],
                             min_replicas=num_replicas, max_replicas=num_replicas, policy=FixedReplicas(num_replicas),
                             seed=seed, replicas_share_cores=shared, record_gaps=record_gaps)
        return simulate(requests, profile, config)

    def mean_percentiles(profile, seeds=range(SIM_SEEDS), shared=True):
        results = [run(profile, shared, seed) for seed in seeds]
        return {q: statistics.mean(r.ttft_percentile(q) for r in results) for q in (50, 99)}

    profiles = {name: _report_profile(report[key])
                for name, key in (("mean", "profile"), ("before", "profile_before"), ("after", "profile_after"))}
    shared, independent = mean_percentiles(profiles["mean"]), mean_percentiles(profiles["mean"], shared=False)
    first = sorted(run(profiles["mean"], True).requests, key=lambda r: r.arrival_s)
    for row, r in zip(rows, first):
        row["predicted_ttft_s"] = r.ttft_s
    alone = {name: mean_percentiles(profiles[name], seeds=[0]) for name in ("before", "after")}

    measured_gaps = [g for r in rows for g in r.get("gaps_s") or []]
    fitted = None
    if measured_gaps:
        def simulate_gaps(profile):
            return [g for seed in range(SIM_SEEDS) for r in run(profile, True, seed, record_gaps=True).requests
                    for g in r.gaps_s or []]

        fit = fit_ramp_scales(measured_gaps, profiles["mean"], simulate_gaps)
        fitted_profile = profiles["mean"].scaled(fit["decode_scale"], fit["prefill_scale"])
        fitted = mean_percentiles(fitted_profile)
        spread = sorted(run(fitted_profile, True, seed).ttft_percentile(99) for seed in range(NOISE_SEEDS))
        fit["p99_over_router_seeds_s"] = {"seeds": NOISE_SEEDS, "min": spread[0], "max": spread[-1],
                                          "median": statistics.median(spread)}
        report["ramp_fit"] = fit
    else:
        report.pop("ramp_fit", None)
    for q in (50, 99):
        got, pred = percentile(measured, q), shared[q]
        row = {"measured_s": got, "predicted_s": pred, "rel_error": (pred - got) / got,
               "within": within(pred, got), "predicted_before_only_s": alone["before"][q],
               "predicted_after_only_s": alone["after"][q], "predicted_independent_s": independent[q]}
        if fitted is not None:
            row.update(predicted_ramp_fit_s=fitted[q], rel_error_ramp_fit=(fitted[q] - got) / got,
                       within_ramp_fit=within(fitted[q], got))
        report[f"p{q}"] = row
    ranked = sorted(measured, reverse=True)
    report["p99_rank"] = {"position": (len(measured) - 1) * 0.99, "largest": ranked[:3]}
    thirds = []
    for k in range(3):
        lo, hi = duration_s * k / 3, duration_s * (k + 1) / 3
        part = [r for r in rows if lo <= r["start_s"] < hi]
        thirds.append({"from_s": lo, "to_s": hi, "num_requests": len(part),
                       "measured_p50_s": percentile([r["ttft_s"] for r in part], 50),
                       "predicted_p50_s": percentile([r["predicted_ttft_s"] for r in part], 50)})
    report["thirds"] = thirds
    return report


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def verdict(report: dict) -> bool:
    """The validation's verdict (the exit status): p50 and p99 within the tolerance with the during-ramp fit
    (see the module docstring for why), or with the before/after calibrations where a report has no gaps."""
    key = "within_ramp_fit" if "ramp_fit" in report else "within"
    return all(report[f"p{q}"][key] for q in (50, 99))


def format_validation(report: dict) -> str:
    tol = report["tolerance"]
    fit = report.get("ramp_fit")
    lines = [f"validation: {report['num_requests']} requests over {report['duration_s']:.0f} s on "
             f"{report['num_replicas']} replicas (max_num_seqs {report['max_num_seqs']}), "
             f"{report['rate_from']:.2f} -> {report['rate_to']:.2f} req/s (capacity {report['capacity_rps']:.2f}); "
             f"tolerance: within max({tol['rel']:.0%} of measured, {tol['abs_s']} s)",
             f"{'TTFT':>6} {'measured':>9} | {'fitted during the ramp':>27} | {'before/after calibrations':>27} "
             f"| independent replicas; one calibration: before / after"]

    def cell(predicted_s: float, rel_error: float, ok: bool) -> str:
        return f"{predicted_s:>9.3f}s {rel_error:>+7.0%}  {'within ' if ok else 'OUTSIDE'}"

    for q in (50, 99):
        row = report[f"p{q}"]
        ramp = (cell(row["predicted_ramp_fit_s"], row["rel_error_ramp_fit"], row["within_ramp_fit"])
                if fit is not None else "(no gaps_s in the report)")
        lines.append(f"{'p' + str(q):>6} {row['measured_s']:>8.3f}s | {ramp:>27} | "
                     f"{cell(row['predicted_s'], row['rel_error'], row['within'])} "
                     f"| {row['predicted_independent_s']:.3f} s; {row['predicted_before_only_s']:.3f} s / "
                     f"{row['predicted_after_only_s']:.3f} s")
    lines.append(f"verdict: {'within' if verdict(report) else 'OUTSIDE'} "
                 f"({'fitted during the ramp' if fit is not None else 'before/after calibrations'})")
    if fit is not None:
        m, s = fit["measured"], fit["simulated"]
        stall = (f"stall excess {m['stall_excess_s']:.3f} / {s['stall_excess_s']:.3f} s"
                 if fit["prefill_fitted"] else "no stalls: prefill not fitted")
        lines.append(f"fitted during the ramp (from inter-token gaps only; TTFT is not used): decode steps "
                     f"x{fit['decode_scale']:.2f}, prefill x{fit['prefill_scale']:.2f} of the calibrations' mean "
                     f"(measured / replayed: decode gap {m['decode_gap_s']:.3f} / {s['decode_gap_s']:.3f} s, "
                     f"{stall}, stalls {m['num_stalls']} / {s['num_stalls'] / SIM_SEEDS:.0f}; "
                     f"{fit['iterations']} rounds)")
        noise = fit["p99_over_router_seeds_s"]
        lines.append(f"the fitted simulator's own p99 over {noise['seeds']} router seeds: {noise['min']:.2f} - "
                     f"{noise['max']:.2f} s (median {noise['median']:.2f}): what routing coincidences alone move p99")
    rank = report["p99_rank"]
    above = report["num_requests"] - int(rank["position"])   # p99 lies between the above-th and (above-1)-th largest
    lines.append(f"p99 of {report['num_requests']} TTFTs: between the {_ordinal(above)} and "
                 f"{_ordinal(max(above - 1, 1))} largest (the largest three: "
                 + ", ".join(f"{v:.2f}" for v in rank["largest"]) + " s)")
    lines.append("TTFT p50 by third of the ramp, measured / predicted (before/after calibrations): " + ", ".join(
        f"{t['from_s']:.0f}-{t['to_s']:.0f} s: {t['measured_p50_s']:.2f} / {t['predicted_p50_s']:.2f} s"
        for t in report["thirds"]))
    busy = report["profile"]["busy_slowdown_points"]
    lines.append("busy slowdown (replicas busy at once: step-time factor), mean of the two calibrations: "
                 + ", ".join(f"{k}: {f:.2f}" for k, f in busy))
    load = report["load_average"]
    lines.append(f"machine load during the ramp: 1-min load average {load['mean']:.1f} mean, {load['max']:.1f} max "
                 f"on {load['cores']} cores (the fleet alone makes about 2-3; more: other jobs slowed the real fleet)")
    lines.append(f"(the profile: the mean of calibrations before and after the ramp, which differ by up to "
                 f"{report['calibration_drift']:.0%}; whole run {report['wall_s']:.0f} s wall, "
                 f"{report['num_replicas']} replicas x 1 thread)")
    return "\n".join(lines)

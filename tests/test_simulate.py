"""The fleet simulator (minillm/fleet/simulate.py): hand-computed timings, queueing theory, the autoscaler's
timing, cost arithmetic, the warm-replica search, bad inputs; and (slow) its prediction of a real fleet."""

import json
import math
import random

import pytest

from minillm.fleet.policies import FixedReplicas, FleetState, RayServePolicy
from minillm.fleet.replica_profile import ReplicaProfile
from minillm.fleet.simulate import FleetConfig, simulate, simulate_day
from minillm.fleet.sizing import warm_replicas_for_p99
from minillm.fleet.traffic import SimRequest, Traffic, daily_traffic, day_requests


def flat_profile(decode_s=0.1, prefill_s=0.5, max_batch=16, startup_s=0.0, overhead_s=0.0):
    return ReplicaProfile(decode_points=sorted({(1, decode_s), (max_batch, decode_s)}), prefill_points=[(1, prefill_s)],
                          startup_s=startup_s, request_overhead_s=overhead_s)


def by_arrival(result):
    return sorted(result.requests, key=lambda r: r.arrival_s)


def test_one_replica_reproduces_hand_computed_times():
    # A: prefill 0 -> 0.5; B waits for A's prefill step to end, prefills 0.5 -> 1.0;
    # both decode (0.1 s/step): B's last token at 1.1, A's at 1.2; C arrives to an idle replica.
    profile = flat_profile(overhead_s=0.02)
    requests = [SimRequest(0.0, 10, 3), SimRequest(0.2, 10, 2), SimRequest(2.0, 7, 1)]
    a, b, c = by_arrival(simulate(requests, profile, FleetConfig(policy=FixedReplicas(1))))
    assert a.first_token_s == pytest.approx(0.5) and a.finish_s == pytest.approx(1.2)
    assert b.first_token_s == pytest.approx(1.0) and b.finish_s == pytest.approx(1.1)
    assert c.first_token_s == pytest.approx(2.5) and c.finish_s == pytest.approx(2.5)
    assert [r.ttft_s for r in (a, b, c)] == pytest.approx([0.52, 0.82, 0.52])
    assert requests[0].first_token_s is None, "the caller's requests keep no simulated times"


def test_an_arrival_mid_decode_waits_for_the_step_then_prefills():
    # decode steps take 0.1 s alone, 0.15 s in pairs; A (10 tokens) decodes from 0.5 in steps ending at
    # 0.6, 0.7, 0.8; B arrives at 0.73, so step 3 ends (A has 6 to go), B prefills 0.8 -> 1.3, one pair
    # step 1.3 -> 1.45 ends B, A's last 5 steps run alone: 1.45 -> 1.95.
    profile = ReplicaProfile(decode_points=[(1, 0.1), (2, 0.15)], prefill_points=[(1, 0.5)])
    a, b = by_arrival(simulate([SimRequest(0.0, 4, 10), SimRequest(0.73, 4, 2)], profile,
                               FleetConfig(max_num_seqs=2, policy=FixedReplicas(1))))
    assert b.first_token_s == pytest.approx(1.3)
    assert b.finish_s == pytest.approx(1.45)
    assert a.finish_s == pytest.approx(1.95)
    assert a.gaps_s is None, "gaps are recorded only when asked"
    # A's 4th gap holds B's prefill: 0.8 -> 1.45; B's one gap is the pair step
    a, b = by_arrival(simulate([SimRequest(0.0, 4, 10), SimRequest(0.73, 4, 2)], profile,
                               FleetConfig(max_num_seqs=2, policy=FixedReplicas(1), record_gaps=True)))
    assert a.gaps_s == pytest.approx([0.1, 0.1, 0.1, 0.65, 0.1, 0.1, 0.1, 0.1, 0.1])
    assert b.gaps_s == pytest.approx([0.15])
    assert sum(a.gaps_s) == pytest.approx(a.finish_s - a.first_token_s)


def test_replicas_sharing_cores_slow_each_others_steps_by_the_measured_factor():
    # steps take twice as long while both replicas work (slowdown 2.0 at 2 busy, the curves measured with 1 busy).
    # A (3 tokens) on one replica: prefill alone 0 -> 0.5, decode step alone 0.5 -> 0.6. B arrives at 0.55 on the
    # idle replica: its prefill runs with both busy, 0.55 -> 1.55; A's second step too, 0.6 -> 0.8 (A done);
    # B's one decode step runs alone, 1.55 -> 1.65. Independent replicas: B 0.55 -> 1.05 -> 1.15, A done at 0.7.
    profile = ReplicaProfile(decode_points=[(1, 0.1), (2, 0.1)], prefill_points=[(1, 0.5)],
                             busy_slowdown_points=[(1, 1.0), (2, 2.0)])
    requests = [SimRequest(0.0, 4, 3), SimRequest(0.55, 4, 2)]
    config = dict(max_num_seqs=2, min_replicas=2, max_replicas=2, policy=FixedReplicas(2))
    a, b = by_arrival(simulate(requests, profile, FleetConfig(**config, replicas_share_cores=True)))
    assert a.replica != b.replica
    assert (a.first_token_s, a.finish_s) == pytest.approx((0.5, 0.8))
    assert (b.first_token_s, b.finish_s) == pytest.approx((1.55, 1.65))
    a, b = by_arrival(simulate(requests, profile, FleetConfig(**config)))
    assert (a.finish_s, b.first_token_s, b.finish_s) == pytest.approx((0.7, 1.05, 1.15)), "off by default"


def test_busy_scale_is_relative_to_the_replicas_busy_when_the_curves_were_measured():
    # decode calibrated on a 2-replica fleet with both busy (slowdown 1.5 at 2), prefill with one busy: one busy
    # replica decodes in 1/1.5 of the decode curve, 3 busy (extrapolated: 2.0) in 2.0/1.5; its prefill is as measured
    profile = ReplicaProfile(decode_points=[(1, 0.1)], prefill_points=[(1, 0.5)],
                             busy_slowdown_points=[(2, 1.5), (1, 1.0)], decode_busy_replicas=2)
    assert [profile.decode_scale(k) for k in (1, 2, 3)] == pytest.approx([1 / 1.5, 1.0, 2.0 / 1.5])
    assert [profile.prefill_scale(k) for k in (1, 2, 3)] == pytest.approx([1.0, 1.5, 2.0])
    assert flat_profile().busy_scale(4) == 1.0, "not measured: no slowdown"
    # one replica alone: prefill 0.5, then two decode steps of 0.1 / 1.5
    (r,) = simulate([SimRequest(0.0, 4, 3)], profile,
                    FleetConfig(max_num_seqs=1, policy=FixedReplicas(1), replicas_share_cores=True)).requests
    assert (r.first_token_s, r.finish_s) == pytest.approx((0.5, 0.5 + 0.2 / 1.5))


def test_stream_timing_splits_the_gaps_of_each_choice():
    from minillm.fleet.profile import StreamTiming

    timing = StreamTiming(choice_times_s=[(0, 0.1), (1, 0.1), (0, 0.3), (1, 0.35), (0, 0.45)])
    first, second = timing.gaps_by_choice()
    assert first == pytest.approx([0.2, 0.15]) and second == pytest.approx([0.25])


def test_prefill_time_follows_the_tokens_of_the_step_and_the_token_budget():
    # prefill 0.001 s per token (through (100, 0.1) and (1000, 1.0)); three 300-token prompts queued
    # behind a first one: with a 600-token budget two share a step (0.6 s) and the third gets its own.
    profile = ReplicaProfile(decode_points=[(1, 0.01), (8, 0.01)], prefill_points=[(100, 0.1), (1000, 1.0)])
    requests = [SimRequest(0.0, 100, 1)] + [SimRequest(0.05, 300, 1) for _ in range(3)]
    config = FleetConfig(max_num_seqs=8, max_num_batched_tokens=600, policy=FixedReplicas(1))
    first, *rest = by_arrival(simulate(requests, profile, config))
    assert first.first_token_s == pytest.approx(0.1)
    assert sorted(r.first_token_s for r in rest) == pytest.approx([0.7, 0.7, 1.0])


def test_queueing_grows_toward_capacity_like_md1():
    # max_num_seqs=1: one FIFO server with a deterministic service time S = prefill + (out - 1) * decode,
    # so the mean wait before the prefill follows Pollaczek-Khinchine: rho * S / (2 (1 - rho)).
    profile = flat_profile(decode_s=0.01, prefill_s=0.05, max_batch=1)
    service_s = 0.05 + 5 * 0.01
    waits = []
    for rho in (0.3, 0.6, 0.85):
        rng = random.Random(1)
        t, requests = 0.0, []
        for _ in range(12000):
            t += rng.expovariate(rho / service_s)
            requests.append(SimRequest(t, 8, 6))
        result = simulate(requests, profile, FleetConfig(max_num_seqs=1, policy=FixedReplicas(1)))
        wait = sum(r.ttft_s - 0.05 for r in result.requests) / len(requests)
        expected = rho * service_s / (2 * (1 - rho))
        assert wait == pytest.approx(expected, rel=0.15), f"rho={rho}: mean wait {wait:.4f} s vs M/D/1 {expected:.4f} s"
        waits.append(wait)
    assert waits[0] < waits[1] < waits[2]


def test_autoscaler_adds_replicas_after_the_upscale_delay_and_startup():
    # 20 long requests at t=0 on one replica (max 16 ongoing: 4 wait at the router); Ray's policy wants
    # ceil(20 / 2) = 10, clamped to 4; the wish holds from t=0, so at t=10 it asks for 4, ready at 15.
    profile = flat_profile(decode_s=0.05, prefill_s=0.2, startup_s=5.0)
    requests = [SimRequest(0.0, 16, 400) for _ in range(20)]
    policy = RayServePolicy(target_ongoing_requests=2, upscale_delay_s=10, downscale_delay_s=1e6, look_back_period_s=0)
    config = FleetConfig(max_num_seqs=16, max_ongoing_requests=16, min_replicas=1, max_replicas=4, policy=policy,
                         sample_interval_s=1.0)
    result = simulate(requests, profile, config)
    assert result.scale_events == [(10.0, 4)]
    ready = {s["t_s"]: s["replicas"] for s in result.timeline}
    assert ready[14.0] == 1 and ready[15.0] == 4
    starting = {s["t_s"]: s["starting"] for s in result.timeline}
    assert starting[10.0] == 3 and starting[15.0] == 0
    routed_late = sorted(r.dispatched_s for r in result.requests if r.dispatched_s > 0)
    assert routed_late == pytest.approx([15.0] * 4), "the router's queue drains when the new replicas are ready"
    assert {r.replica for r in result.requests if r.dispatched_s > 0} <= {1, 2, 3}
    assert all(r.finish_s is not None for r in result.requests)


def test_downscale_delay_and_replica_hours():
    # no traffic, 4 warm replicas, min 1: the wish to go down holds from t=0 and is acted on at t=30;
    # the 3 idle replicas stop at once: 4 x 30 + 1 x 70 replica-seconds over 100 s.
    policy = RayServePolicy(downscale_delay_s=30, look_back_period_s=0)
    config = FleetConfig(min_replicas=1, initial_replicas=4, max_replicas=4, hourly_usd=3.6, policy=policy)
    result = simulate([], flat_profile(), config, duration_s=100)
    assert result.scale_events == [(30.0, 1)]
    assert result.replica_seconds() == pytest.approx(190.0)
    assert result.usd() == pytest.approx(190.0 * 3.6 / 3600)
    assert result.replica_seconds(0, 50) == pytest.approx(4 * 30 + 20)
    assert math.isinf(result.usd_per_mtok), "no tokens served: infinite $ per token"


def test_a_draining_replica_finishes_its_requests_and_is_billed_until_the_last_one():
    # two replicas, one long request on each; the policy asks for one replica at t=1: one of them takes no
    # new request, finishes what it holds, and its bill stops at its last token
    profile = flat_profile(decode_s=0.1, prefill_s=0.5)
    requests = [SimRequest(0.0, 8, 30), SimRequest(0.0, 8, 10), SimRequest(2.0, 8, 5), SimRequest(2.5, 8, 5)]
    result = simulate(requests, profile, FleetConfig(min_replicas=1, max_replicas=2, initial_replicas=2,
                                                     policy=lambda state: 1 if state.now_s >= 1 else 2))
    assert result.scale_events == [(1.0, 1)]
    a, b, *late = by_arrival(result)
    assert a.replica != b.replica, "power of two choices put the first two requests on different replicas"
    (kept,) = {r.replica for r in late}
    drained = a if b.replica == kept else b
    assert drained.finish_s == pytest.approx(0.5 + (drained.output_tokens - 1) * 0.1)
    assert result.replica_spans[drained.replica] == pytest.approx((0.0, drained.finish_s))
    assert result.replica_spans[kept][1] == pytest.approx(result.duration_s)


def test_scale_from_zero_asks_for_a_replica_at_the_first_request():
    profile = flat_profile(startup_s=7.0)
    config = FleetConfig(min_replicas=0, max_replicas=3, policy=RayServePolicy(upscale_delay_s=100))
    (request,) = simulate([SimRequest(3.2, 8, 2)], profile, config).requests
    assert request.dispatched_s == pytest.approx(4.0 + 7.0), "the next tick (t=4) starts one; it serves 7 s later"
    assert request.ttft_s == pytest.approx(11.0 + 0.5 - 3.2)


def test_cost_per_million_tokens_is_replica_time_over_tokens():
    profile = flat_profile(decode_s=0.1, prefill_s=0.5)
    requests = [SimRequest(float(i), 10, 5) for i in range(10)]     # each: 0.5 + 4 x 0.1 = 0.9 s
    result = simulate(requests, profile, FleetConfig(hourly_usd=2.0, initial_replicas=2, min_replicas=2,
                                                     policy=FixedReplicas(2)), duration_s=20)
    assert result.output_tokens() == 50
    assert result.replica_seconds() == pytest.approx(2 * 20.0)
    assert result.usd_per_mtok == pytest.approx(2 * 20.0 * 2.0 / 3600 / 50 * 1e6)
    assert {r.replica for r in result.requests} == {0, 1}, "power of two choices uses both idle replicas"


def test_a_custom_policy_is_called_with_the_fleet_state():
    seen: list[FleetState] = []

    def policy(state: FleetState) -> int:
        seen.append(state)
        return 3 if state.now_s >= 2 else 1

    profile = flat_profile(startup_s=4.0)
    result = simulate([SimRequest(0.0, 8, 50)], profile,
                      FleetConfig(policy=policy, max_replicas=5, sample_interval_s=1.0), duration_s=10)
    assert result.scale_events == [(2.0, 3)]
    assert seen[0].running_replicas == 1 and seen[0].ongoing_per_replica == (1,)
    at = {s.now_s: s for s in seen}
    assert at[3.0].starting_replicas == 2 and at[3.0].running_replicas == 1 and at[3.0].target_replicas == 3
    assert at[6.0].running_replicas == 3 and at[6.0].starting_replicas == 0
    assert [h[0] for h in at[6.0].history] == [float(t) for t in range(0, 7)]


def test_a_simulated_day_finishes_every_request_and_follows_the_traffic():
    profile = ReplicaProfile(decode_points=[(1, 0.03), (4, 0.045), (8, 0.06)],
                             prefill_points=[(16, 0.02), (512, 0.4)], startup_s=30.0)
    traffic = daily_traffic(peak_rps=1.5, hour_s=120.0)    # a day of 24 two-minute "hours"
    config = FleetConfig(max_num_seqs=8, max_replicas=6, hourly_usd=1.0, sample_interval_s=10.0,
                         policy=RayServePolicy(upscale_delay_s=10, downscale_delay_s=60))
    result = simulate_day(traffic, profile, config, seed=3)
    assert len(result.requests) > 1000
    assert all(r.finish_s is not None and r.first_token_s is not None for r in result.requests)
    for r in result.requests:
        assert r.first_token_s >= r.arrival_s + 0.02 - 1e-9
        assert r.finish_s >= r.first_token_s + (r.output_tokens - 1) * 0.03 - 1e-9
    rows = result.hourly()
    assert len(rows) == 24
    night, spike = rows[3], rows[12]
    assert spike["arrivals_per_s"] > 5 * night["arrivals_per_s"]
    assert spike["replicas_mean"] > night["replicas_mean"]
    assert "TTFT p99" in result.hourly_table()


def test_day_requests_follow_the_rate_and_the_sizes():
    traffic = Traffic(points=[(0, 2.0), (12, 2.0), (12.5, 6.0), (24, 6.0)], hour_s=100.0, prompt_tokens=(5, 9),
                      output_tokens=(3, 3))
    requests = day_requests(traffic, seed=0)
    before = sum(r.arrival_s < 1200 for r in requests) / 1200
    after = sum(r.arrival_s >= 1250 for r in requests) / (2400 - 1250)
    assert before == pytest.approx(2.0, rel=0.1) and after == pytest.approx(6.0, rel=0.1)
    assert {r.output_tokens for r in requests} == {3} and {r.prompt_tokens for r in requests} == set(range(5, 10))
    assert day_requests(traffic, seed=0)[5].arrival_s == requests[5].arrival_s


def test_warm_replica_search_is_monotone_and_answers_the_first_that_meets_the_target():
    # one replica carries the quiet hours; the spike (30 s of 5 req/s) is shorter than the upscale delay plus
    # a 60 s start-up, so only the replicas already warm serve it: more of them, lower p99.
    profile = ReplicaProfile(decode_points=[(1, 0.03), (8, 0.06)], prefill_points=[(16, 0.02), (512, 0.4)],
                             startup_s=60.0)
    traffic = Traffic(points=[(0, 0.3), (11.9, 0.3), (12, 5.0), (12.5, 5.0), (12.6, 0.3), (24, 0.3)],
                      spike=(12.0, 12.5), hour_s=60.0)
    config = FleetConfig(max_num_seqs=8, max_replicas=6, sample_interval_s=5.0,
                         policy=RayServePolicy(upscale_delay_s=10, downscale_delay_s=60))
    answer, rows = warm_replicas_for_p99(1e-6, profile, config, traffic)    # never met: every n is tried
    assert answer is None and [r.warm_replicas for r in rows] == [1, 2, 3, 4, 5, 6]
    p99s = [r.spike_ttft_p99_s for r in rows]
    assert all(b <= a + 0.1 for a, b in zip(p99s, p99s[1:])), p99s   # 0.1 s: the router's random picks
    assert p99s[0] > 3 * p99s[-1], p99s
    target = (p99s[1] + p99s[2]) / 2
    answer, tried = warm_replicas_for_p99(target, profile, config, traffic)
    assert answer == tried[-1].warm_replicas and tried[-1].spike_ttft_p99_s <= target
    assert all(r.spike_ttft_p99_s > target for r in tried[:-1])
    costs = [r.usd_per_mtok for r in rows]
    assert costs == sorted(costs), "each warm replica costs more per token when the quiet hours need one"


def test_profile_round_trips_through_json(tmp_path):
    profile = ReplicaProfile(decode_points=[(4, 0.05), (1, 0.03)], prefill_points=[(64, 0.1)], startup_s=12.5,
                             request_overhead_s=0.01, busy_slowdown_points=[(1, 1.0), (2, 1.3)],
                             decode_busy_replicas=2, conditions={"threads": 1})
    path = profile.save(tmp_path / "p.json")
    loaded = ReplicaProfile.load(path)
    assert loaded.decode_points == [(1, 0.03), (4, 0.05)] and loaded.startup_s == 12.5
    assert loaded.busy_slowdown_points == [(1, 1.0), (2, 1.3)] and (loaded.decode_busy_replicas, loaded.prefill_busy_replicas) == (2, 1)
    assert loaded.decode_step_s(2) == pytest.approx(0.03 + (0.05 - 0.03) / 3)
    assert loaded.prefill_s(1000) == pytest.approx(0.1), "one point: a constant"
    assert json.loads(path.read_text())["conditions"] == {"threads": 1}
    faster = loaded.scaled(decode=0.5, prefill=2.0)
    assert faster.decode_step_s(2) == pytest.approx(loaded.decode_step_s(2) / 2)
    assert faster.prefill_s(64) == pytest.approx(0.2) and faster.busy_slowdown_points == loaded.busy_slowdown_points
    assert loaded.decode_step_s(1) == 0.03, "scaled is a copy"


@pytest.mark.parametrize("build, match", [
    (lambda: ReplicaProfile(decode_points=[], prefill_points=[(1, 0.1)]), "decode_points"),
    (lambda: ReplicaProfile(decode_points=[(0, 0.1)], prefill_points=[(1, 0.1)]), "batch size 0"),
    (lambda: ReplicaProfile(decode_points=[(1, -0.1)], prefill_points=[(1, 0.1)]), "seconds -0.1"),
    (lambda: ReplicaProfile(decode_points=[(1, 0.1), (1, 0.2)], prefill_points=[(1, 0.1)]), "repeat"),
    (lambda: ReplicaProfile(decode_points=[(1, 0.1)], prefill_points=[(1, 0.1)], startup_s=-1), "startup_s=-1"),
    (lambda: ReplicaProfile.from_dict({"decode_points": [[1, 0.1]], "prefill_points": [[1, 0.1]], "x": 1}), "unknown"),
    (lambda: ReplicaProfile(decode_points=[(1, 0.1)], prefill_points=[(1, 0.1)], busy_slowdown_points=[(2, 0)]),
     "step-time factor 0"),
    (lambda: ReplicaProfile(decode_points=[(1, 0.1)], prefill_points=[(1, 0.1)], prefill_busy_replicas=0),
     "prefill_busy_replicas=0"),
    (lambda: FleetConfig(replicas_share_cores="yes"), "replicas_share_cores='yes'"),
    (lambda: FleetConfig(record_gaps=1), "record_gaps=1 must be True or False"),
    (lambda: flat_profile().scaled(decode=0.0), "decode=0.0 must be a finite step-time factor > 0"),
    (lambda: flat_profile().scaled(prefill=float("inf")), "prefill=inf"),
    (lambda: FleetConfig(min_replicas=3, max_replicas=2), "min_replicas=3"),
    (lambda: FleetConfig(initial_replicas=9, max_replicas=8), "initial_replicas=9"),
    (lambda: FleetConfig(max_num_seqs=0), "max_num_seqs=0"),
    (lambda: FleetConfig(hourly_usd=float("nan")), "hourly_usd=nan"),
    (lambda: FleetConfig(policy="ray"), "policy='ray'"),
    (lambda: RayServePolicy(target_ongoing_requests=0), "target_ongoing_requests=0"),
    (lambda: SimRequest(0.0, 0, 4), "prompt_tokens=0"),
    (lambda: SimRequest(-1.0, 4, 4), "arrival_s=-1.0"),
    (lambda: Traffic(points=[(3, 1.0), (2, 1.0)]), "increase"),
    (lambda: Traffic(points=[(0, 1.0), (24, -1.0)]), "rate -1.0"),
    (lambda: daily_traffic(peak_rps=0), "peak_rps=0"),
    (lambda: simulate([], flat_profile(max_batch=4), FleetConfig(max_num_seqs=8)), "max_num_seqs=8 is above"),
    (lambda: simulate([SimRequest(0.0, 4, 4)], flat_profile(), FleetConfig(policy=lambda s: 1.5)), "returned 1.5"),
    (lambda: warm_replicas_for_p99(0, flat_profile(), FleetConfig(), daily_traffic()), "target_p99_s=0"),
])
def test_bad_inputs_are_refused_with_the_value(build, match):
    with pytest.raises(ValueError, match=match):
        build()


# ------------------------------------------------------------------ python -m minillm.bench.fleet
@pytest.fixture(scope="module")
def profile_file(tmp_path_factory):
    profile = ReplicaProfile(decode_points=[(1, 0.03), (4, 0.04), (8, 0.06)], prefill_points=[(16, 0.02), (256, 0.2)],
                             startup_s=120.0, conditions={"how": "written by hand for the tests"})
    return profile.save(tmp_path_factory.mktemp("fleet") / "profile.json")


def test_day_command_prints_every_hour_and_plots(profile_file, tmp_path, capsys):
    from minillm.bench import fleet

    plot = tmp_path / "day.png"
    assert fleet.main(["--day", "--profile", str(profile_file), "--peak-rps", "1.0", "--plot", str(plot),
                       "--json", str(tmp_path / "day.json")]) == 0
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line[:5].strip().isdigit()]
    assert [int(line.split()[0]) for line in table] == list(range(24))
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"
    hourly = json.loads((tmp_path / "day.json").read_text())["hourly"]
    assert hourly[12]["arrivals_per_s"] == pytest.approx(1.0, rel=0.25)     # the spike hour: half of it at the peak
    assert hourly[12]["replicas_mean"] >= hourly[3]["replicas_mean"]


def test_warm_command_answers_a_number_of_replicas(profile_file, capsys):
    from minillm.bench import fleet

    # the spike doubles the plateau's 1.5 req/s; Ray's policy at 8 ongoing per replica keeps few spare replicas,
    # and a new one takes 2 minutes: the spike needs warm ones
    assert fleet.main(["--warm-for-p99", "0.5", "--profile", str(profile_file), "--peak-rps", "3",
                       "--target-ongoing", "8", "--max-replicas", "5"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1].endswith("warm replicas keep p99 TTFT under 0.5 s through the spike")
    answer = int(lines[-1].split()[0])
    rows = [line.split() for line in lines[:-1] if line.split() and line.split()[0].isdigit()]
    p99 = {int(r[0]): float(r[2].rstrip("s")) for r in rows}
    assert answer >= 2 and p99[answer] <= 0.5 and all(p99[n] > 0.5 for n in range(1, answer))
    with pytest.raises(SystemExit, match="--warm-for-p99=-1.0"):
        fleet.main(["--warm-for-p99", "-1", "--profile", str(profile_file)])


def test_validation_ramp_and_tolerance():
    from minillm.bench.fleet_report import TOLERANCE_ABS_S, TOLERANCE_REL, within
    from minillm.bench.fleet_validate import ramp_requests

    plan = ramp_requests(600.0, 0.5, 2.0, seed=1)
    first = sum(t < 200 for t, _, _ in plan) / 200
    last = sum(t >= 400 for t, _, _ in plan) / 200
    assert first == pytest.approx(0.75, rel=0.2) and last == pytest.approx(1.75, rel=0.15)
    assert all(16 <= p <= 192 and 8 <= o <= 40 for _, p, o in plan)
    assert within(1.0 + TOLERANCE_REL - 0.01, 1.0) and not within(1.0 + TOLERANCE_REL + 0.01, 1.0)
    assert within(0.1 + TOLERANCE_ABS_S - 0.01, 0.1) and not within(0.1 + TOLERANCE_ABS_S + 0.01, 0.1)


def test_replay_predicts_a_saved_validation_report_again(tmp_path, capsys):
    # the two requests of test_replicas_sharing_cores_slow_each_others_steps_by_the_measured_factor: with shared
    # cores B's TTFT is 1.0 s (0.5 s with independent replicas); measured 0.5 and 1.2 s
    from minillm.bench import fleet

    profile = ReplicaProfile(decode_points=[(1, 0.1), (2, 0.1)], prefill_points=[(1, 0.5)],
                             busy_slowdown_points=[(1, 1.0), (2, 2.0)]).to_dict()
    report = {"requests": [{"start_s": 0.0, "prompt_tokens": 4, "output_tokens": 3, "ttft_s": 0.5},
                           {"start_s": 0.55, "prompt_tokens": 4, "output_tokens": 2, "ttft_s": 1.2}],
              "num_requests": 2, "duration_s": 1.0, "capacity_rps": 4.0, "rate_from": 1.0, "rate_to": 3.0,
              "num_replicas": 2, "max_num_seqs": 2, "max_ongoing_requests": 16, "profile": profile,
              "profile_before": profile, "profile_after": profile, "calibration_drift": 0.0,
              "tolerance": {"rel": 0.3, "abs_s": 0.25}, "wall_s": 1.0,
              "load_average": {"mean": 1.0, "max": 1.0, "cores": 2}}
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    assert fleet.main(["--replay", str(path)]) == 0
    out = capsys.readouterr().out

    def columns(name):   # measured | fitted during the ramp | before/after calibrations | independent; ...
        line = next(line for line in out.splitlines() if line.split()[:1] == [name])
        return [part.split() for part in line.split("|")]

    measured, ramp, calibrated, independent = columns("p50")
    assert measured[1] == "0.850s" and calibrated == ["0.750s", "-12%", "within"] and independent[0] == "0.500"
    assert ramp == ["(no", "gaps_s", "in", "the", "report)"], "no gaps: no during-ramp fit"
    measured, _, calibrated, _ = columns("p99")
    assert measured[1] == "1.193s" and calibrated[0] == "0.995s"
    assert "verdict: within (before/after calibrations)" in out
    assert "1: 1.00, 2: 2.00" in out


def test_gap_statistics_split_decode_gaps_from_prefill_stalls():
    from minillm.bench.fleet_report import gap_statistics

    stats = gap_statistics([0.1] * 8 + [0.5, 0.9])   # median 0.1: the two gaps over 0.3 hold a prefill step
    assert stats["decode_gap_s"] == pytest.approx(0.1) and stats["stall_excess_s"] == pytest.approx(0.6)
    assert (stats["num_stalls"], stats["num_gaps"]) == (2, 10)
    assert gap_statistics([0.1, 0.12])["stall_excess_s"] is None and gap_statistics([]) is None


def test_ramp_fit_rescales_decode_and_prefill_by_the_gap_ratios():
    # a replay whose gaps are 9 decode steps and 1 stall (a prefill + a decode step) per 10: measured with decode
    # steps of 0.2 s and prefills of 0.5 s, simulated from 0.1 s and 1.0 s: the fit finds x2.0 and x0.5
    from minillm.bench.fleet_report import fit_ramp_scales

    def gaps(decode_s, prefill_s):
        return ([decode_s] * 9 + [prefill_s + decode_s]) * 10

    calls = []

    def simulate_gaps(profile):
        calls.append(profile)
        return gaps(profile.decode_step_s(1), profile.prefill_s(1))

    fit = fit_ramp_scales(gaps(0.2, 0.5), flat_profile(decode_s=0.1, prefill_s=1.0), simulate_gaps)
    assert (fit["decode_scale"], fit["prefill_scale"]) == pytest.approx((2.0, 0.5))
    assert fit["prefill_fitted"] and fit["iterations"] == 2 and len(calls) == 2, "one rescale, then a check"
    no_stalls = fit_ramp_scales([0.2] * 20, flat_profile(), lambda p: [p.decode_step_s(1)] * 20)
    assert no_stalls["decode_scale"] == pytest.approx(2.0) and no_stalls["prefill_scale"] == 1.0
    assert not no_stalls["prefill_fitted"]
    with pytest.raises(ValueError, match="no inter-token gaps"):
        fit_ramp_scales([], flat_profile(), simulate_gaps)


def synthetic_validation(decode_scale: float, prefill_scale: float, seed: int = 0) -> dict:
    """A validation report whose "measured" fleet is the simulator itself with the calibrated profile's decode
    steps x decode_scale and prefill x prefill_scale: gaps and TTFTs of one router seed."""
    from minillm.bench.fleet_validate import ramp_requests

    calibrated = ReplicaProfile(decode_points=[(1, 0.08), (2, 0.1), (4, 0.13), (8, 0.17)],
                                prefill_points=[(16, 0.25), (96, 0.55), (192, 0.85)],
                                busy_slowdown_points=[(1, 1.0), (2, 1.3)], decode_busy_replicas=2)
    plan = ramp_requests(150.0, 0.35, 1.2, seed=seed)
    requests = [SimRequest(t, p, o) for t, p, o in plan]
    real = simulate(requests, calibrated.scaled(decode_scale, prefill_scale),
                    FleetConfig(max_num_seqs=8, min_replicas=2, max_replicas=2, policy=FixedReplicas(2), seed=100 + seed,
                                replicas_share_cores=True, record_gaps=True))
    rows = [{"start_s": r.arrival_s, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
             "ttft_s": r.ttft_s, "gaps_s": r.gaps_s, "replica": str(r.replica)}
            for r in sorted(real.requests, key=lambda r: r.arrival_s)]
    profile = calibrated.to_dict()
    return {"requests": rows, "num_requests": len(rows), "duration_s": 150.0, "capacity_rps": 2.0,
            "rate_from": 0.35, "rate_to": 1.2, "num_replicas": 2, "max_num_seqs": 8, "max_ongoing_requests": 16,
            "profile": profile, "profile_before": profile, "profile_after": profile, "calibration_drift": 0.0,
            "tolerance": {"rel": 0.3, "abs_s": 0.25}, "wall_s": 1.0, "load_average": {"mean": 1.0, "max": 1.0, "cores": 2}}


@pytest.mark.parametrize("decode_scale, prefill_scale", [(1.3, 0.8), (0.85, 1.25)])
def test_ramp_fit_recovers_known_step_factors_without_reading_ttft(decode_scale, prefill_scale):
    from minillm.bench.fleet_report import format_validation, predict_report, verdict

    report = predict_report(synthetic_validation(decode_scale, prefill_scale))
    fit = report["ramp_fit"]
    assert fit["decode_scale"] == pytest.approx(decode_scale, rel=0.04)
    assert fit["prefill_scale"] == pytest.approx(prefill_scale, rel=0.1)   # the replay routes differently: ~±8%
    assert fit["prefill_fitted"] and fit["measured"]["num_stalls"] > 20
    for q in (50, 99):
        assert report[f"p{q}"]["within_ramp_fit"], format_validation(report)
    assert verdict(report) and "verdict: within (fitted during the ramp)" in format_validation(report)
    assert abs(report["p50"]["rel_error_ramp_fit"]) < abs(report["p50"]["rel_error"]), "the fit moved p50 closer"
    # TTFT is what the validation checks: the fit never reads it
    scrambled = synthetic_validation(decode_scale, prefill_scale)
    for row in scrambled["requests"]:
        row["ttft_s"] *= 10.0
    again = predict_report(scrambled)["ramp_fit"]
    assert (again["decode_scale"], again["prefill_scale"]) == (fit["decode_scale"], fit["prefill_scale"])


@pytest.mark.slow
def test_simulator_predicts_a_real_fleet_within_the_stated_tolerance():
    """python -m minillm.bench.fleet --validate --quick: 2 Ray Serve replicas on loopback, a 150 s ramp."""
    pytest.importorskip("ray")
    from minillm.bench.fleet_report import format_validation, verdict
    from minillm.bench.fleet_validate import validate

    report = validate(quick=True, progress=False)
    print(format_validation(report))
    assert "ramp_fit" in report and verdict(report), format_validation(report)


# ------------------------------------------------------------------ measured profiles (a tiny random model)
@pytest.fixture(scope="module")
def tiny_llm():
    from minillm import LLM

    return LLM("random:tiny-llama", max_num_seqs=4)


def test_measure_profile_times_the_engine_steps(tiny_llm):
    from minillm.fleet.profile import measure_profile

    profile = measure_profile(llm=tiny_llm, batch_sizes=(4, 1), prompt_tokens=(8, 40), decode_prompt_tokens=8,
                              decode_steps=4, repeats=2, startup=False, progress=False)
    assert [b for b, _ in profile.decode_points] == [1, 4] and [n for n, _ in profile.prefill_points] == [8, 40]
    assert all(0 < s < 1.0 for _, s in profile.decode_points + profile.prefill_points)
    assert profile.conditions["threads"] == 1 and profile.conditions["decode_steps"] == 4
    result = simulate([SimRequest(0.0, 20, 3)], profile, FleetConfig(max_num_seqs=4, policy=FixedReplicas(1)))
    assert result.requests[0].ttft_s == pytest.approx(profile.prefill_s(20))
    with pytest.raises(ValueError, match="threads=0"):
        measure_profile(llm=tiny_llm, threads=0)
    with pytest.raises(ValueError, match="batch_sizes=\\(\\)"):
        measure_profile(llm=tiny_llm, batch_sizes=())
    with pytest.raises(ValueError, match="levers or llm"):
        measure_profile({"max_num_seqs": 2}, llm=tiny_llm)


def test_calibrate_on_server_times_a_server_through_http(tiny_llm):
    from minillm.fleet.profile import calibrate_on_server, prompt_ids, send_requests
    from minillm.serve import serve_in_thread
    from minillm.serve.client import run_in_thread

    llm = tiny_llm.with_levers(max_num_seqs=4)
    with serve_in_thread(llm) as server:
        profile = calibrate_on_server(server.base_url, num_replicas=1, batch_sizes=(1, 2), prompt_tokens=(8, 24),
                                      decode_tokens=6, decode_prompt_tokens=8, repeats=1, startup_s=3.0,
                                      vocab_size=512, progress=False)
        timings = run_in_thread(send_requests, server.base_url, server.model_name,
                            [(0.0, prompt_ids(8, vocab_size=512), 5), (0.2, prompt_ids(9, vocab_size=512), 3)])
    assert [b for b, _ in profile.decode_points] == [1, 2] and profile.startup_s == 3.0
    assert all(0 < s < 5.0 for _, s in profile.decode_points + profile.prefill_points)
    assert [t.error for t in timings] == ["", ""]
    assert [t.chunks for t in timings] == [5, 3] and [len(t.gaps_s) for t in timings] == [4, 2]
    assert timings[1].start_s >= 0.2 and all(t.ttft_s > 0 for t in timings)
    with pytest.raises(ValueError, match="num_replicas=0"):
        calibrate_on_server("http://127.0.0.1:1", num_replicas=0)

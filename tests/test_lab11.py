"""Lab 11 (scale out): the master's solutions pass every check; the checks name each usual mistake (every N-th row
taken for a block, the wrong dimension split, the outputs out of rank order, the whole product on every rank, the fused
gate_up cut as one matrix, gate and up swapped; a sharding part that cuts the wrong dimension or the wrong rank's block
or forgets the all-reduce; a timing harness that keeps the warm-up, takes the mean or the min, inverts the speed-up or
ignores the injected clock; a row-parallel shard kernel with the wrong stride, the last block of K skipped or its output
transposed; vLLM flags in minillm's spelling or left unsaid; a policy without windows, on running replicas, without its
clamp or with floor, the fastest fleet instead of the cheapest, the target ignored); every graded test cell fails on two
or more plausible mistakes (MISTAKES, run by lab_utils.assert_check_fails); the notebook's experiments (the split on a
model's own MLP, the tensor-parallel runs with the learner's sharding part in the worker processes and simulated in one
process, the learner's kernel in every rank, the simulated day, the fleet sweep) give values that follow from the shapes
and the rules. Everything runs on tiny random models and the example profile."""

from __future__ import annotations

from kernel_utils import DEVICE as KERNEL_DEVICE  # noqa: F401 - first: picks the interpreter before triton is imported

import functools
import re

import nbformat
import pytest
import torch
import torch.nn.functional as F

from lab_utils import (assert_check_fails, assert_master_structure, import_file, notebook_functions, solution_source,
                       student_stubs)

from grading.build import REPO_ROOT, SOURCE_DIR
from minillm.lab import lab11
from minillm.lab.common import CheckFailed, figure_subtitle

MASTER = SOURCE_DIR / "11_scale_out" / "11_scale_out.ipynb"
EXERCISES = {"column_parallel", "row_parallel", "parallel_mlp", "tp_sharding", "measure_tp_step_time", "row_shard_matmul_kernel",
             "answer_tp8_step_ms", "autoscaler_policy", "measure_choose_fleet", "vllm_serve_args"}
GRADED = {"test_column_parallel": 2, "test_row_parallel": 2, "test_parallel_mlp": 2, "test_tp_sharding": 2,
          "test_measure_tp_step_time": 2, "test_row_shard_matmul_kernel": 2, "test_answer_tp8_step_ms": 1, "test_autoscaler_policy": 2,
          "test_measure_choose_fleet": 2, "test_vllm_serve_args": 2}
DEVICE = "cpu: test device"
TINY = "random:tiny-llama"   # 2 layers, hidden 64, intermediate 128, 4 query / 2 KV heads: N = 1, 2 (4 for the MLP)

MODULE_HEADER = ("import math\nimport os\n\nimport torch\nimport torch.nn.functional as F\nimport triton\n"
                 "import triton.language as tl\n\nfrom minillm.lab import lab11\n")
LAUNCHER = "def row_shard_matmul("   # the locked cell that launches the kernel, kept with the solution cells
# One line of the solution kernel changed (the usual slips), as {name: (old, new, occurrences)}.
KERNEL_SLIPS = {
    "w_transposed": ("w_ptr + cols[:, None] * K + ks[None, :]", "w_ptr + ks[None, :] * N + cols[:, None]", 1),
    "last_k_block_skipped": ("for k0 in range(0, K, BLOCK_K):", "for k0 in range(0, K - BLOCK_K, BLOCK_K):", 1),
    "y_transposed": ("tl.store(y_ptr + rows[:, None] * N + cols[None, :]", "tl.store(y_ptr + cols[None, :] * M + rows[:, None]", 1),
    "store_mask_off_by_one": ("acc, mask=(rows[:, None] < M) & (cols[None, :] < N))",
                              "acc, mask=(rows[:, None] < M - 1) & (cols[None, :] < N))", 1),
}


@pytest.fixture(scope="module")
def solution_module(tmp_path_factory):
    """The master's solution cells and the kernel's launcher, imported from a file (Triton reads a kernel's
    source from its file)."""
    path = tmp_path_factory.mktemp("lab11_solution") / "lab11_solution.py"
    path.write_text(solution_source(MASTER, MODULE_HEADER, LAUNCHER))
    return import_file(path, "lab11_solution")


@pytest.fixture(scope="module")
def solution(solution_module) -> dict:
    return {key: value for key, value in vars(solution_module).items() if not key.startswith("__")}


@pytest.fixture(scope="module")
def wrong_kernels(tmp_path_factory) -> dict:
    """{slip: row_shard_matmul launching the solution kernel with that one slip}, each imported from its own file."""
    source, launchers = solution_source(MASTER, MODULE_HEADER, LAUNCHER), {}
    folder = tmp_path_factory.mktemp("lab11_wrong")
    for name, (old, new, count) in KERNEL_SLIPS.items():
        assert source.count(old) == count, f"the solution kernel changed: {old!r} is not there {count} time(s)"
        path = folder / f"lab11_{name}.py"
        path.write_text(source.replace(old, new))
        launchers[name] = import_file(path, f"lab11_{name}").row_shard_matmul
    return launchers


@pytest.fixture(scope="module")
def tiny_llm():
    from minillm import LLM

    return LLM(TINY)


@pytest.fixture(scope="module")
def fleet_namespace() -> dict:
    """The names the notebook's fleet cells define, in quick mode, on the example profile."""
    from minillm.fleet.policies import RayServePolicy
    from minillm.fleet.simulate import FleetConfig, simulate, simulate_day
    from minillm.fleet.traffic import daily_traffic, day_requests

    traffic = daily_traffic(peak_rps=4.0, spike_rps=8.0, ramp_min=1.0, prompt_tokens=(16, 96), output_tokens=(16, 64))
    window = (11.9, 12.6)
    return {"FleetConfig": FleetConfig, "RayServePolicy": RayServePolicy, "simulate": simulate,
            "simulate_day": simulate_day, "TRAFFIC": traffic, "HOURLY_USD": 0.10, "DAY": (11.0, 13.0),
            "profile": lab11.example_profile(5.0), "WINDOW": window, "WARM_OPTIONS": (2, 4, 6),
            "BATCH_OPTIONS": (4, 16), "TARGET_P99_S": 1.0,
            "window_requests": day_requests(traffic, seed=0, start_h=window[0], end_h=window[1])}


@pytest.fixture(scope="module")
def experiments(fleet_namespace) -> dict:
    from minillm import LLM, SamplingParams

    return notebook_functions(MASTER, "model_mlp", "tp_runs", "fleet_window", "day", LLM=LLM,
                              SamplingParams=SamplingParams, lab11=lab11, **fleet_namespace)


@pytest.fixture(scope="module")
def kernel_tp(solution, tp_result) -> dict:
    """tensor_parallel_size 2 on the tiny Llama, every rank's row-parallel layers through the solution's kernel
    (sent to the worker by value), 2 greedy tokens on tp_runs' prompts."""
    from minillm import LLM, SamplingParams

    shard_matmul = solution["row_shard_matmul"]

    class KernelSharding:   # the notebook's, around the solution's launcher
        def __init__(self, cut):
            self.cut = cut

        def column(self, weight, rank, world_size):
            return self.cut.column(weight, rank, world_size)

        def row(self, weight, rank, world_size):
            return self.cut.row(weight, rank, world_size)

        def row_matmul(self, x, weight, all_reduce):
            return all_reduce(shard_matmul(x, weight))

    run = notebook_functions(MASTER, "kernel_tp_run", LLM=LLM, SamplingParams=SamplingParams, lab11=lab11,
                             KernelSharding=KernelSharding, MySharding=solution["MySharding"])["kernel_tp_run"]
    return run(TINY, 2, 2, device="cpu")


@pytest.fixture(scope="module")
def tp_result(experiments, solution) -> dict:
    """tensor_parallel_size 1 and 2 on the tiny Llama, 4 greedy tokens (the N = 2 run starts one gloo worker that
    cuts its shard with the solution's MySharding, sent by value), the steps timed by the solution's harness."""
    return experiments["tp_runs"](TINY, (1, 2), 4, sharding=solution["MySharding"](), measure=solution["tp_step_time"],
                                  warmup=1, repeats=3)


def test_master_has_every_graded_piece_with_hidden_tests():
    assert_master_structure(MASTER, EXERCISES, GRADED, 19)


def test_student_copy_has_stubs_and_no_solution():
    stubs = student_stubs(REPO_ROOT / "labs" / "11_scale_out.ipynb", EXERCISES)
    assert "silu" not in stubs["parallel_mlp"] and "want_up" not in stubs["autoscaler_policy"]
    assert "8.5" not in stubs["answer_tp8_step_ms"] and "3.35e12" not in stubs["answer_tp8_step_ms"]
    assert "all_reduce(" not in stubs["tp_sharding"] and "statistics.median(" not in stubs["measure_tp_step_time"]


# --------------------------------------------------------------------- the solutions pass
def test_solution_passes_every_check(solution):
    for seed in (0, 1, 2, 3):
        lab11.check_column_parallel(solution["column_parallel"], seed=seed)
        lab11.check_row_parallel(solution["row_parallel"], seed=seed)
        lab11.check_parallel_mlp(solution["parallel_mlp"], seed=seed)
    lab11.check_autoscaler(solution["autoscaler_policy"])
    lab11.check_sharding(solution["MySharding"](), seed=3)
    lab11.check_tp_step_time(solution["tp_step_time"])
    lab11.check_vllm_args(solution["vllm_serve_args"])
    lab11.check_vllm_args(lab11.reference_vllm_args)
    lab11.check_answer_tp8_step_ms(solution["answer_tp8_step_ms"])
    assert lab11.answer_tp8_ms() == pytest.approx(70.6e9 * 2 / 3.35e12 / 8 * 1e3 + 3.2)


def test_the_splits_add_up_to_the_unsharded_layer(solution):
    x, w = lab11.random_tokens(7, 12, seed=4), lab11.random_weight(9, 12, seed=4)
    assert torch.allclose(torch.cat(solution["column_parallel"](x, w, 3), dim=-1), x @ w.T, atol=1e-5)
    assert torch.allclose(sum(solution["row_parallel"](x, w, 4)), x @ w.T, atol=1e-5)
    w13, w2 = lab11.random_mlp(10, 12, seed=4)
    parts = solution["parallel_mlp"](lab11.random_tokens(3, 10), w13, w2, 6)
    assert len(parts) == 6 and torch.allclose(sum(parts), lab11.reference_mlp(lab11.random_tokens(3, 10), w13, w2),
                                              atol=1e-5)


def test_the_policy_follows_the_reference_on_random_states(solution):
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        running = int(torch.randint(0, 6, (1,), generator=gen))
        starting = int(torch.randint(0, 3, (1,), generator=gen))
        loads = torch.randint(0, 25, (40,), generator=gen).tolist()
        state = lab11.fleet_state(60.0, loads, running=max(running, 1), starting=starting,
                                  min_replicas=int(torch.randint(0, 2, (1,), generator=gen)))
        kwargs = {"target_ongoing": float(torch.randint(1, 5, (1,), generator=gen)),
                  "upscale_window_s": float(torch.randint(1, 10, (1,), generator=gen)),
                  "downscale_window_s": float(torch.randint(10, 40, (1,), generator=gen))}
        assert solution["autoscaler_policy"](state, **kwargs) == lab11.reference_policy(state, **kwargs)


# --------------------------------------------------------------------- the experiments
def test_model_mlp_on_a_tiny_model_and_a_wrong_split(tiny_llm, solution, experiments, capsys):
    result = experiments["model_mlp"](tiny_llm, solution["parallel_mlp"], [2, 4])
    assert result["hidden"] == 64 and result["intermediate"] == 128 and max(result["diffs"].values()) < 1e-5
    assert result["shard_mib"][4] == pytest.approx(result["shard_mib"][2] / 2)
    lab11.check_model_mlp(result)
    lab11.print_model_mlp(result)
    assert "N = 4: ✓" in capsys.readouterr().out

    def whole_on_every_rank(x, w_gate_up, w_down, n):
        return [lab11.reference_mlp(x, w_gate_up, w_down)] * n

    wrong = experiments["model_mlp"](tiny_llm, whole_on_every_rank, [2])
    with pytest.raises(CheckFailed, match="with N = 2: the sum of the partials differs"):
        lab11.check_model_mlp(wrong)
    with pytest.raises(CheckFailed, match="run the cell above"):
        lab11.check_model_mlp(None)


def test_tp_runs_equal_tokens_and_count_the_all_reduces(tp_result, capsys):
    assert tp_result["tokens"][2] == tp_result["tokens"][1] and len(tp_result["tokens"][1][0]) == 5
    one, two = tp_result["rows"]
    assert one["num_allreduces"] == 0 and one["allreduce_bytes"] == 0 and one["allreduce_s"] == 0
    # a decode step of 3 sequences: 2 all-reduces per layer (o_proj, down_proj) + the embedding's, of [3, 64] fp32
    assert two["num_allreduces"] == 2 * 2 + 1
    assert two["allreduce_bytes"] == 5 * 3 * 64 * 4
    # the all-reduces' and the head's all-gather's time: differences of two runs' totals, so timing noise on a busy
    # machine can outweigh them (even below zero); only their bound is checked
    assert abs(two["allreduce_s"]) < two["step_s"] and abs(two["allgather_s"]) < two["step_s"]
    lab11.check_tp_runs(tp_result)
    assert tp_result["sharding"] == "MySharding" and tp_result["simulated"] == {2: tp_result["tokens"][1]}
    lab11.check_tp_tokens(tp_result)
    with pytest.raises(CheckFailed, match="ran without your sharding part"):
        lab11.check_tp_tokens({**tp_result, "simulated": {}})
    with pytest.raises(CheckFailed, match="your sharding with 2 ranks .simulated in this process.: prompt 0 parts"):
        lab11.check_tp_tokens({**tp_result, "simulated": {2: [[-1] + t[1:] for t in tp_result["tokens"][2]]}})
    lab11.print_tp_runs(tp_result, DEVICE)
    assert "tensor_parallel_size=2: 3 of 3 prompts give N = 1's tokens ✓" in capsys.readouterr().out
    fig = lab11.tp_figure(tp_result["rows"], DEVICE)
    assert [list(t.x) for t in fig.data] == [["1", "2"]] * 2 and DEVICE in figure_subtitle(fig)
    broken = {**tp_result, "tokens": {1: tp_result["tokens"][1], 2: [[0] + t[1:] for t in tp_result["tokens"][2]]}}
    with pytest.raises(CheckFailed, match="tensor_parallel_size=2: prompt 0 parts from N = 1's greedy tokens at output token 0"):
        lab11.check_tp_runs(broken)


def test_the_kernel_matches_the_reference_and_runs_in_every_rank(solution, kernel_tp, tp_result, capsys):
    lab11.check_row_shard_matmul(solution["row_shard_matmul"], seed=3)
    x, w = torch.randn(2, 9), torch.randn(5, 9)
    assert torch.allclose(solution["row_shard_matmul"](x, w), x @ w.T, atol=1e-5)
    assert kernel_tp["tokens"] == [t[:2] for t in tp_result["tokens"][1]]
    lab11.kernel_tp_check(kernel_tp, tp_result)
    lab11.print_kernel_tp(kernel_tp, tp_result)
    assert "3 of 3 prompts give N = 1's tokens ✓" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="prompt 0 parts from N = 1's greedy tokens at output token 1"):
        lab11.kernel_tp_check({**kernel_tp, "tokens": [[t[0], -1] for t in kernel_tp["tokens"]]}, tp_result)
    if not torch.cuda.is_available():
        assert lab11.time_row_shard_matmul(solution["row_shard_matmul"]) == {"device": "cpu"}
        lab11.print_row_shard_timing({"device": "cpu"})
        assert "No GPU here" in capsys.readouterr().out


@pytest.mark.parametrize("slip, names_it", [("w_transposed", "W was read as [K, N]"),
                                            ("last_k_block_skipped", "the last block of K"),
                                            ("y_transposed", "y was stored column by column"),
                                            ("store_mask_off_by_one", "was never stored")])
def test_the_kernel_check_names_each_slip(wrong_kernels, slip, names_it):
    with pytest.raises(CheckFailed, match=re.escape(names_it)):
        lab11.check_row_shard_matmul(wrong_kernels[slip])


def test_student_kernel_is_a_stub_that_keeps_its_setup():
    student = nbformat.read(REPO_ROOT / "labs" / "11_scale_out.ipynb", as_version=4)
    kernel = next(c.source for c in student.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "row_shard_matmul_kernel")
    assert "raise NotImplementedError()" in kernel and "tl.store" not in kernel and "tl.dot" not in kernel
    assert "rows = tl.program_id(0) * BLOCK_M" in kernel and "acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)" in kernel


def test_reference_costs_and_the_timing_of_the_measured_rows(tp_result, capsys):
    costs = lab11.reference_allreduce_costs(tp_result["rows"])
    assert costs[0]["speedup"] == 1.0 and costs[0]["us_per_allreduce"] == 0.0
    assert 0 < costs[1]["allreduce_share"] < 1
    lab11.print_allreduce_costs(costs, DEVICE)
    assert DEVICE in capsys.readouterr().out
    timing = tp_result["timing"]
    assert set(timing["times"]) == {1, 2} and all(0 < t["min"] <= t["median"] <= t["max"] for t in timing["times"].values())
    assert timing["speedup"] == pytest.approx(timing["times"][1]["median"] / timing["times"][2]["median"])
    lab11.print_tp_timing(timing, "cpu")
    out = capsys.readouterr().out
    assert "tensor_parallel_size=2:" in out and lab11.REFERENCE_HARDWARE in out
    fig = lab11.tp_timing_figure(timing, DEVICE)
    assert list(fig.data[0].x) == ["1", "2"] and DEVICE in figure_subtitle(fig)


def test_simulated_ranks_give_the_engines_tokens_and_catch_a_wrong_cut(tiny_llm, solution):
    import threading

    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9, 10]}, {"prompt_token_ids": [11, 12, 13]}]
    want = lab11.simulated_tp_tokens(tiny_llm, lab11_megatron(), 1, prompts, 3)
    assert tiny_llm.generate(prompts, __import__("minillm").SamplingParams(max_tokens=3, temperature=0,
                                                                            ignore_eos=True))[0].outputs[0].token_ids == want[0]
    assert lab11.simulated_tp_tokens(tiny_llm, solution["MySharding"](), 2, prompts, 3) == want

    class NoReduce(solution["MySharding"]):
        def row_matmul(self, x, weight, all_reduce):
            return x @ weight.T

    class NextRank(solution["MySharding"]):
        def column(self, weight, rank, world_size):
            return super().column(weight, (rank + 1) % world_size, world_size)

    with pytest.raises(ValueError, match="never called all_reduce"):
        lab11.simulated_tp_tokens(tiny_llm, NoReduce(), 2, prompts, 3)
    assert lab11.simulated_tp_tokens(tiny_llm, NextRank(), 2, prompts, 3) != want
    assert type(tiny_llm.engine.model.layers[0].o_proj).__name__ == "Linear", "the layers are put back"

    class Local(solution["MySharding"]):   # holds something that cannot be pickled: it stays in this process
        lock = threading.Lock()

    assert lab11.sendable(solution["MySharding"]()) and not lab11.sendable(Local())


def test_the_engine_refuses_a_sharding_part_it_cannot_use():
    from minillm import LLM
    from minillm.seams import PartError

    with pytest.raises(ValueError, match="sharding= needs tensor_parallel_size > 1"):
        LLM(TINY, sharding=lab11_megatron())
    with pytest.raises(PartError, match="missing row_matmul"):
        LLM(TINY, tensor_parallel_size=2, device="cpu", sharding=type("Half", (), {"column": lambda *a: None,
                                                                                     "row": lambda *a: None})())
    with pytest.raises(ValueError, match="a sharding part cuts float weights"):
        LLM(TINY, tensor_parallel_size=2, device="cpu", weight_dtype="int8", sharding=lab11_megatron())


def lab11_megatron():
    from minillm.models.shard import MegatronSharding

    return MegatronSharding()


def test_shard_model_with_a_part_equals_the_engines_cut_and_names_a_wrong_shape():
    from minillm.layers.parallel import TPGroup
    from minillm.models.loader import load_model, resolve_model_path
    from minillm.models.shard import shard_model

    model = load_model(resolve_model_path(TINY), torch.float32, torch.device("cpu"), 64)
    for rank in (0, 1):
        group = TPGroup(rank, 2, None, torch.device("cpu"))
        own, mine = shard_model(model, group), shard_model(model, group, sharding=lab11_megatron())
        for (name, a), (_, b) in zip(own.state_dict().items(), mine.state_dict().items()):
            assert torch.equal(a, b), name

    class WrongDim:
        column = staticmethod(lambda w, r, n: w[:, : w.shape[1] // n])
        row = staticmethod(lab11_megatron().row)
        row_matmul = staticmethod(lab11_megatron().row_matmul)

    with pytest.raises(ValueError, match=r"sharding.column\(qkv_proj.weight\[q\] .*that is the shape row\(\) should give"):
        shard_model(model, TPGroup(0, 2, None, torch.device("cpu")), sharding=WrongDim())


def test_when_splitting_pays_model(capsys):
    rows = lab11.pays_rows()
    by_n = {r["n"]: r for r in rows}
    assert by_n[8]["step_ms"] == pytest.approx(lab11.answer_tp8_ms())
    assert by_n[1]["allreduce_ms"] == 0 and by_n[16]["allreduce_ms"] == pytest.approx(3.2)
    assert by_n[32]["step_ms"] < by_n[16]["step_ms"] < by_n[8]["step_ms"]   # faster, with falling efficiency
    lab11.print_pays(rows)
    assert "8.47" in capsys.readouterr().out


def test_the_simulated_day_with_the_solution_policy(solution, experiments, fleet_namespace, capsys):
    day = experiments["day"]
    spike_s = tuple((h - 11.0) * 3600 for h in fleet_namespace["TRAFFIC"].spike)
    fast = day(solution["autoscaler_policy"], 5.0)
    slow = day(solution["autoscaler_policy"], 60.0)
    ray = day(fleet_namespace["RayServePolicy"](target_ongoing_requests=2), 5.0)
    fast_d, slow_d = lab11.day_summary(fast, spike_s), lab11.day_summary(slow, spike_s)
    assert fast_d["requests"] == slow_d["requests"] > 1000
    assert slow_d["queue_max"] > fast_d["queue_max"] and slow_d["spike_ttft_p99_s"] > fast_d["spike_ttft_p99_s"]
    assert fast_d["replicas_max"] > 1, "the policy scaled up for the spike"
    lab11.print_day({"yours": fast, "ray": ray}, spike_s, 0.10)
    assert "0.10 $/h" in capsys.readouterr().out
    fig = lab11.day_figure({"5 s": fast, "60 s": slow}, 11.0, "day")
    assert len(fig.data) == 6 and max(fig.data[1].x) <= 13.0


def test_choose_fleet_on_the_simulated_window(solution, experiments, fleet_namespace, capsys):
    ns = fleet_namespace
    choice = solution["choose_fleet"](experiments["fleet_window"], ns["TARGET_P99_S"], ns["WARM_OPTIONS"],
                                      ns["BATCH_OPTIONS"])
    assert choice is not None and choice["spike_ttft_p99_s"] <= ns["TARGET_P99_S"]
    assert len(choice["rows"]) == 6 and choice == {**lab11.reference_choice(choice["rows"], 1.0), "rows": choice["rows"]}
    assert any(r["spike_ttft_p99_s"] > 1.0 for r in choice["rows"]), "the target rules some settings out"
    lab11.check_choose_fleet(solution["choose_fleet"], experiments["fleet_window"], 1.0, ns["WARM_OPTIONS"],
                             ns["BATCH_OPTIONS"], choice["rows"])
    lab11.print_choice(choice, 1.0, 0.10)
    assert "<- your choice" in capsys.readouterr().out
    again = experiments["fleet_window"].__wrapped__(choice["warm_replicas"], choice["max_num_seqs"])
    assert again == experiments["fleet_window"](choice["warm_replicas"], choice["max_num_seqs"])   # deterministic


def test_choose_fleet_none_is_right_only_where_no_setting_meets_the_target(solution, capsys):
    """A slow machine's profile can miss the target everywhere: then None passes (the lab still grades), and a None
    where some setting meets it fails with that setting named."""
    slow = lab11._stub_run({(w, b): (5.0 + w + b, 0.1 * w) for w in (1, 2) for b in (4, 8)})
    assert solution["choose_fleet"](slow, 1.0, (1, 2), (4, 8)) is None
    lab11.check_choose_fleet(solution["choose_fleet"], slow, 1.0, (1, 2), (4, 8), None)
    assert "None is right" in capsys.readouterr().out
    lab11.print_choice(None, 1.0, 0.10)
    assert "on this machine" in capsys.readouterr().out
    fast = lab11._stub_run({(w, b): (0.5 * w, 0.1 * b) for w in (1, 2) for b in (4, 8)})
    with pytest.raises(lab11.CheckFailed, match=r"but \(1 warm, batch 4\) keeps the spike p99 at 0.50 s"):
        lab11.check_choose_fleet(solution["choose_fleet"], fast, 1.0, (1, 2), (4, 8), None)


def test_a_slower_replica_gets_lighter_traffic_and_a_reachable_target():
    """Full mode measures the learner's replica: where it is slower than the example profile, the day's arrivals
    are thinned by as much and the spike's target is 3x its own prefill of the longest prompt (at least 1 s)."""
    from minillm.fleet.replica_profile import ReplicaProfile

    example = lab11.example_profile()
    assert lab11.slower_than_example(example) == 1.0 and lab11.spike_target_s(example) == 1.0   # quick mode: as before
    prefill_x2 = ReplicaProfile(decode_points=list(example.decode_points),
                                prefill_points=[(n, 2 * s) for n, s in example.prefill_points], startup_s=5.0)
    assert lab11.slower_than_example(prefill_x2) == pytest.approx(2.0)
    assert lab11.spike_target_s(prefill_x2) == pytest.approx(round(3 * 2 * example.prefill_s(96), 1))
    decode_x3 = ReplicaProfile(decode_points=[(b, 3 * s) for b, s in example.decode_points],
                               prefill_points=list(example.prefill_points), startup_s=5.0)
    assert lab11.slower_than_example(decode_x3) == pytest.approx(3.0) and lab11.spike_target_s(decode_x3) == 1.0
    faster = ReplicaProfile(decode_points=[(b, s / 10) for b, s in example.decode_points],
                            prefill_points=[(n, s / 10) for n, s in example.prefill_points], startup_s=5.0)
    assert lab11.slower_than_example(faster) == 1.0    # never heavier than the example's day


def test_example_profile_is_valid_and_printed(capsys):
    profile = lab11.example_profile(60.0)
    assert profile.startup_s == 60.0 and profile.max_measured_batch == 32
    assert profile.decode_step_s(8) == pytest.approx(0.0858)
    lab11.print_profile(profile, DEVICE)
    assert "batch 8: 86 ms" in capsys.readouterr().out


# --------------------------------------------------------------------- every graded cell fails on plausible mistakes
_COLUMN = '''def column_parallel(x, weight, num_shards):
    rows = weight.shape[0] // num_shards
    return [x @ weight[r * rows:(r + 1) * rows].T for r in range(num_shards)]
'''
_ROW = '''def row_parallel(x, weight, num_shards):
    cols = weight.shape[1] // num_shards
    return [x[:, r * cols:(r + 1) * cols] @ weight[:, r * cols:(r + 1) * cols].T for r in range(num_shards)]
'''
_MLP = '''def parallel_mlp(x, w_gate_up, w_down, num_shards):
    gate_w, up_w = w_gate_up.chunk(2, dim=0)
    cols = w_down.shape[1] // num_shards
    out = []
    for r in range(num_shards):
        block = slice(r * cols, (r + 1) * cols)
        h = F.silu(x @ gate_w[block].T) * (x @ up_w[block].T)
        out.append(h @ w_down[:, block].T)
    return out
'''
_SHARDING = '''class MySharding:
    def column(self, weight, rank, world_size):
        rows = weight.shape[0] // world_size
        return weight[rank * rows:(rank + 1) * rows]

    def row(self, weight, rank, world_size):
        cols = weight.shape[1] // world_size
        return weight[:, rank * cols:(rank + 1) * cols]

    def row_matmul(self, x, weight, all_reduce):
        return all_reduce(x @ weight.T)
'''
_TIMING = '''import statistics


def tp_step_time(steps, clock=time.perf_counter, warmup=2, repeats=5):
    times = {}
    for n, step in steps.items():
        for _ in range(warmup):
            step()
        samples = []
        for _ in range(repeats):
            start = clock()
            step()
            samples.append(clock() - start)
        times[n] = {"median": statistics.median(samples), "min": min(samples), "max": max(samples)}
    return {"times": times, "speedup": times[1]["median"] / times[max(times)]["median"]}
'''
_POLICY = '''def autoscaler_policy(state, target_ongoing=2.0, upscale_window_s=5.0, downscale_window_s=30.0):
    def totals(window_s):
        return [total for t, total, _ in state.history if t > state.now_s - window_s]

    want_up = math.ceil(min(totals(upscale_window_s)) / target_ongoing)
    want_down = math.ceil(max(totals(downscale_window_s)) / target_ongoing)
    desired = state.target_replicas
    if want_up > desired:
        desired = want_up
    elif want_down < desired:
        desired = want_down
    return min(max(desired, state.min_replicas), state.max_replicas)
'''
_CHOOSE = '''def choose_fleet(run, target_p99_s, warm_options, batch_options):
    rows = [{"warm_replicas": warm, "max_num_seqs": batch, **run(warm, batch)}
            for warm in warm_options for batch in batch_options]
    meeting = [row for row in rows if row["spike_ttft_p99_s"] <= target_p99_s]
    if not meeting:
        return None
    best = min(meeting, key=lambda row: row["usd_per_mtok"])
    return {**best, "rows": rows}
'''
_VLLM = '''def vllm_serve_args(config):
    fixed = {"kv_cache": True, "paged": True, "batching": "continuous", "speculative": None, "enable_lora": False}
    for name, value in fixed.items():
        if getattr(config, name) != value:
            raise ValueError(f"{name}={getattr(config, name)!r}: vLLM always runs {name}={value!r}")
    for name in ("weight_dtype", "kv_dtype"):
        if getattr(config, name) not in (None, "fp8"):
            raise ValueError(f"{name}={getattr(config, name)!r}: vLLM takes fp8 only")
    args = [config.model or VLLM_DEFAULT_MODEL,
            "--max-num-seqs", str(config.max_num_seqs), "--block-size", str(config.block_size),
            "--tensor-parallel-size", str(config.tensor_parallel_size),
            "--enable-prefix-caching" if config.prefix_caching else "--no-enable-prefix-caching",
            "--enable-chunked-prefill" if (config.kv_cache if config.chunked_prefill is None else config.chunked_prefill)
            else "--no-enable-chunked-prefill"]
    if config.max_model_len is not None:
        args += ["--max-model-len", str(config.max_model_len)]
    if config.kv_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    if config.weight_dtype == "fp8":
        args += ["--quantization", "fp8"]
    return args
'''

MISTAKES = {
    "test_column_parallel": [
        ("# every N-th row\n" + _COLUMN.replace("weight[r * rows:(r + 1) * rows]", "weight[r::num_shards]"),
         "every N-th row is not a block"),
        ("# the input features split (a row split)\n" + _ROW.replace("row_parallel", "column_parallel"),
         "that is a whole output (or a row split's partial sum)"),
        ("# reverse order\n" + _COLUMN.replace("for r in range(num_shards)]", "for r in range(num_shards)][::-1]"),
         "reverse order"),
    ],
    "test_row_parallel": [
        ("# the whole product on every rank\ndef row_parallel(x, weight, num_shards):\n"
         "    return [x @ weight.T for _ in range(num_shards)]\n", "every rank returned the whole x @ W^T"),
        ("# a column split\n" + _COLUMN.replace("column_parallel", "row_parallel"), "that is a column split's output"),
        ("# every N-th column\n" + _ROW.replace("x[:, r * cols:(r + 1) * cols] @ weight[:, r * cols:(r + 1) * cols].T",
                                                "x[:, r::num_shards] @ weight[:, r::num_shards].T"),
         "every N-th column is not a block"),
    ],
    "test_parallel_mlp": [
        ("# gate_up cut as one matrix\n" + _MLP.replace(
            "h = F.silu(x @ gate_w[block].T) * (x @ up_w[block].T)",
            "g, u = (x @ w_gate_up[2 * r * cols:2 * (r + 1) * cols].T).chunk(2, dim=-1)\n        h = F.silu(g) * u"),
         "gate_up is two matrices stacked"),
        ("# the whole MLP on every rank\n" + _MLP.replace("        out.append(h @ w_down[:, block].T)",
                                                          "        out.append(lab11.reference_mlp(x, w_gate_up, w_down))"),
         "every rank returned the whole MLP output"),
        ("# up taken for gate\n" + _MLP.replace("gate_w, up_w = w_gate_up.chunk(2, dim=0)",
                                                "up_w, gate_w = w_gate_up.chunk(2, dim=0)"), "the gate rows come first"),
    ],
    "test_tp_sharding": [
        ("# column() cuts the input features\n" + _SHARDING.replace(
            "rows = weight.shape[0] // world_size\n        return weight[rank * rows:(rank + 1) * rows]",
            "rows = weight.shape[1] // world_size\n        return weight[:, rank * rows:(rank + 1) * rows]"),
         "that is the other split's shape"),
        ("# the next rank's block\n" + _SHARDING.replace(
            "return weight[:, rank * cols:(rank + 1) * cols]",
            "r = (rank + 1) % world_size\n        return weight[:, r * cols:(r + 1) * cols]"), "that is rank 1's block"),
        ("# every N-th row\n" + _SHARDING.replace("return weight[rank * rows:(rank + 1) * rows]",
                                                   "return weight[rank::world_size]"), "every N-th index is not a block"),
        ("# no all-reduce\n" + _SHARDING.replace("return all_reduce(x @ weight.T)", "return x @ weight.T"),
         "never called all_reduce"),
        ("# the partial returned, the sum dropped\n" + _SHARDING.replace(
            "return all_reduce(x @ weight.T)", "partial = x @ weight.T\n        all_reduce(partial.clone())\n        return partial"),
         "that is this rank's partial alone"),
    ],
    "test_measure_tp_step_time": [
        ("# warm-up kept\n" + _TIMING.replace("        for _ in range(warmup):\n            step()\n", "")
         .replace("for _ in range(repeats):", "for _ in range(warmup + repeats):"), "warm-up"),
        ("# the mean\n" + _TIMING.replace("statistics.median(samples)", "statistics.fmean(samples)"), "the mean"),
        ("# the minimum\n" + _TIMING.replace('"median": statistics.median(samples)', '"median": min(samples)'),
         "the minimum"),
        ("# speed-up upside down\n" + _TIMING.replace('times[1]["median"] / times[max(times)]["median"]',
                                                        'times[max(times)]["median"] / times[1]["median"]'),
         "it is upside down"),
        ("# time.perf_counter, not the clock\n" + _TIMING.replace("clock()", "time.perf_counter()"),
         "your code never read `clock`"),
        ("# the last N taken as the largest\n" + _TIMING.replace("times[max(times)]", "times[list(times)[-1]]"),
         "whatever the order of `steps`"),
    ],
    "test_row_shard_matmul_kernel": [
        ('row_shard_matmul = WRONG["w_transposed"]\n', "W was read as [K, N]"),
        ('row_shard_matmul = WRONG["last_k_block_skipped"]\n', "the last block of K"),
        ('row_shard_matmul = WRONG["y_transposed"]\n', "y was stored column by column"),
        ('row_shard_matmul = WRONG["store_mask_off_by_one"]\n', "was never stored"),
    ],
    "test_vllm_serve_args": [
        ("# minillm's spelling\n" + _VLLM.replace('"--enable-prefix-caching" if', '"--prefix-caching" if'),
         "--prefix-caching is minillm's spelling; vLLM's is --enable-prefix-caching"),
        ("# only the levers that are on\n" + _VLLM.replace(
            '"--enable-prefix-caching" if config.prefix_caching else "--no-enable-prefix-caching",', "").replace(
            "    if config.max_model_len is not None:",
            '    if config.prefix_caching:\n        args.append("--enable-prefix-caching")\n    if config.max_model_len is not None:'),
         "say prefix_caching explicitly"),
        ("# static batching served anyway\n" + _VLLM.replace('"batching": "continuous", ', ""),
         "vLLM has no flag for batching='static'"),
        ("# the model as --model\n" + _VLLM.replace("args = [config.model or VLLM_DEFAULT_MODEL,",
                                                     'args = ["--model", config.model or VLLM_DEFAULT_MODEL,'),
         "--model is minillm's spelling"),
        ("# chunked_prefill=None (the default) taken as off\n" + _VLLM.replace(
            "(config.kv_cache if config.chunked_prefill is None else config.chunked_prefill)", "config.chunked_prefill"),
         "chunked_prefill is False, expected True"),
        ("# fp8 KV as e5m2\n" + _VLLM.replace('args += ["--kv-cache-dtype", "fp8"]', 'args += ["--kv-cache-dtype", "fp8_e5m2"]'),
         "minillm's map of vLLM's flags refuses it"),
    ],
    "test_answer_tp8_step_ms": [
        ("answer_tp8_step_ms = 70.6e9 * 2 / 3.35e12 * 1e3 / 8   # the weights only\n", "the all-reduces are missing"),
        ("answer_tp8_step_ms = 70.6e9 * 2 / 3.35e12 * 1e3 / 8 + 80 * 20e-3   # one per layer\n",
         "two all-reduces per layer"),
        ("answer_tp8_step_ms = 70.6e9 * 2 / 3.35e12 * 1e3   # one device\n", "one device reading everything"),
        ("answer_tp8_step_ms = None\n", "set it to a number"),
    ],
    "test_autoscaler_policy": [
        ("# the load now, no windows\n" + _POLICY.replace("min(totals(upscale_window_s))", "state.total_ongoing_requests")
         .replace("max(totals(downscale_window_s))", "state.total_ongoing_requests"), "that is ceil(load now / target)"),
        ("# from the running replicas\n" + _POLICY.replace("desired = state.target_replicas",
                                                           "desired = state.running_replicas"),
         "compare with state.target_replicas"),
        ("# no clamp\n" + _POLICY.replace("return min(max(desired, state.min_replicas), state.max_replicas)",
                                          "return desired"), "clamp the answer"),
        ("# floor\n" + _POLICY.replace("math.ceil", "math.floor"), "ceil, not floor or round"),
        ("# the window's edge inside\n" + _POLICY.replace("if t > state.now_s - window_s", "if t >= state.now_s - window_s"),
         "a sample exactly window_s old is outside the window"),
    ],
    "test_measure_choose_fleet": [
        ("# the fastest that meets the target\n" + _CHOOSE.replace('key=lambda row: row["usd_per_mtok"]',
                                                                     'key=lambda row: row["spike_ttft_p99_s"]'),
         "not the fastest"),
        ("# the target ignored\n" + _CHOOSE.replace('if row["spike_ttft_p99_s"] <= target_p99_s', ""),
         "keep only the runs that meet it"),
        ("# an empty dict when nothing meets the target\n" + _CHOOSE.replace("        return None", "        return {}"),
         "expected None"),
        ("# only the rows that meet the target kept\n" + _CHOOSE.replace('return {**best, "rows": rows}',
                                                                           'return {**best, "rows": meeting}'),
         "expected every pair of warm_options x batch_options in the loop's order"),
    ],
}


@pytest.fixture(scope="module")
def graded_namespace(tiny_llm, experiments, tp_result, fleet_namespace, solution, wrong_kernels, kernel_tp) -> dict:
    """What the graded test cells read: the master's solution cells, the tiny model and its MLP check, the measured
    tensor-parallel rows, the fleet sweep's function and the choice made with it."""
    import math

    ns = dict(solution, lab11=lab11, torch=torch, F=F, math=math, WRONG=wrong_kernels, kernel_tp=kernel_tp)
    ns.update(notebook_functions(MASTER, "row_parallel_spec", torch=torch))
    ns.update(fleet_namespace, llm=tiny_llm, model_mlp=experiments["model_mlp"], tp_rows=tp_result["rows"], tp=tp_result,
              TP_SIZES=(1, 2), time=__import__("time"), VLLM_DEFAULT_MODEL=lab11.VLLM_DEFAULT_MODEL,
              fleet_window=experiments["fleet_window"], functools=functools)
    ns["model_mlp_result"] = ns["model_mlp"](tiny_llm, ns["parallel_mlp"], [2, 4])
    ns["choice"] = ns["choose_fleet"](ns["fleet_window"], ns["TARGET_P99_S"], ns["WARM_OPTIONS"], ns["BATCH_OPTIONS"])
    return ns


@pytest.mark.parametrize("grade_id, mistake, names_the_case",
                         [(gid, m, case) for gid, cases in MISTAKES.items() for m, case in cases],
                         ids=[f"{gid}-{i}" for gid, cases in MISTAKES.items() for i in range(len(cases))])
def test_graded_cell_fails_on_a_plausible_mistake(graded_namespace, grade_id, mistake, names_the_case):
    assert_check_fails(MASTER, grade_id, graded_namespace, mistake, names_the_case)


@pytest.mark.slow
def test_solution_kernel_compiles_for_sm80_and_sm90(tmp_path):
    """The learner's row-parallel kernel, compiled ahead of time for the GPUs without one."""
    from kernel_utils import assert_compiles_for_gpus

    path = tmp_path / "lab11_aot.py"
    path.write_text(solution_source(MASTER, MODULE_HEADER, LAUNCHER))
    assert_compiles_for_gpus(path, [("row_shard_matmul_kernel",
                                     {"y_ptr": "*fp32", "x_ptr": "*fp32", "w_ptr": "*fp32", "M": "i32", "N": "i32",
                                      "K": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"},
                                     {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32})])

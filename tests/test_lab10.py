"""Lab 10 (many models, one engine): the master's solutions pass every check; the checks name each usual mistake (every
token on the first token's adapter, adapters off by one, segment index taken as slot, a length taken as an end, the
base model forgotten or counted per adapter, no renormalisation, a bf16 softmax, the routing weight forgotten, gate and
up swapped, one expert per token, an assignment where outputs add up, "8x7B" read as 2 x 7B); every graded test cell
fails on two or more plausible mistakes (MISTAKES, run by lab_utils.assert_check_fails); the engine's parts
(lora_delta, moe_router, moe_experts) give the engine's own tokens with the solutions and refuse what they cannot run;
the experts-touched sweep, the bytes model and the figures come out right. Everything runs on tiny random models
(random:tiny-llama with random adapters, random:tiny-mixtral), not the default model."""

from __future__ import annotations

from kernel_utils import DEVICE as KERNEL_DEVICE  # first: picks the interpreter before triton is imported

import os
import time

import nbformat
import pytest
import torch
import torch.nn.functional as F

from lab_utils import (assert_check_fails, assert_master_structure, import_file, nbgrader_cells, notebook_functions,
                       student_stubs)

from grading.build import REPO_ROOT, SOURCE_DIR
from minillm.lab import lab10
from minillm.lab.common import CheckFailed, figure_subtitle

MASTER = SOURCE_DIR / "10_many_models" / "10_many_models.ipynb"
EXERCISES = {"lora_delta_gather", "lora_delta_segments", "sgmv_kernels", "measure_throughput", "measure_memory",
             "route_topk", "moe_dispatch", "answer_active_params_b"}
GRADED = {"test_lora_delta_gather": 2, "test_lora_delta_segments": 2, "test_sgmv_shrink": 2, "test_sgmv_expand": 2,
          "test_measure_throughput": 2, "test_measure_memory": 2, "test_route_topk": 2, "test_moe_dispatch": 2,
          "test_answer_active_params_b": 1}
DEVICE = "cpu: test device"
KERNEL_CELL = "sgmv_kernels"   # Triton reads a kernel's source from its file: this cell is imported, not exec'd
KERNEL_HEADER = "import os\nimport time\nimport torch\nimport triton\nimport triton.language as tl\nfrom minillm.lab import lab10\n"
# One slip each in the solution kernels: (the solution's text, the slip, how many times the text is there)
KERNEL_SLIPS = {
    "shrink_rows_le": ("is_row = rows < length\n    is_rank = ranks < R\n    acc",
                       "is_row = rows <= length\n    is_rank = ranks < R\n    acc", 1),
    "shrink_no_skip": ("    if slot == 0:\n        return\n    tokens = start + rows\n    is_row = rows < length\n    is_rank",
                       "    tokens = start + rows\n    is_row = rows < length\n    is_rank", 1),
    "shrink_slot_stride": ("a_ptr + slot * R * IN", "a_ptr + slot * IN", 1),
    "expand_segment_as_slot": ("b_ptr + slot * OUT * R", "b_ptr + seg * OUT * R", 1),
    "expand_output_stride": ("delta_ptr + tokens[:, None] * OUT + cols[None, :]", "delta_ptr + tokens[:, None] * R + cols[None, :]", 1),
    "expand_no_start": ("tokens = start + rows\n    is_row = rows < length\n    is_col", "tokens = rows\n    is_row = rows < length\n    is_col", 1),
}


def _solution_namespace() -> dict:
    """The master's solution cells but the kernel cell, exec'd in one namespace."""
    ns = {"lab10": lab10, "torch": torch, "F": F, "time": time}
    for gid, (cell, meta) in nbgrader_cells(nbformat.read(MASTER, as_version=4)).items():
        if cell.cell_type == "code" and meta.get("solution") and gid != KERNEL_CELL:
            exec(compile(cell.source, f"<master:{gid}>", "exec"), ns)
    return ns


def kernel_source() -> str:
    """The kernel cell, the launchers and the torch spec, as one module's source."""
    cells = nbgrader_cells(nbformat.read(MASTER, as_version=4))
    return KERNEL_HEADER + "\n\n".join(cells[gid][0].source for gid in (KERNEL_CELL, "sgmv-launchers", "sgmv-spec")) + "\n"


@pytest.fixture(scope="module")
def solution() -> dict:
    return _solution_namespace()


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    """The master's kernels with their launchers and spec, imported from a file."""
    path = tmp_path_factory.mktemp("lab10_kernels") / "lab10_kernels.py"
    path.write_text(kernel_source())
    return import_file(path, "lab10_kernels")


@pytest.fixture(scope="module")
def wrong_kernels(tmp_path_factory) -> dict:
    """{slip: the kernels' module with that one slip}, each imported from its own file."""
    source, modules = kernel_source(), {}
    folder = tmp_path_factory.mktemp("lab10_wrong")
    for name, (old, new, count) in KERNEL_SLIPS.items():
        assert source.count(old) == count, f"the solution kernel changed: {old!r} is not there {count} time(s)"
        path = folder / f"lab10_{name}.py"
        path.write_text(source.replace(old, new))
        modules[name] = import_file(path, f"lab10_{name}")
    return modules


@pytest.fixture(scope="module")
def experiments() -> dict:
    from minillm import LLM, SamplingParams
    from minillm.bench import lora as lora_bench

    return notebook_functions(MASTER, "lora_runs", "moe_run", "experts_touched", "run_with_kernels", "lora_ways",
                              lab10=lab10, LLM=LLM, SamplingParams=SamplingParams, lora_bench=lora_bench)


@pytest.fixture(scope="module")
def tiny_lora(tmp_path_factory):
    """random:tiny-llama with LoRA on, and three random adapters (ranks 4, 8, 16) large enough to change its tokens."""
    from minillm import LLM
    from minillm.bench.lora import random_adapter
    from minillm.layers.lora import layer_shapes
    from minillm.lora import LoRARequest

    llm = LLM("random:tiny-llama", enable_lora=True, max_loras=3, max_lora_rank=16, seed=0)
    root = tmp_path_factory.mktemp("lab10-adapters")
    requests = [LoRARequest(f"adapter{i}", i + 1, random_adapter(str(root / f"a{i}"), layer_shapes(llm.engine.model),
                                                                    rank=rank, seed=i, std=0.5))
                for i, rank in enumerate((4, 8, 16))]
    gen = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, llm.model_config.vocab_size, (4 + 3 * i,), generator=gen).tolist()}
               for i in range(4)]
    return llm, requests, prompts


def test_master_has_every_graded_piece_with_hidden_tests():
    assert_master_structure(MASTER, EXERCISES, GRADED, 17)
    nb = nbformat.read(MASTER, as_version=4)
    setup = nb.cells[2].source
    assert setup.index('os.environ["TRITON_INTERPRET"] = "1"') < setup.index("import triton") < setup.index("from minillm")
    assert nb.metadata["minillm"]["kernels"] == {KERNEL_CELL: ["sgmv_shrink_kernel", "sgmv_expand_kernel"]}
    for gid in ("sgmv_kernels", "measure_throughput"):
        assert nb.metadata["minillm"]["references"][gid], gid
    assert "test_lora_in_engine" not in nbgrader_cells(nb), "no points for re-running exercises 1 and 2 in the engine"


def test_student_copy_has_stubs_and_no_solution():
    stubs = student_stubs(REPO_ROOT / "labs" / "10_many_models.ipynb", EXERCISES)
    assert "bmm" not in stubs["lora_delta_gather"] and "index_add_" not in stubs["moe_dispatch"]
    assert "12.9" not in stubs["answer_active_params_b"]
    kernel = stubs[KERNEL_CELL]
    assert kernel.count("raise NotImplementedError()") == 2 and "tl.store" not in kernel and "tl.sum" not in kernel
    for pointer in ("x_ptr,", "a_ptr,", "mid_ptr,", "b_ptr,", "delta_ptr,", "seg_start_ptr,"):
        line = next(line for line in kernel.splitlines() if line.strip().startswith(pointer))
        assert "# [" in line, f"{pointer} has no shape comment"
    assert "clock()" not in stubs["measure_throughput"] and "median" not in stubs["measure_throughput"].split('"""')[2]


# --------------------------------------------------------------------- the solutions pass
def test_solution_passes_every_check(solution):
    for seed in (0, 1, 2, 3):
        lab10.check_lora_gather(solution["lora_delta_gather"], seed=seed)
        lab10.check_lora_segments(solution["lora_delta_segments"], seed=seed)
        lab10.check_route(solution["route_topk"], seed=seed)
        lab10.check_dispatch(solution["moe_dispatch"], seed=seed)
    rows = [{"num_adapters": 1, "adapter_bytes": 1e6}, {"num_adapters": 3, "adapter_bytes": 5e6}]
    lab10.check_memory(solution["memory_for"], rows, 2e8)
    lab10.check_answer_active_params_b(solution["answer_active_params_b"])
    assert lab10.active_params_b() == pytest.approx(12.9, abs=0.05)
    lab10.check_throughput_harness(solution["measure_lora_throughput"])
    lab10.check_throughput_harness(lab10.reference_throughput)


# --------------------------------------------------------------------- the SGMV kernels
def test_solution_kernels_match_the_spec(kernels):
    lab10.check_sgmv_shrink(kernels.sgmv_shrink, device=KERNEL_DEVICE)
    lab10.check_sgmv_delta(kernels.sgmv_delta, device=KERNEL_DEVICE)
    lab10.check_sgmv_shrink(kernels.sgmv_shrink, cases=lab10.HIDDEN_SGMV_CASES, seed=7, device=KERNEL_DEVICE)
    lab10.check_sgmv_delta(kernels.sgmv_delta, cases=lab10.HIDDEN_SGMV_CASES, seed=9, device=KERNEL_DEVICE)
    empty = torch.zeros(0, dtype=torch.int32)
    assert not kernels.sgmv_delta(torch.randn(3, 4), torch.randn(2, 2, 4), torch.randn(2, 5, 2), empty, empty, empty).any()


def test_the_spec_is_the_engine_reference():
    from minillm.kernels.lora import lora_delta_reference, token_slots_from_segments

    x, a, b, starts, lens, slots = lab10.make_sgmv_inputs([(0, 2, 2), (3, 5, 1), (9, 1, 2)], 11, 3, 5, 20, 12)
    a[0], b[0] = 0.0, 0.0   # the engine's slot 0
    want = lora_delta_reference(x, a, b, token_slots_from_segments(11, starts, lens, slots))
    torch.testing.assert_close(lab10.sgmv_reference(x, a, b, starts, lens, slots), want)


def test_stub_kernels_raise_not_implemented(tmp_path):
    source = kernel_source()
    while "    ### BEGIN SOLUTION\n" in source:
        start = source.index("    ### BEGIN SOLUTION\n")
        end = source.index("    ### END SOLUTION\n", start) + len("    ### END SOLUTION\n")
        source = source[:start] + "    # YOUR CODE HERE\n    raise NotImplementedError()\n" + source[end:]
    path = tmp_path / "lab10_stub.py"
    path.write_text(source)
    module = import_file(path, "lab10_stub")
    x, a, b, starts, lens, slots = lab10.make_sgmv_inputs(*lab10.SGMV_CASES[0][:6])
    with pytest.raises(NotImplementedError):
        module.sgmv_shrink(x, a, starts, lens, slots)
    with pytest.raises(NotImplementedError):
        module.sgmv_delta(x, a, b, starts, lens, slots)


@pytest.mark.parametrize("slip, check, message", [
    ("shrink_rows_le", "check_sgmv_shrink", "a row past the segment's end"),
    ("shrink_no_skip", "check_sgmv_shrink", "a segment on slot 0 has no adapter"),
    ("shrink_slot_stride", "check_sgmv_shrink", "compare with the torch spec"),
    ("expand_segment_as_slot", "check_sgmv_delta", "sgmv_delta"),
    ("expand_no_start", "check_sgmv_delta", "segments (0, 2, slot 2)"),
    ("expand_output_stride", "check_sgmv_delta", "NaN: the launcher fills"),
])
def test_kernel_checks_name_the_slip(wrong_kernels, slip, check, message):
    module = wrong_kernels[slip]
    fn = module.sgmv_shrink if check == "check_sgmv_shrink" else module.sgmv_delta
    with pytest.raises(CheckFailed, match=message.replace("(", r"\(").replace(")", r"\)")):
        getattr(lab10, check)(fn, device=KERNEL_DEVICE)


def test_kernels_in_the_engine_give_the_engine_tokens(tiny_lora, kernels, wrong_kernels, experiments, capsys):
    llm, requests, prompts = tiny_lora
    run = experiments["run_with_kernels"]
    result = run(llm, prompts, [None, *requests], kernels.sgmv_delta, 3)
    assert result["tokens"] == result["engine"] and result["calls"] == 3 * 14   # 3 steps x 2 layers x 7 slices
    assert len({tuple(t) for t in result["engine"]}) > 1, "the adapters change the tokens"
    lab10.check_kernel_engine_run(result)
    lab10.print_kernel_engine_run(result)
    out = capsys.readouterr().out
    assert "a step of 34 tokens in 3 segments: 14 calls" in out and "✓ the same as the engine's own LoRA path" in out
    assert llm.engine.runner.parts.lora_delta is None, "the kernels ran in an engine of their own"
    wrong = run(llm, prompts, [None, *requests], wrong_kernels["expand_segment_as_slot"].sgmv_delta, 3)
    with pytest.raises(CheckFailed, match="parts from the engine's own LoRA tokens"):
        lab10.check_kernel_engine_run(wrong)
    with pytest.raises(CheckFailed, match="run the cell above"):
        lab10.check_kernel_engine_run(None)


def test_sgmv_timing_without_a_gpu_says_so(kernels, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU times the kernels")
    lab10.print_sgmv_timing(lab10.time_sgmv(kernels.sgmv_delta))
    assert "No GPU here" in capsys.readouterr().out


# --------------------------------------------------------------------- the throughput harness
def test_throughput_rows_and_the_reference_beside(capsys):
    clock = lab10.FakeClock()
    costs = iter([1.0, 2.0, 4.0, 3.0] + [5.0, 6.0, 7.0, 9.0])
    measured = lab10.reference_throughput(lambda: clock.advance(next(costs)), lambda: clock.advance(next(costs)), 12,
                                          clock, warmup=1, repeats=3)
    assert measured["batched"]["median_s"] == 3.0 and measured["swap"]["min_s"] == 6.0
    row = lab10.throughput_row(3, 3 * 2 ** 20, 100 * 2 ** 20, measured)
    assert row["batched_tok_s"] == 4.0 and row["batched_tok_s_low"] == 3.0 and row["ratio"] == pytest.approx(7 / 3)
    fig = lab10.throughput_figure([lab10.throughput_row(1, 2 ** 20, 100 * 2 ** 20, measured), row], DEVICE)
    assert list(fig.data[0].error_y.array) == [2.0, 2.0]
    lab10.print_throughput([row, lab10.throughput_row(1, 2 ** 20, 100 * 2 ** 20, None)], DEVICE)
    lab10.print_reference_ratio([row])
    out = capsys.readouterr().out
    assert "2.33x" in out and "3 adapters" in out


def test_lora_ways_serve_the_same_requests_and_restore_the_weights(tiny_lora, experiments, monkeypatch):
    from minillm.bench import lora as lora_bench

    llm, requests, prompts = tiny_lora
    monkeypatch.setattr(lora_bench, "PROMPTS", prompts)   # the tiny model has no tokenizer: token ids
    run_batched, run_swapped = experiments["lora_ways"](llm, requests[:2], 4, 2)
    weights = {k: v.clone() for k, v in llm.engine.model.state_dict().items()}
    run_batched()
    run_swapped()
    assert all(torch.equal(v, llm.engine.model.state_dict()[k]) for k, v in weights.items()), "restored exactly"


def test_segments_of_builds_the_engine_segments():
    starts, lens, slots = lab10.segments_of([1, 1, 1, 0, 0, 2, 2, 1])
    assert starts.tolist() == [0, 5, 7] and lens.tolist() == [3, 2, 1] and slots.tolist() == [1, 2, 1]
    assert [t.tolist() for t in lab10.segments_of([0, 0])] == [[], [], []]


# --------------------------------------------------------------------- the plug-in points in the engine
def test_lora_runs_on_the_solution_and_on_a_wrong_delta(tiny_lora, solution, experiments, capsys):
    llm, requests, prompts = tiny_lora
    owners = [None, *requests]
    result = experiments["lora_runs"](llm, prompts, owners, solution["lora_delta_gather"],
                                      solution["lora_delta_segments"], 5)
    assert result["plugged"]["gather"] == result["engine"] == result["plugged"]["segments"]
    assert result["merged"] == result["engine"] and result["merged_diff"] < 1e-5
    assert len({tuple(t) for t in result["engine"]}) > 1, "the adapters change the tokens"
    lab10.check_engine_runs(result)
    lab10.print_engine_runs(result)
    assert "4 of 4 requests" in capsys.readouterr().out

    def shifted(x, a, b, seg_starts, seg_lens, seg_slots):   # segment i on slot i + 1
        return solution["lora_delta_segments"](x, a, b, seg_starts, seg_lens,
                                               torch.arange(1, len(seg_slots) + 1, dtype=torch.int32))

    wrong = experiments["lora_runs"](llm, prompts, [requests[2], requests[0], None, requests[1]],
                                     solution["lora_delta_gather"], shifted, 5)
    with pytest.raises(CheckFailed, match="your segments delta in the engine"):
        lab10.check_engine_runs(wrong)
    # the engine's own delta is back after a plugged run, and after one that raised
    again = experiments["lora_runs"](llm, prompts, owners, solution["lora_delta_gather"], shifted, 5)
    assert again["engine"] == result["engine"]

    def broken(x, a, b, seg_starts, seg_lens, seg_slots):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        experiments["lora_runs"](llm, prompts, owners, solution["lora_delta_gather"], broken, 3)
    assert experiments["lora_runs"](llm, prompts, owners, solution["lora_delta_gather"],
                                    solution["lora_delta_segments"], 5)["engine"] == result["engine"]


def test_the_lora_delta_part_refuses_what_it_cannot_run(tiny_lora):
    from minillm import LLM, SamplingParams

    llm, requests, prompts = tiny_lora
    with pytest.raises(ValueError, match="lora_delta= needs enable_lora=True"):
        LLM("random:tiny-llama", lora_delta=lambda x, a, b, batch: None)
    with pytest.raises(ValueError, match="lora_delta=3 is not callable; a LoRADelta is a function lora_delta"
                                         r"\(x, a, b, batch\)"):
        llm.with_levers(lora_delta=3)
    with pytest.raises(ValueError, match=r"cannot be called as lora_delta\(x, a, b, batch\)"):
        llm.with_levers(lora_delta=lambda x, a, b: None)
    wrong = llm.with_levers(lora_delta=lambda x, a, b, batch: torch.zeros(x.shape[0], 1))
    with pytest.raises(ValueError, match=r"expected a tensor of shape \(\d+, \d+\)"):
        wrong.generate(prompts[:1], SamplingParams(max_tokens=2), lora_request=requests[0])
    assert len(llm.generate(prompts[:1], SamplingParams(max_tokens=2), lora_request=requests[0])[0].outputs[0].token_ids) == 2


def test_moe_run_on_the_solution_and_on_a_wrong_dispatch(solution, experiments):
    result = experiments["moe_run"](solution["route_topk"], solution["moe_dispatch"], num_prompts=3, max_tokens=6)
    assert result["equal"] and result["num_experts"] == 4
    lab10.check_moe_run(result)

    def no_weights(x, weights, ids, w13, w2):
        return solution["moe_dispatch"](x, torch.ones_like(weights), ids, w13, w2)

    wrong = experiments["moe_run"](solution["route_topk"], no_weights, num_prompts=3, max_tokens=6)
    assert not wrong["equal"]
    with pytest.raises(CheckFailed, match="parts from the engine's own tokens"):
        lab10.check_moe_run(wrong)
    with pytest.raises(CheckFailed, match="run the cell above"):
        lab10.check_moe_run(None)


def test_the_moe_parts_refuse_models_they_cannot_run():
    from minillm import LLM

    route = lambda logits, k: None  # noqa: E731
    with pytest.raises(ValueError, match="moe_router: this model has no mixture-of-experts layers"):
        LLM("random:tiny-llama", moe_router=route)
    with pytest.raises(ValueError, match="moe_router: Mixtral-style MoE only"):
        LLM("random:tiny-qwen2-moe", moe_router=route)
    with pytest.raises(ValueError, match="moe_experts='loop' is not callable"):
        LLM("random:tiny-mixtral", moe_experts="loop")


def test_experts_touched_follow_the_uniform_model_and_the_bytes_figure(experiments, capsys):
    from minillm import LLM

    llm = LLM(lab10.register_moe_preset(), seed=0, max_num_seqs=8)
    rows = experiments["experts_touched"](llm, (1, 4, 8), 5)
    assert rows[0]["experts_touched"] == 2.0 and all(r["steps"] == 4 for r in rows)
    for row in rows[1:]:   # a random router: near E(1 - (1 - k/E)^B), not on it
        expected = lab10.experts_model(8, 2, [row["batch"]])[0]
        assert abs(row["experts_touched"] - expected) < 1.5, (row, expected)
    lab10.print_touched(rows, 8, 2, DEVICE)
    assert "E(1-(1-k/E)^B)" in capsys.readouterr().out
    table = lab10.bytes_rows(rows)
    for r in table:
        assert r["dense_active"] <= r["moe_measured"] <= r["dense_total"]
    assert table[0]["moe_measured"] == pytest.approx(table[0]["dense_active"])
    fig = lab10.bytes_figure(table, DEVICE)
    assert len(fig.data) == 4 and DEVICE in figure_subtitle(fig)


def test_throughput_and_memory_printouts(capsys, solution):
    rows = [{"num_adapters": 1, "batched_tok_s": 20.0, "swap_tok_s": 10.0, "adapter_bytes": 2 ** 20,
             "merged_copies_bytes": 500 * 2 ** 20},
            {"num_adapters": 4, "batched_tok_s": 18.0, "swap_tok_s": 6.0, "adapter_bytes": 4 * 2 ** 20,
             "merged_copies_bytes": 2000 * 2 ** 20}]
    lab10.print_throughput(rows, DEVICE)
    assert "3.00x" in capsys.readouterr().out
    fig = lab10.throughput_figure(rows, DEVICE)
    assert [list(t.y) for t in fig.data] == [[20.0, 18.0], [10.0, 6.0]]
    memory = solution["memory_for"](rows, 500 * 2 ** 20, 100)
    assert memory["ratio"] == pytest.approx(100 * 500 / (500 + 100))
    lab10.print_memory(memory, 500 * 2 ** 20)
    assert "83x less memory" in capsys.readouterr().out
    lab10.print_param_counts()
    assert "12.88B" in capsys.readouterr().out


def test_adapter_paths_in_quick_mode_never_train(tiny_lora, tmp_path, monkeypatch):
    from minillm import adapters

    def no_training(*args, **kwargs):
        raise AssertionError("quick mode trained an adapter")

    monkeypatch.setattr(adapters, "build_adapter", no_training)
    monkeypatch.setattr(adapters, "train_adapter", no_training)
    llm, _requests, _prompts = tiny_lora   # a random model: none of the trained adapters fit it, all random
    paths = lab10.adapter_paths(llm, train=False, workdir=str(tmp_path))
    assert list(paths) == ["random1", "random2", "random3"]
    assert all(os.path.isfile(os.path.join(p, "adapter_config.json")) for p in paths.values())


# --------------------------------------------------------------------- every graded cell fails on plausible mistakes
GATHER_FIRST = '''def lora_delta_gather(x, a, b, token_slots):   # every token on the first token's adapter
    s = int(token_slots[0])
    return (x @ a[s].T) @ b[s].T
'''
GATHER_OFF_BY_ONE = '''def lora_delta_gather(x, a, b, token_slots):   # slot s taken as a[s - 1]
    slots = (token_slots - 1).clamp(min=0)
    return torch.bmm(b[slots], torch.bmm(a[slots], x.unsqueeze(2))).squeeze(2)
'''
GATHER_SHRINK_ONLY = '''def lora_delta_gather(x, a, b, token_slots):   # stops after x A^T
    return torch.bmm(a[token_slots], x.unsqueeze(2)).squeeze(2)
'''
_SEG = '''def lora_delta_segments(x, a, b, seg_starts, seg_lens, seg_slots):
    delta = torch.zeros(x.shape[0], b.shape[1])
    for i, (start, length, slot) in enumerate(zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist())):
        rows = slice(start, start + length)
        delta[rows] = (x[rows] @ a[slot].T) @ b[slot].T
    return delta
'''
SEG_INDEX_AS_SLOT = "# segment i on slot i + 1\n" + _SEG.replace("a[slot].T) @ b[slot].T", "a[i + 1].T) @ b[i + 1].T")
SEG_LEN_AS_END = "# seg_lens read as ends\n" + _SEG.replace("slice(start, start + length)", "slice(start, length)")
SEG_SKIPS_LAST = "# the last segment forgotten\n" + _SEG.replace(
    "zip(seg_starts.tolist(), seg_lens.tolist(), seg_slots.tolist())",
    "zip(seg_starts.tolist()[:-1], seg_lens.tolist(), seg_slots.tolist())")
_MEM = '''def memory_for(rows, model_bytes, num_adapters=100):
    largest = max(rows, key=lambda row: row["num_adapters"])
    per_adapter = largest["adapter_bytes"] / largest["num_adapters"]
    lora_bytes = model_bytes + num_adapters * per_adapter
    merged_bytes = num_adapters * model_bytes
    return {"bytes_per_adapter": per_adapter, "lora_bytes": lora_bytes, "merged_bytes": merged_bytes,
            "ratio": merged_bytes / lora_bytes}
'''
_ROUTE = '''def route_topk(router_logits, top_k):
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights / weights.sum(dim=-1, keepdim=True), ids
'''
_DISPATCH = '''def moe_dispatch(x, weights, ids, w13, w2):
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        rows, cols = (ids == e).nonzero(as_tuple=True)
        if len(rows) == 0:
            continue
        gate, up = (x[rows] @ w13[e].T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].T * weights[rows, cols, None]
        out.index_add_(0, rows, y.to(x.dtype))
    return out
'''

_MEASURE = '''def measure_lora_throughput(run_batched, run_swapped, tokens, clock=time.perf_counter, warmup=1, repeats=3):
    import statistics

    result = {}
    for name, run in (("batched", run_batched), ("swap", run_swapped)):
        for _ in range(warmup):
            run()
        samples = []
        for _ in range(repeats):
            start = clock()
            run()
            samples.append(clock() - start)
        median = statistics.median(samples)
        result[name] = {"median_s": median, "min_s": min(samples), "max_s": max(samples), "tok_s": tokens / median}
    result["ratio"] = result["batched"]["tok_s"] / result["swap"]["tok_s"]
    return result
'''

MISTAKES = {
    "test_lora_delta_gather": [
        (GATHER_FIRST, "every token used the first token's adapter"),
        (GATHER_OFF_BY_ONE, "off by one"),
        (GATHER_SHRINK_ONLY, "lora_delta_gather(x [5, 6], a [4, 3, 6], b [4, 5, 3], token_slots) returned shape"),
    ],
    "test_lora_delta_segments": [
        (SEG_INDEX_AS_SLOT, "seg_slots[i], not slot i + 1"),
        (SEG_LEN_AS_END, "three segments covering every token"),
        (SEG_SKIPS_LAST, "three segments covering every token"),
    ],
    "test_sgmv_shrink": [
        ('sgmv_shrink = WRONG["shrink_rows_le"].sgmv_shrink', "a row past the segment's end"),
        ('sgmv_shrink = WRONG["shrink_no_skip"].sgmv_shrink', "a segment on slot 0 has no adapter"),
        ('sgmv_shrink = WRONG["shrink_slot_stride"].sgmv_shrink', "one segment of 3 tokens on slot 1"),
    ],
    "test_sgmv_expand": [
        ('sgmv_delta = WRONG["expand_segment_as_slot"].sgmv_delta', "one segment of 3 tokens on slot 1"),
        ('sgmv_delta = WRONG["expand_no_start"].sgmv_delta', "tokens 2, 8 and 10 in none"),
        ('sgmv_delta = WRONG["expand_output_stride"].sgmv_delta', "this output was never stored"),
    ],
    "test_measure_throughput": [
        ("# warm-up runs timed too\n" + _MEASURE.replace("for _ in range(warmup):\n            run()\n        ", "")
         .replace("range(repeats)", "range(warmup + repeats)"), "warm-up"),
        ("# the mean\n" + _MEASURE.replace("statistics.median(samples)", "statistics.fmean(samples)"), "the mean"),
        ("# the fastest run\n" + _MEASURE.replace("median = statistics.median(samples)", "median = min(samples)"),
         "the minimum"),
        ("# ratio inverted\n" + _MEASURE.replace('result["batched"]["tok_s"] / result["swap"]["tok_s"]',
                                                  'result["swap"]["tok_s"] / result["batched"]["tok_s"]'), "inverted"),
        ("# time.perf_counter, not the clock passed in\nimport time as _t\n" + _MEASURE.replace("clock()", "_t.perf_counter()"),
         "the clock passed in was never read"),
    ],
    "test_measure_memory": [
        ("# no base model\n" + _MEM.replace("lora_bytes = model_bytes + num_adapters", "lora_bytes = num_adapters"),
         "ONE copy of the base model"),
        ("# the first row\n" + _MEM.replace("largest = max(rows, key=lambda row: row[\"num_adapters\"])",
                                            "largest = rows[0]"), "the row with the most adapters"),
        ("# the last row\n" + _MEM.replace("largest = max(rows, key=lambda row: row[\"num_adapters\"])",
                                           "largest = rows[-1]"), "the row with the most adapters"),
        ("# a base model per adapter\n" + _MEM.replace("lora_bytes = model_bytes + num_adapters * per_adapter",
                                                       "lora_bytes = num_adapters * (model_bytes + per_adapter)"),
         "ONE copy of the base model"),
    ],
    "test_route_topk": [
        ("# not renormalised\n" + _ROUTE.replace("weights / weights.sum(dim=-1, keepdim=True), ids", "weights, ids"),
         "renormalise"),
        ("# softmax in the logits' dtype\n" + _ROUTE.replace("dim=-1, dtype=torch.float32)", "dim=-1).float()"),
         "bf16 logits: the softmax in fp32"),
        ("# softmax over the tokens\n" + _ROUTE.replace("torch.softmax(router_logits, dim=-1,",
                                                        "torch.softmax(router_logits, dim=0,"), "softmax over the experts (dim=-1"),
    ],
    "test_moe_dispatch": [
        ("# the routing weight forgotten\n" + _DISPATCH.replace(" * weights[rows, cols, None]", ""),
         "routing weight"),
        ("# up rows taken first\n" + _DISPATCH.replace("gate, up =", "up, gate ="), "gate rows first"),
        ("# only each token's first expert\n" + _DISPATCH.replace("(ids == e)", "(ids[:, :1] == e)"),
         "all k columns of ids"),
        ("# an assignment: the last expert wins\n" + _DISPATCH.replace("out.index_add_(0, rows, y.to(x.dtype))",
                                                                         "out[rows] = y.to(x.dtype)"), "add up"),
        ("# every expert runs, chosen or not\n" + _DISPATCH.replace("        if len(rows) == 0:\n            continue\n", ""),
         "an expert no token chose must cost nothing"),
        ("# all experts for every token, weighted by a dense mask\ndef moe_dispatch(x, weights, ids, w13, w2):\n"
         "    h = torch.einsum('th,eih->tei', x, w13)\n    inter = w13.shape[1] // 2\n"
         "    y = torch.einsum('tei,ehi->teh', F.silu(h[..., :inter]) * h[..., inter:], w2)\n"
         "    mask = torch.zeros(x.shape[0], w13.shape[0]).scatter(1, ids, weights)\n"
         "    return (y * mask[..., None]).sum(1).to(x.dtype)\n", "an expert no token chose must cost nothing"),
    ],
    "test_answer_active_params_b": [
        ("answer_active_params_b = 46.7 * 2 / 8   # a quarter of everything\n", "only the experts are sparse"),
        ("answer_active_params_b = 2 * 7.0   # two 7B experts\n", "'8x7B' is a name"),
        ("answer_active_params_b = 46.7\n", "that is the total"),
        ("answer_active_params_b = None\n", "set it to a number"),
    ],
}


@pytest.fixture(scope="module")
def graded_namespace(tiny_lora, experiments, kernels, wrong_kernels) -> dict:
    """What the graded test cells read: the master's solution cells, the kernels with their launchers and spec, a tiny
    LoRA engine with its requests and prompts, the notebook's experiments, and the state the run cells leave (the
    mixed batch, throughput rows, the MoE run); WRONG: the kernels with one slip each, for the mistakes' sources."""
    llm, requests, prompts = tiny_lora
    ns = _solution_namespace()
    ns.update({k: v for k, v in vars(kernels).items() if not k.startswith("__")})
    ns.update(llm=llm, requests=requests, mixed_prompts=prompts, lora_runs=experiments["lora_runs"],
              moe_run=experiments["moe_run"], WRONG=wrong_kernels,
              lora_rows=[{"num_adapters": 1, "adapter_bytes": 2_000_000}, {"num_adapters": 3, "adapter_bytes": 9_000_000}])
    ns["moe"] = ns["moe_run"](ns["route_topk"], ns["moe_dispatch"], num_prompts=2, max_tokens=4)
    return ns


@pytest.mark.parametrize("grade_id, mistake, names_the_case",
                         [(gid, m, case) for gid, cases in MISTAKES.items() for m, case in cases],
                         ids=[f"{gid}-{i}" for gid, cases in MISTAKES.items() for i in range(len(cases))])
def test_graded_cell_fails_on_a_plausible_mistake(graded_namespace, grade_id, mistake, names_the_case):
    assert_check_fails(MASTER, grade_id, graded_namespace, mistake, names_the_case)


@pytest.mark.slow
def test_solution_kernels_compile_for_sm80_and_sm90(kernels):
    message = lab10.compile_kernels(kernels.sgmv_shrink_kernel, kernels.sgmv_expand_kernel)
    assert "sm_80" in message and "sm_90" in message

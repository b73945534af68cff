"""Lab 05 (quantization): the master's solutions pass every check (int8 / int4 / packing against
minillm.quant, the Triton int4 matmul under the interpreter and compiled for sm_80/sm_90, salient
channels, KV arithmetic against the engine), the checks name each usual mistake, the kernel runs inside
the int4 engine with the reference's tokens, the Q4_1 alignment effect is real, the ablation ranks the
variants, and the setting widget updates. MISTAKES feeds every graded test cell plausible wrong answers
(wrong kernels are the solution's source with one line changed, imported from a file)."""

from __future__ import annotations

import time

from kernel_utils import DEVICE  # first: picks the interpreter before triton is imported

import nbformat
import pytest
import torch

from lab_utils import assert_check_fails, import_file, nbgrader_cells, notebook_functions

from grading.build import REPO_ROOT, SOURCE_DIR
from minillm.lab import lab05
from minillm.lab.common import CheckFailed
from minillm.quant import int4 as ref_int4
from minillm.quant import int8 as ref_int8

MASTER = SOURCE_DIR / "05_quantization" / "05_quantization.ipynb"
MODULE_HEADER = """\
import os
import torch
import triton
import triton.language as tl
from minillm.lab import lab05
"""
GRADED = {"test_int8": 2, "test_int4": 2, "test_pack": 1, "test_measure_layer_errors": 1, "test_int4_matmul_rows": 2,
          "test_int4_matmul_groups": 2, "test_salient": 2, "test_kv_bytes": 2, "test_sequences_fit": 1,
          "test_answer_llama_fit": 1, "test_measure_time_decode": 2}


LAUNCHER = "def int4_matmul("  # the code cell that launches the kernel, kept with the solution cells
# Solution cells that run on the notebook's state (the measurement reads `weight`, the real layer) stay out of
# the module: the wrong-answer tests exec them in their namespace instead.
STATEFUL = ("measure_", "answer_")


def solution_source(master=MASTER, header=MODULE_HEADER, launcher_prefix=LAUNCHER) -> str:
    """lab_utils.solution_source without the STATEFUL solution cells: header, the solution functions and the
    kernel's launcher, as one module's source (Triton reads a kernel's source from its file)."""
    nb = nbformat.read(master, as_version=4)
    parts = [header]
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if cell.cell_type == "code" and (meta.get("solution") and not meta["grade_id"].startswith(STATEFUL)
                                         or cell.source.startswith(launcher_prefix)):
            parts.append(cell.source)
    return "\n\n".join(parts) + "\n"


@pytest.fixture(scope="module")
def solution(tmp_path_factory):
    """The master's solution functions and kernel launcher, imported from a file."""
    path = tmp_path_factory.mktemp("lab05_solution") / "lab05_solution.py"
    path.write_text(solution_source())
    return import_file(path, "lab05_solution")

EXPERIMENTS = ("weight_table", "error_sweep", "run_with_kernel", "collect_linear_inputs", "layer_ablation",
               "ablation_perplexity", "kv_table", "kv_int8_run")


@pytest.fixture(scope="module")
def experiments() -> dict:
    """The experiments the notebook writes in its own cells (not in minillm.lab.lab05), as functions."""
    return notebook_functions(MASTER, *EXPERIMENTS)


def test_master_has_every_graded_piece_with_hidden_tests():
    nb = nbformat.read(MASTER, as_version=4)
    meta = nbgrader_cells(nb)
    for name in ("quantize_int8", "quantize_int4", "pack_int4", "int4_matmul_kernel", "salient_channels",
                 "kv_bytes_per_token"):
        assert meta[name][1]["solution"] and "### BEGIN SOLUTION" in meta[name][0].source
    graded = {gid: m for gid, (c, m) in meta.items() if m.get("grade")}
    assert {gid: m["points"] for gid, m in graded.items()} == GRADED
    for gid in graded:
        assert "### BEGIN HIDDEN TESTS" in meta[gid][0].source, f"{gid} has no hidden tests"
        assert graded[gid]["locked"]
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "### BEGIN MODEL ANSWER" not in cell.source:   # model answers: plain markdown
            assert cell.metadata["nbgrader"]["locked"], f"markdown cell {cell.id} is editable"
    assert 'QUICK = os.environ.get("MINILLM_QUICK") == "1"' in nb.cells[1].source
    setup = nb.cells[2].source
    assert setup.index('os.environ["TRITON_INTERPRET"] = "1"') < setup.index("import triton")
    assert "Graded (18 points)" in nb.cells[0].source


def test_student_kernel_keeps_the_signature_and_pointer_comments():
    student = nbformat.read(REPO_ROOT / "labs" / "05_quantization.ipynb", as_version=4)
    kernel = next(c.source for c in student.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "int4_matmul_kernel")
    for pointer in ("y_ptr,", "x_ptr,", "packed_ptr,", "scale_ptr,", "zero_ptr,"):
        line = next(line for line in kernel.splitlines() if line.strip().startswith(pointer))
        assert "# [" in line, f"{pointer} has no shape comment"
    assert "raise NotImplementedError()" in kernel and "tl.store" not in kernel


# --------------------------------------------------------------------- the solutions pass
def test_solution_quantizers_pass_every_check(solution, passes):
    assert passes(lab05.check_int8, solution.quantize_int8, solution.dequantize_int8).startswith("✓")
    assert passes(lab05.check_int8, solution.quantize_int8, solution.dequantize_int8, cases=lab05.HIDDEN_INT8_CASES, seed=3)
    assert passes(lab05.check_int8, solution.quantize_int8, solution.dequantize_int8, cases=((9, 16),), zero_rows=True)
    assert passes(lab05.check_int8, solution.quantize_int8, solution.dequantize_int8, cases=((8, 24),), dtype=torch.bfloat16)
    assert passes(lab05.check_int4, solution.quantize_int4, solution.dequantize_int4).startswith("✓")
    assert passes(lab05.check_int4, solution.quantize_int4, solution.dequantize_int4, cases=lab05.HIDDEN_INT4_CASES, seed=4)
    assert passes(lab05.check_int4, solution.quantize_int4, solution.dequantize_int4, cases=((4, 64, 32),), constant_groups=True)
    assert passes(lab05.check_pack, solution.pack_int4, solution.unpack_int4).startswith("✓")
    assert passes(lab05.check_pack, solution.pack_int4, solution.unpack_int4, cases=lab05.HIDDEN_PACK_CASES)
    assert passes(lab05.check_salient_channels, solution.salient_channels).startswith("✓")
    assert passes(lab05.check_salient_channels, solution.salient_channels, cases=lab05.HIDDEN_SALIENT_CASES, seed=5)
    assert passes(lab05.check_kv_bytes_per_token, solution.kv_bytes_per_token).startswith("✓")
    assert passes(lab05.check_sequences_that_fit, solution.sequences_that_fit).startswith("✓")


def test_the_engine_quantizers_pass_the_checks_too(passes):
    """The checks compare with minillm.quant; the package's own functions must pass them (no check is stricter
    than the reference it quotes)."""
    assert passes(lab05.check_int8, ref_int8.quantize_int8, ref_int8.dequantize_int8, cases=((9, 16),), zero_rows=True)
    assert passes(lab05.check_int4, ref_int4.quantize_int4, ref_int4.dequantize_int4, constant_groups=True)
    assert passes(lab05.check_pack, ref_int4.pack_int4, ref_int4.unpack_int4)


def test_fake_quantize_matches_the_package():
    w = torch.randn(24, 256)
    torch.testing.assert_close(lab05.fake_quantize(w, 8), ref_int8.dequantize_int8(*ref_int8.quantize_int8(w)))
    for g in (32, 128):
        torch.testing.assert_close(lab05.fake_quantize(w, 4, g), ref_int4.dequantize_int4(*ref_int4.quantize_int4(w, g)))
    assert lab05.fake_quantize(w, 4, 32, offset=16).shape == w.shape


def test_solution_kernel_matches_the_reference(solution, passes):
    assert passes(lab05.check_int4_matmul, solution.int4_matmul, device=DEVICE).startswith("✓")
    assert passes(lab05.check_int4_matmul, solution.int4_matmul, cases=lab05.HIDDEN_KERNEL_CASES, seed=7, device=DEVICE)


def test_solution_kernel_compiles_for_sm80_and_sm90(solution):
    message = lab05.compile_kernel(solution.int4_matmul_kernel)
    assert "sm_80" in message and "sm_90" in message


def test_stub_kernel_raises_not_implemented(tmp_path):
    source = solution_source()
    start = source.index("    ### BEGIN SOLUTION\n    acc = tl.zeros")
    end = source.index("    ### END SOLUTION\n", start) + len("    ### END SOLUTION\n")
    path = tmp_path / "lab05_stub.py"
    path.write_text(source[:start] + "    # YOUR CODE HERE\n    raise NotImplementedError()\n" + source[end:])
    module = import_file(path, "lab05_stub")
    with pytest.raises(NotImplementedError):
        module.int4_matmul(*lab05.make_int4_inputs(1, 8, 32, 32), 32)
    with pytest.raises(NotImplementedError):
        lab05.compile_kernel(module.int4_matmul_kernel)


# --------------------------------------------------------------------- the checks teach
def _int8_variant(divisor=127, rounding=torch.round, per_tensor=False):
    def quantize(w):
        w = w.float()
        scale = (w.abs().max().expand(w.shape[0]) if per_tensor else w.abs().amax(dim=1)) / divisor
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        return rounding(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale
    return quantize


def test_int8_check_names_the_mistake():
    deq = ref_int8.dequantize_int8
    with pytest.raises(CheckFailed, match="divided by 128"):
        lab05.check_int8(_int8_variant(divisor=128), deq)
    with pytest.raises(CheckFailed, match="truncates"):
        lab05.check_int8(_int8_variant(rounding=lambda t: t), deq)
    with pytest.raises(CheckFailed, match="whole matrix"):
        lab05.check_int8(_int8_variant(per_tensor=True), deq)

    def no_zero_guard(w):
        scale = w.float().abs().amax(dim=1) / 127
        return torch.round(w.float() / scale[:, None]).nan_to_num(0).to(torch.int8), scale
    with pytest.raises(CheckFailed, match="0 / 0"):
        lab05.check_int8(no_zero_guard, deq, cases=((6, 8),), zero_rows=True)

    def per_column(w):
        scale = w.float().abs().amax(dim=0) / 127
        return torch.round(w.float() / scale[None, :]).to(torch.int8), scale
    with pytest.raises(CheckFailed, match="one per column"):
        lab05.check_int8(per_column, deq)


def test_int4_check_names_the_mistake():
    def integer_zero(w, g):
        q, scale, lo = ref_int4.quantize_int4(w, g)
        return q, scale, torch.round(-lo / scale)
    with pytest.raises(CheckFailed, match="integer zero point"):
        lab05.check_int4(integer_zero, ref_int4.dequantize_int4)

    def sixteen(w, g):
        n, k = w.shape
        groups = w.float().reshape(n, k // g, g)
        lo = groups.amin(2)
        scale = (groups.amax(2) - lo) / 16
        return torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, k), scale, lo
    with pytest.raises(CheckFailed, match="divided by 16"):
        lab05.check_int4(sixteen, ref_int4.dequantize_int4)

    def packed_already(w, g):
        q, scale, zero = ref_int4.quantize_int4(w, g)
        return ref_int4.pack_int4(q), scale, zero
    with pytest.raises(CheckFailed, match="unpacked"):
        lab05.check_int4(packed_already, ref_int4.dequantize_int4)


def test_pack_check_names_the_mistake():
    def swapped(q):
        return (q[:, 1::2] | (q[:, 0::2] << 4)).to(torch.uint8)
    with pytest.raises(CheckFailed, match="nibbles swapped"):
        lab05.check_pack(swapped, ref_int4.unpack_int4)

    def not_interleaved(packed):
        return torch.cat([packed & 0x0F, packed >> 4], dim=1)
    with pytest.raises(CheckFailed, match="interleave"):
        lab05.check_pack(ref_int4.pack_int4, not_interleaved)


def _kernel_with(**flags):
    def kernel(x, packed, scale, zero, group_size):
        return lab05.int4_matmul_reference(x, packed, scale, zero, group_size, **flags)
    return kernel


def test_kernel_check_names_the_mistake():
    with pytest.raises(CheckFailed, match="nibbles swapped"):
        lab05.check_int4_matmul(_kernel_with(high_first=True), device="cpu")
    with pytest.raises(CheckFailed, match="zero term"):
        lab05.check_int4_matmul(_kernel_with(no_zero=True), device="cpu")
    with pytest.raises(CheckFailed, match="group 0's scale"):
        lab05.check_int4_matmul(_kernel_with(scale_by_row=True), device="cpu")

    def drops_last_block(x, packed, scale, zero, group_size):
        y = lab05.int4_matmul_reference(x, packed, scale, zero, group_size)
        y[:, 32:] = float("nan")
        return y
    with pytest.raises(CheckFailed, match="never stored"):
        lab05.check_int4_matmul(drops_last_block, device="cpu")


def test_salient_check_names_the_mistake():
    with pytest.raises(CheckFailed, match="MEAN"):
        lab05.check_salient_channels(lambda x, f: x.abs().amax(0).topk(max(1, round(f * x.shape[1]))).indices)
    with pytest.raises(CheckFailed, match="magnitude"):
        lab05.check_salient_channels(lambda x, f: x.mean(0).topk(max(1, round(f * x.shape[1]))).indices)
    with pytest.raises(CheckFailed, match="percentage"):
        lab05.check_salient_channels(lambda x, f: x.abs().mean(0).topk(min(x.shape[1], round(f * 100))).indices)


def test_kv_checks_name_the_mistake():
    with pytest.raises(CheckFailed, match="K and V"):
        lab05.check_kv_bytes_per_token(lambda layers, kv, d, b: layers * kv * d * b)
    with pytest.raises(CheckFailed, match="floor division"):
        lab05.check_sequences_that_fit(lambda budget, n, per: budget / (n * per))


# --------------------------------------------------------------------- measurements on the real model
def test_q4_1_alignment_makes_group_32_nearly_lossless(default_llm, experiments):
    rows = {r["label"]: r for r in experiments["error_sweep"](lab05.layer_weight(default_llm, "layers.3.gate_up_proj"))}
    aligned, shifted, g128 = rows["int4 g32"], rows["int4 g32, shifted 16"], rows["int4 g128"]
    assert aligned["real"] < 0.1 * shifted["real"], rows      # the GGUF's blocks re-found
    assert aligned["random"] > 0.5 * shifted["random"]        # no such effect on a never-quantized matrix
    assert g128["real"] > aligned["real"] and g128["random"] > aligned["random"]


def test_kernel_in_the_engine_gives_the_reference_tokens(default_llm, solution, experiments):
    run_with_kernel = experiments["run_with_kernel"]
    int4_llm = default_llm.with_levers(weight_dtype="int4")
    result = run_with_kernel(int4_llm, solution.int4_matmul, ["The capital of France is"], 2, num_layers=1)
    assert result["equal_reference"] and result["hooked"] == 4 and result["calls"] == 8, result
    assert int4_llm.engine.runner.parts.quantized_matmul is None, "the kernel ran in engines of its own, not int4_llm"

    def broken(x, packed, scale, zero, group_size):
        return solution.int4_matmul(x, packed, scale, zero, group_size) * 0.0
    assert not run_with_kernel(int4_llm, broken, ["The capital of France is"], 2, num_layers=2)["equal_reference"]


def test_ablation_ranks_salient_above_random(default_llm, solution, experiments):
    corpus_ids = default_llm.tokenizer.encode("The lighthouse keeper climbed the stairs. " * 30)
    name = "layers.3.gate_up_proj"
    inputs = experiments["collect_linear_inputs"](default_llm, corpus_ids[:128], names=[name])
    rows = {r["label"]: r["output_error"] for r in
            experiments["layer_ablation"](lab05.layer_weight(default_llm, name), inputs[name], solution.salient_channels)}
    assert rows["1% salient kept fp32"] < rows["round-to-nearest"]
    assert rows["1% salient kept fp32"] < rows["1% random kept fp32"]
    before = default_llm.engine.model.get_submodule(name).weight.clone()
    ppl = experiments["ablation_perplexity"](default_llm, solution.salient_channels, inputs, corpus_ids, window=64,
                                             max_windows=1)
    assert torch.equal(default_llm.engine.model.get_submodule(name).weight, before), "weights must be restored"
    assert [r["label"] for r in ppl][0].startswith("fp32") and len(ppl) == 5


def test_kv_bytes_agree_with_the_engine_and_int8_halves(default_llm, solution, passes, experiments):
    assert passes(lab05.check_kv_bytes_per_token, solution.kv_bytes_per_token, default_llm).startswith("✓")
    rows = experiments["kv_table"](solution.kv_bytes_per_token, solution.sequences_that_fit)
    llama = {(r["model"], r["dtype"]): r for r in rows}
    assert llama[("Llama-3-8B (GQA 32:8)", "bf16")]["bytes_per_token"] == 131072
    assert llama[("Llama-3-8B (GQA 32:8)", "bf16")]["fit"] == 4 * llama[("Llama-3-8B as MHA (32:32)", "bf16")]["fit"]
    run = experiments["kv_int8_run"](default_llm, ["The capital of France is"], 2)
    if run["available"]:
        assert run["int8_bytes_per_token"] < run["bytes_per_token"] / 2


def test_weight_table_and_sweep_widget(default_llm, experiments):
    rows = {r["label"]: r for r in experiments["weight_table"](default_llm, {"fp32": {}, "int8": {"weight_dtype": "int8"},
                                                                             "int4 g128": {"weight_dtype": "int4"}},
                                                               bandwidth=1e10)}
    assert rows["int8"]["decode_bytes"] < 0.3 * rows["fp32"]["decode_bytes"]
    assert rows["int4 g128"]["decode_bytes"] < rows["int8"]["decode_bytes"]
    result = lab05.sweep(default_llm, ["fp32", "int8"], quick=True, decode_tokens=0, num_generations=0, progress=False)
    explorer = lab05.SettingExplorer(result)
    explorer.buttons.value = "fp32"
    assert explorer.current["label"] == "fp32" and "<b>fp32</b>" in explorer.label.value
    explorer.buttons.value = "int8"
    assert explorer.current["weight_bytes"] < 0.5 * result["rows"][0].weight_bytes
    assert list(explorer.figure.data[0].marker.color).count("#ef553b") == 1


def test_learned_rounding_runs_only_from_the_cache_or_when_asked(default_llm, tmp_path, monkeypatch, capsys):
    from minillm.models import quantize as quantize_module
    from minillm.models.calibrate import cache as cache_module

    monkeypatch.setattr(quantize_module, "calibration_cache_dir", lambda: tmp_path)   # what lab05 prints
    monkeypatch.setattr(cache_module, "calibration_cache_dir", lambda: tmp_path)      # where the cache is read
    calls = []
    monkeypatch.setattr(lab05, "sweep", lambda llm, labels, **kwargs: calls.append(tuple(labels)) or {"rows": []})
    assert lab05.learned_rounding(default_llm, run=True, quick=True) is None
    assert "Quick mode" in capsys.readouterr().out
    assert lab05.learned_rounding(default_llm) is None   # not cached, not asked: nothing runs
    out = capsys.readouterr().out
    assert str(tmp_path) in out and "RUN_AUTOROUND = True" in out and "minillm quality" in out
    assert calls == []
    assert lab05.learned_rounding(default_llm, run=True) == {"rows": []}
    model, tokenizer = default_llm.engine.model, default_llm.tokenizer
    path = quantize_module.autoround_cache_path(model, tokenizer, 128)
    assert path.parent == tmp_path
    path.write_bytes(b"")   # the entry the setting would read: now it runs without being asked
    assert lab05.learned_rounding(default_llm) == {"rows": []}
    assert calls == [lab05.ROUNDING_SWEEP] * 2
    assert all(label in lab05.SWEEP_SETTINGS for label in lab05.ROUNDING_SWEEP + lab05.FULL_SWEEP)


def test_kernel_run_and_timing_printouts(capsys):
    """The shared printouts (lab/common.py) with lab05's references: the fp32 reference must match, the
    engine's own int4 path may differ on a near tie."""
    run = {"tokens": [[1, 2]], "reference": [[1, 2]], "engine": [[1, 5]], "wall_s": 2.0, "calls": 8, "kernel_s": 0.4,
           "hooked": 4, "num_quantized": 210, "text": ["Paris"], "device": "cpu: test"}
    lab05.print_kernel_run(run)
    out = capsys.readouterr().out
    assert "✓ the same as the fp32 reference matmul's" in out and "≈ not the same as the engine's own int4 path's" in out
    assert "your kernel in 4 of the 210 int4 matmuls: 8 launches, 50 ms each" in out
    lab05.print_kernel_run({**run, "reference": [[7, 7]]})
    assert "✗ not the same as the fp32 reference matmul's: [[7, 7]]" in capsys.readouterr().out
    lab05.print_kernel_timing({"device": "GPU", "shape": "x [1, 4096]", "bandwidth": 4e12, "int4_bytes": 10_000_000,
                               "fp16_bytes": 40_000_000, "yours_s": 10e-6, "fp16_s": 20e-6})
    out = capsys.readouterr().out
    assert "yours: 10 µs  reads 10 MB (bound 2.5 µs) -> 1000 GB/s, 25% of the bound" in out
    assert "fp16: 20 µs  reads 40 MB (bound 10 µs) -> 2000 GB/s, 50% of the bound" in out


# --------------------------------------------------------------------- wrong answers: every graded cell can fail
# One line of the solution kernel changed (the usual slips), as {name: (old, new, occurrences)}.
KERNEL_SLIPS = {
    "swapped_nibbles": ("low = (byte & 0xF).to(tl.float32)\n        high = (byte >> 4).to(tl.float32)",
                        "low = (byte >> 4).to(tl.float32)\n        high = (byte & 0xF).to(tl.float32)", 1),
    "no_zero_term": ("acc += s * q_dot_x + z * tl.sum(x_even + x_odd, axis=0)", "acc += s * q_dot_x", 1),
    "group_0_scale": ("cols * num_groups + g, mask=is_col", "cols * num_groups, mask=is_col", 2),
    "no_row_offset": ("x_ptr + row * K + g * GROUP", "x_ptr + g * GROUP", 2),
    "skips_group_0": ("for g in range(0, num_groups):", "for g in range(1, num_groups):", 1),
}


@pytest.fixture(scope="module")
def wrong_kernels(tmp_path_factory) -> dict:
    """{slip: int4_matmul launching the solution kernel with that one slip}, each imported from its own file."""
    source, launchers = solution_source(), {}
    folder = tmp_path_factory.mktemp("lab05_wrong")
    for name, (old, new, count) in KERNEL_SLIPS.items():
        assert source.count(old) == count, f"the solution kernel changed: {old!r} is not there {count} time(s)"
        path = folder / f"lab05_{name}.py"
        path.write_text(source.replace(old, new))
        launchers[name] = import_file(path, f"lab05_{name}").int4_matmul
    return launchers


@pytest.fixture(scope="module")
def namespace(solution, default_llm, wrong_kernels) -> dict:
    """What the graded test cells read: the solution functions, the loaded model, the real layer and the
    measurement and short answer computed from them (their solution cells run here), int4_matmul_spec, and
    WRONG (the wrong kernels, for the mistakes' sources)."""
    ns = {key: value for key, value in vars(solution).items() if not key.startswith("__")}
    layer = "layers.3.gate_up_proj"
    ns.update(lab05=lab05, torch=torch, llm=default_llm, LAYER=layer, weight=lab05.layer_weight(default_llm, layer),
              WRONG=wrong_kernels, time=time, decode_timing=STUB_DECODE)
    ns.update(notebook_functions(MASTER, "int4_matmul_spec", torch=torch, lab05=lab05))
    for gid, (cell, meta) in nbgrader_cells(nbformat.read(MASTER, as_version=4)).items():
        if meta.get("solution") and gid.startswith(STATEFUL):
            exec(compile(cell.source, f"<master:{gid}>", "exec"), ns)
    return ns


INT8_BODY = """
def quantize_int8(w):
    w = w.float()
    scale = {scale}
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = {codes}.clamp(-127, 127).to(torch.int8)
    return q, scale
"""
INT4_BODY = """
def quantize_int4(w, group_size):
    n, k = w.shape
    groups = w.float().reshape(n, k // group_size, group_size)
    lo, hi = {lo}, groups.amax(dim=2)
    scale = (hi - lo) / {levels}
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((groups - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.uint8)
    return q.reshape(n, k), scale, {zero}
"""
MEASURE = """
layer_errors = {{label: {error} for label, w_hat in reconstructions.items()}}
int4_g64_over_int8 = {ratio}
"""

STUB_DECODE = {name: {"median_s": m, "min_s": m * 0.9, "max_s": m * 1.3, "tokens": 4, "tokens_per_s": 4 / m,
                      "speedup": 0.8 / m} for name, m in (("fp32", 0.8), ("int8", 0.5), ("int4 g128", 0.6))}


def _decode(stat: str = "statistics.median(samples)", warm: str = "range(warmup)", timed: str = "range(repeats)",
            start: str = "start = clock()", stop: str = "samples.append(clock() - start)",
            speedup: str = 'result[name]["tokens_per_s"] / result["fp32"]["tokens_per_s"]') -> str:
    """A time_decode with one piece changed (the solution with the defaults)."""
    return f"""import statistics
def time_decode(engines, prompt, params, warmup=1, repeats=5, clock=time.perf_counter):
    result = {{}}
    for name, engine in engines.items():
        for _ in {warm}:
            engine.generate(prompt, params, use_tqdm=False)
        samples = []
        for _ in {timed}:
            {start}
            outputs = engine.generate(prompt, params, use_tqdm=False)
            {stop}
        tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        median = {stat}
        result[name] = {{"median_s": median, "min_s": min(samples), "max_s": max(samples), "tokens": tokens,
                        "tokens_per_s": tokens / median}}
    for name in result:
        result[name]["speedup"] = {speedup}
    return result
"""


MISTAKES = {
    "test_measure_time_decode": [
        (_decode(warm="range(0)", timed="range(warmup + repeats)"), "warm-up included"),
        (_decode(stat="statistics.fmean(samples)"), "the mean"),
        (_decode(stat="min(samples)"), "the minimum"),
        (_decode(speedup='result["fp32"]["tokens_per_s"] / result[name]["tokens_per_s"]'), "inverted"),
        (_decode(start="start = time.perf_counter()", stop="samples.append(time.perf_counter() - start)"), "never read"),
    ],
    "test_int8": [
        (INT8_BODY.format(scale="w.abs().amax(dim=1) / 128", codes="torch.round(w / scale[:, None])"),
         "you divided by 128"),
        (INT8_BODY.format(scale="w.abs().amax(dim=1) / 127", codes="(w / scale[:, None])"),
         "truncates toward zero"),
        ("def quantize_int8(w):\n    scale = w.float().abs().max() / 127\n"
         "    return torch.round(w.float() / scale).clamp(-127, 127).to(torch.int8), scale\n",
         "one number for the whole matrix"),
        ("def dequantize_int8(q, scale):\n    return q.float() * scale.float()\n",   # forgot [:, None]
         "dequantize_int8(q, scale) after quantize_int8(w of shape (64, 128))"),
    ],
    "test_int4": [
        (INT4_BODY.format(lo="groups.amin(dim=2)", levels=16, zero="lo"), "you divided by 16"),
        (INT4_BODY.format(lo="groups.amin(dim=2)", levels=15, zero="torch.round(-lo / scale)"), "integer zero point"),
        (INT4_BODY.format(lo="w.float().amin(dim=1, keepdim=True).expand(n, k // group_size)", levels=15, zero="lo"),
         "the whole row's minimum"),
        ("def dequantize_int4(q, scale, zero):\n    n, k = q.shape\n    g = k // scale.shape[1]\n"
         "    return (q.float().reshape(n, -1, g) * scale[..., None] - zero[..., None]).reshape(n, k)\n",
         "w = q * scale + zero"),
    ],
    "test_pack": [
        ("def pack_int4(q):\n    q = q.to(torch.uint8)\n    return q[:, 1::2] | (q[:, 0::2] << 4)\n", "nibbles swapped"),
        ("def unpack_int4(packed):\n    return torch.cat([packed & 0x0F, packed >> 4], dim=1)\n", "interleave them back"),
        ("def pack_int4(q):\n    q = q.to(torch.uint8)\n    return q[:, 0::2] | (q[:, 1::2] << 8)\n",   # shifted a byte
         "pack_int4(q of shape (4, 8)): byte [0, 0]"),
    ],
    "test_measure_layer_errors": [
        (MEASURE.format(error="float((w_hat - weight).norm())", ratio='layer_errors["int4 g64"] / layer_errors["int8"]'),
         "divide by ||W||"),
        (MEASURE.format(error="float((w_hat - weight).abs().mean() / weight.abs().mean())",
                        ratio='layer_errors["int4 g64"] / layer_errors["int8"]'), "mean |W - Q(W)| / mean |W|"),
        (MEASURE.format(error="float((w_hat - weight).norm() / weight.norm())",
                        ratio='layer_errors["int8"] / layer_errors["int4 g64"]'), "divided the wrong way"),
        ('reconstructions["int4 g64"] = dequantize_int4(*quantize_int4(weight, 32))\n'   # the label and the group differ
         + MEASURE.format(error="float((w_hat - weight).norm() / weight.norm())",
                          ratio='layer_errors["int4 g64"] / layer_errors["int8"]'), "that is the error of int4 g32"),
    ],
    "test_int4_matmul_rows": [
        ('int4_matmul = WRONG["swapped_nibbles"]', "(one row, two groups)"),
        ('int4_matmul = WRONG["no_zero_term"]', "the zero term is missing"),
        ('int4_matmul = WRONG["group_0_scale"]', "every group used group 0's scale"),
    ],
    "test_int4_matmul_groups": [
        ('int4_matmul = WRONG["no_row_offset"]', "(three rows, three groups of 128)"),
        ('int4_matmul = WRONG["skips_group_0"]', "(three rows, three groups of 128)"),
        ('int4_matmul = WRONG["swapped_nibbles"]', "nibbles swapped"),
    ],
    "test_salient": [
        ("def salient_channels(x, fraction):\n    return x.abs().amax(dim=0).topk(max(1, round(fraction * x.shape[1]))).indices\n",
         "rank by the MEAN |x|"),
        ("def salient_channels(x, fraction):\n    return x.mean(dim=0).topk(max(1, round(fraction * x.shape[1]))).indices\n",
         "rank by |x| (magnitude)"),
        ("def salient_channels(x, fraction):\n    return x.abs().mean(dim=0).topk(round(fraction * 100)).indices\n",
         "fraction is already a share"),
    ],
    "test_kv_bytes": [
        ("def kv_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value):\n"
         "    return num_layers * num_kv_heads * head_dim * bytes_per_value\n", "K and V: both are cached"),
        ("def kv_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value):\n"   # counts values, not bytes
         "    return 2 * num_layers * num_kv_heads * head_dim\n", "kv_bytes_per_token(30, 3, 64, 4) returned 11520"),
    ],
    "test_sequences_fit": [
        ("def sequences_that_fit(budget_bytes, seq_len, bytes_per_token):\n"
         "    return budget_bytes / (seq_len * bytes_per_token)\n", "use floor division"),
        ("def sequences_that_fit(budget_bytes, seq_len, bytes_per_token):\n"
         "    return -(-budget_bytes // (seq_len * bytes_per_token))\n", "rounded up"),
        ("def sequences_that_fit(budget_bytes, seq_len, bytes_per_token):\n"
         "    return round(budget_bytes / (seq_len * bytes_per_token))\n", "sequences_that_fit(10, 1, 11) returned 1"),
    ],
    "test_answer_llama_fit": [
        ("answer_llama_fit = (20, 160)", "an fp32 scale per token and KV head"),
        ("answer_llama_fit = (155, 20)", "the order is (MHA in bf16, GQA in int8)"),
        ("answer_llama_fit = (20, 80)", "that is GQA in bf16"),
    ],
}


@pytest.mark.parametrize("grade_id, mistake, names_the_case",
                         [(gid, source, case) for gid, cases in MISTAKES.items() for source, case in cases],
                         ids=[f"{gid}-{i}" for gid, cases in MISTAKES.items() for i in range(len(cases))])
def test_graded_cell_fails_on_a_plausible_mistake(namespace, grade_id, mistake, names_the_case):
    assert_check_fails(MASTER, grade_id, namespace, mistake, names_the_case)


def test_decode_speed_printout_figure_and_questions(capsys):
    lab05.print_decode_speed(STUB_DECODE)
    lab05.print_explain_questions(STUB_DECODE)
    out = capsys.readouterr().out
    assert "int8 speed-up over fp32: yours 1.6" in out and "int8 at 1.60x" in out
    fig = lab05.decode_speed_figure(STUB_DECODE, "cpu: test device")
    assert len(fig.data) == 2 and list(fig.data[0].x) == ["fp32", "int8", "int4 g128"]
    lab05.print_explain_questions(None)

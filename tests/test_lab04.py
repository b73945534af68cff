"""Lab 04 (PagedAttention): the master's solutions pass every check (allocator against the engine's
BlockManager, max_concurrent, the Triton kernel under the interpreter and compiled for sm_80/sm_90),
the checks name each usual mistake, the engine runs on the learner's allocator and kernel with the
engine's own tokens, the waste measurement shows paging's gain, and the budget slider updates."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from kernel_utils import DEVICE  # first: picks the interpreter before triton is imported

import nbformat
import pytest
import torch

from lab_utils import import_file, nbgrader_cells, notebook_functions, solution_module_fixture, solution_source

from grading.build import REPO_ROOT, SOURCE_DIR
from minillm.lab import lab04
from minillm.lab.common import CheckFailed, figure_subtitle

MASTER = SOURCE_DIR / "04_paged_attention" / "04_paged_attention.ipynb"
MODULE_HEADER = """\
import os
import torch
import triton
import triton.language as tl
from minillm.lab import lab04
BLOCK_SIZE = 16
"""


LAUNCHER = "def paged_decode("  # the code cell that launches the kernel, kept with the solution cells
solution = solution_module_fixture(MASTER, MODULE_HEADER, LAUNCHER, "lab04_solution")


@pytest.fixture(scope="module")
def experiments() -> dict:
    """The experiments the notebook writes in its own cells (not in minillm.lab.lab04), as functions."""
    return notebook_functions(MASTER, "run_with_allocator", "measure_waste", "run_with_kernel", "block_size_tradeoff")


def test_master_has_every_graded_piece_with_hidden_tests():
    nb = nbformat.read(MASTER, as_version=4)
    meta = nbgrader_cells(nb)
    for name in ("BlockAllocator", "max_concurrent", "paged_decode_kernel"):
        assert meta[name][1]["solution"] and "### BEGIN SOLUTION" in meta[name][0].source
    graded = {gid: m for gid, (c, m) in meta.items() if m.get("grade")}
    assert set(graded) == {"test_allocate_slot", "test_append", "test_free", "test_fork", "test_allocator_vs_engine",
                           "test_max_concurrent", "test_paged_decode_blocks", "test_paged_decode_gqa"}
    for gid in graded:
        assert "### BEGIN HIDDEN TESTS" in meta[gid][0].source, f"{gid} has no hidden tests"
        assert graded[gid]["locked"] and graded[gid]["points"] > 0
    assert sum(m["points"] for m in graded.values()) == 14
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            assert cell.metadata["nbgrader"]["locked"], f"markdown cell {cell.id} is editable"
    assert 'QUICK = os.environ.get("MINILLM_QUICK") == "1"' in nb.cells[1].source
    # The interpreter must be chosen before the notebook imports triton.
    setup = nb.cells[2].source
    assert setup.index('os.environ["TRITON_INTERPRET"] = "1"') < setup.index("import triton")


def test_student_kernel_keeps_the_signature_and_pointer_comments():
    student = nbformat.read(REPO_ROOT / "labs" / "04_paged_attention.ipynb", as_version=4)
    kernel = next(c.source for c in student.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "paged_decode_kernel")
    for pointer in ("out_ptr,", "q_ptr,", "k_cache_ptr,", "v_cache_ptr,", "block_tables_ptr,", "seq_lens_ptr,"):
        line = next(line for line in kernel.splitlines() if line.strip().startswith(pointer))
        assert "# [" in line, f"{pointer} has no shape comment"
    assert "raise NotImplementedError()" in kernel and "tl.store" not in kernel


# --------------------------------------------------------------------- the solutions pass
def test_solution_allocator_passes_every_check(solution, passes):
    cls = solution.BlockAllocator
    assert passes(lab04.check_allocate_and_slot, cls).startswith("✓")
    assert passes(lab04.check_append, cls).startswith("✓")
    assert passes(lab04.check_free, cls).startswith("✓")
    assert passes(lab04.check_fork, cls).startswith("✓")
    for seed, num_blocks, block_size in ((0, 24, 4), (1, 7, 16), (2, 64, 1), (3, 12, 3)):
        assert passes(lab04.check_against_engine, cls, seed=seed, num_blocks=num_blocks, block_size=block_size).startswith("✓")


def test_solution_max_concurrent_and_reference_agree(solution, passes):
    assert passes(lab04.check_max_concurrent, solution.max_concurrent).startswith("✓")
    # Paging never fits fewer requests than contiguous reservation, for lengths within max_model_len.
    for budget in range(0, 5000, 97):
        lengths = [40 + (i * 37) % 400 for i in range(30)]
        assert (lab04.reference_max_concurrent(budget, lengths, 512, 16, True)
                >= lab04.reference_max_concurrent(budget, lengths, 512, 16, False))


def test_solution_kernel_matches_the_reference_on_scattered_poisoned_pools(solution, passes):
    assert passes(lab04.check_paged_decode, solution.paged_decode, device=DEVICE).startswith("✓")
    assert passes(lab04.check_paged_decode, solution.paged_decode, cases=lab04.HIDDEN_KERNEL_CASES, device=DEVICE).startswith("✓")


def test_solution_kernel_agrees_with_the_engine_kernel_and_spec(solution):
    from minillm.kernels.paged_decode import paged_decode_attention_reference

    q, k, v, tables, lens = lab04.make_paged_inputs([3, 40, 16], 3, 3, 64, 16, seed=5, device=DEVICE)
    ours = solution.paged_decode(q, k, v, tables, lens, 0.125, 16)
    engine = paged_decode_attention_reference(q, k, v, tables, lens, 0.125, 16)
    torch.testing.assert_close(ours.cpu(), engine.cpu(), atol=1e-5, rtol=1e-5)


def test_stub_kernel_raises_not_implemented(tmp_path):
    source = solution_source(MASTER, MODULE_HEADER, LAUNCHER)
    start, end = source.index("    ### BEGIN SOLUTION\n    row_max"), source.index("    ### END SOLUTION\n", source.index("row_max"))
    stubbed = source[:start] + "    # YOUR CODE HERE\n    raise NotImplementedError()\n" + source[end + len("    ### END SOLUTION\n"):]
    path = tmp_path / "lab04_stub.py"
    path.write_text(stubbed)
    module = import_file(path, "lab04_stub")
    with pytest.raises(NotImplementedError):
        module.paged_decode(*lab04.make_paged_inputs([3], 1, 1, 64, 16), 0.125, 16)


def test_solution_kernel_compiles_for_sm80_and_sm90(tmp_path):
    """What the interpreter forgives (types of loop-carried values, shapes) fails here, without a GPU."""
    path = tmp_path / "lab04_aot.py"
    path.write_text(solution_source(MASTER, MODULE_HEADER, LAUNCHER))
    script = textwrap.dedent(f"""
        import importlib.util
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        import triton
        spec = importlib.util.spec_from_file_location("lab04_aot", {str(path)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for dtype in ("fp32", "bf16", "fp16"):
            sig = {{"out_ptr": "*" + dtype, "q_ptr": "*" + dtype, "k_cache_ptr": "*" + dtype, "v_cache_ptr": "*" + dtype,
                   "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "scale": "fp32", "num_heads": "i32",
                   "num_slots": "i32", "max_blocks": "i32", "GROUP": "constexpr", "HEAD_DIM": "constexpr",
                   "BLOCK_SIZE": "constexpr"}}
            for cc in (80, 90):
                triton.compile(ASTSource(fn=module.paged_decode_kernel, signature=sig,
                                         constexprs={{"GROUP": 3, "HEAD_DIM": 64, "BLOCK_SIZE": 16}}),
                               target=GPUTarget("cuda", cc, 32))
        print("compiled")
    """)
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


# --------------------------------------------------------------------- the checks teach
class FloorAllocator:
    def __init__(self, num_blocks, block_size):
        self.block_size, self.free_list = block_size, list(range(num_blocks))

    @property
    def num_free_blocks(self):
        return len(self.free_list)

    def allocate(self, num_tokens):
        return [self.free_list.pop() for _ in range(num_tokens // self.block_size)]


def _variant(solution, **methods):
    return type("Variant", (solution.BlockAllocator,), methods)


def test_allocator_checks_name_the_mistake(solution):
    with pytest.raises(CheckFailed, match="floor division"):
        lab04.check_allocate_and_slot(FloorAllocator)
    contiguous_slot = _variant(solution, slot=lambda self, table, p: table[0] * self.block_size + p)
    with pytest.raises(CheckFailed, match="contiguous run"):
        lab04.check_allocate_and_slot(contiguous_slot)

    def new_list_append(self, table, num_tokens):
        grown = list(table)
        solution.BlockAllocator.append(self, grown, num_tokens)
        return grown
    with pytest.raises(CheckFailed, match="in place"):
        lab04.check_append(_variant(solution, append=new_list_append))

    def no_refcount_free(self, table):
        for block in table:
            if block not in self.free_blocks:
                self.free_blocks.append(block)
    with pytest.raises(CheckFailed, match="double free"):
        lab04.check_free(_variant(solution, free=no_refcount_free))
    with pytest.raises(CheckFailed, match="count owners"):
        lab04.check_fork(_variant(solution, fork=lambda self, table: list(table)))


def test_random_operations_catch_a_leak(solution):
    def leaky_free(self, table):  # forgets the last block of every table
        solution.BlockAllocator.free(self, table[:-1])
    with pytest.raises(CheckFailed, match="engine's BlockManager has"):
        lab04.check_against_engine(_variant(solution, free=leaky_free), seed=0)


def test_max_concurrent_check_names_the_mistake():
    def unrounded(budget, lengths, max_model_len, block_size, paged):
        return min(len(lengths), budget // max_model_len) if not paged else lab04.reference_max_concurrent(
            budget, lengths, max_model_len, block_size, True)
    with pytest.raises(CheckFailed, match="whole blocks"):
        lab04.check_max_concurrent(unrounded)

    def greedy(budget, lengths, max_model_len, block_size, paged):  # skips over a request that does not fit
        if not paged:
            return lab04.reference_max_concurrent(budget, lengths, max_model_len, block_size, False)
        free, count = budget // block_size, 0
        for n in lengths:
            if -(-n // block_size) <= free:
                free -= -(-n // block_size)
                count += 1
        return count
    with pytest.raises(CheckFailed, match="first come"):
        lab04.check_max_concurrent(greedy)


def _reference_with(**kwargs):
    def kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size):
        return lab04.paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, kwargs.get("scale", scale),
                                            block_size, kv_head_of=kwargs.get("kv_head_of"))
    return kernel


def test_kernel_check_names_the_mistake():
    with pytest.raises(CheckFailed, match="h // 3"):
        lab04.check_paged_decode(_reference_with(kv_head_of=lambda h, kv, g: h % kv))
    with pytest.raises(CheckFailed, match="scale"):
        lab04.check_paged_decode(_reference_with(scale=1.0))

    def forgets_a_head(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size):
        out = lab04.paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size)
        out[0, 0] = float("nan")  # what the NaN-filled output keeps where a kernel stores nothing
        return out
    with pytest.raises(CheckFailed, match="never stored"):
        lab04.check_paged_decode(forgets_a_head)

    def unmasked(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size):  # reads whole last blocks
        rounded = (seq_lens + block_size - 1) // block_size * block_size
        return lab04.paged_decode_reference(q, k_cache, v_cache, block_tables, rounded, scale, block_size)
    with pytest.raises(CheckFailed, match="NaN: your kernel read a slot"):
        lab04.check_paged_decode(unmasked)

    def no_rescale(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size):  # only the last block counts
        out = lab04.paged_decode_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, block_size)
        for s, n in enumerate(seq_lens.tolist()):
            if n > block_size:
                out[s] += 1.0
        return out
    with pytest.raises(CheckFailed, match="online softmax"):
        lab04.check_paged_decode(no_rescale)


# --------------------------------------------------------------------- the real engine
def test_engine_runs_on_the_learner_allocator_with_the_same_tokens(default_llm, solution, experiments):
    def block_manager(num_blocks, block_size, contiguous):   # the notebook's factory
        return lab04.AllocatorBlockManager(solution.BlockAllocator(num_blocks, block_size), num_blocks, block_size)

    result = experiments["run_with_allocator"](default_llm, block_manager, ["The capital of France is", "1, 2, 3,"],
                                               max_tokens=5, pool_blocks=5, block_size=4)
    assert result["equal"], result
    assert result["free_after"] == result["pool_blocks"] == 5
    assert result["allocator_calls"] > 4 and result["peak_used_blocks"] == 5


def test_engine_runs_the_learner_kernel_with_the_torch_backend_tokens(default_llm, solution, experiments):
    result = experiments["run_with_kernel"](default_llm, solution.paged_decode, ["The capital of France is"], 2)
    assert result["equal"] and result["kernel_calls"] == default_llm.model_config.num_layers, result


def test_waste_measurement_shows_paging_wins_and_the_slider_updates(default_llm, solution, experiments):
    prompts = [{"prompt_token_ids": list(range(100, 120))}, {"prompt_token_ids": list(range(200, 230))}]
    waste = experiments["measure_waste"](default_llm, prompts, max_tokens=2, max_model_len=64, budget_tokens=64,
                                         block_size=16)
    contiguous, paged = waste["contiguous (paged=False)"], waste["paged (paged=True)"]
    assert contiguous["tokens"] == paged["tokens"]
    assert contiguous["stats"].peak_running == 1 and paged["stats"].peak_running == 2
    assert contiguous["stats"].kv_utilization < paged["stats"].kv_utilization <= 1.0
    assert figure_subtitle(lab04.waste_figure(waste)).startswith("measured on")
    lengths = paged["lengths"]
    assert lengths == [22, 32]
    explorer = lab04.ConcurrencyExplorer(solution.max_concurrent, lengths, 64, 16, default_llm.kv_bytes_per_token,
                                         measured=waste, device="test device")
    explorer.slider.value = 64
    assert explorer.current == {"budget_tokens": 64, "paged": 2, "contiguous": 1}
    assert "<b>2</b>" in explorer.label.value and list(explorer.figure.data[-1].x) == [64, 64]
    explorer.slider.value = 32
    assert explorer.current["paged"] == 1 and explorer.current["contiguous"] == 0 and "∞" in explorer.label.value


def test_block_size_tradeoff_counts_last_block_waste(experiments):
    rows = {r["block_size"]: r for r in experiments["block_size_tradeoff"]([1, 16, 17], block_sizes=(1, 16))}
    assert rows[1]["wasted_slots"] == 0 and rows[1]["blocks"] == 34
    assert rows[16]["blocks"] == 4 and rows[16]["wasted_slots"] == 64 - 34


def test_kernel_run_and_timing_printouts(capsys):
    """The shared printouts (lab/common.py) with lab04's references, on a CPU result and a GPU one."""
    run = {"tokens": [[1, 2]], "expected": [[1, 3]], "equal": False, "wall_s": 3.2, "kernel_calls": 60, "kernel_s": 1.2,
           "text": ["Paris"], "device": "cpu: test"}
    lab04.print_kernel_run(run)
    out = capsys.readouterr().out
    assert "✗ not the same as the torch backend's: [[1, 3]]" in out and "60 launches, 20 ms each" in out
    lab04.print_kernel_run({**run, "expected": [[1, 2]], "equal": True})
    assert "✓ the same as the torch backend's" in capsys.readouterr().out
    lab04.print_kernel_timing({"device": "cpu"})
    assert "No GPU here" in capsys.readouterr().out
    kv = 50_000_000
    lab04.print_kernel_timing({"device": "GPU", "shape": "32 seqs", "kv_bytes": kv, "bandwidth": 4e12, "bound_s": kv / 4e12,
                               "yours_s": 50e-6, "engine_s": 12.5e-6})
    out = capsys.readouterr().out
    assert "yours: 50 µs  reads 50 MB (bound 12.5 µs) -> 1000 GB/s, 25% of the bound" in out
    assert "engine: 12.5 µs" in out and "100% of the bound" in out

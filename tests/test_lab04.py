"""Lab 04 (PagedAttention): the master's solutions pass every check (allocator against the engine's
BlockManager, max_concurrent, the Triton kernel under the interpreter and compiled for sm_80/sm_90),
the checks name each usual mistake, the engine runs on the learner's allocator and kernel with the
engine's own tokens, the waste measurement shows paging's gain, and the budget slider updates."""

from __future__ import annotations

import textwrap
import time

from kernel_utils import DEVICE, assert_compiles_for_gpus  # first: picks the interpreter before triton is imported

import nbformat
import pytest
import torch

from lab_utils import (assert_check_fails, import_file, nbgrader_cells, notebook_functions, solution_module_fixture,
                       solution_source)

from grading.build import REPO_ROOT, SOURCE_DIR
from minillm.lab import lab04
from minillm.lab.common import CheckFailed, figure_subtitle

MASTER = SOURCE_DIR / "04_paged_attention" / "04_paged_attention.ipynb"
MODULE_HEADER = """\
import os
import time
import torch
import triton
import triton.language as tl
from minillm.lab import lab04
BLOCK_SIZE = 16
waste = {"paged (paged=True)": {"lengths": [49, 51, 47]}}   # the answer cell reads section 3's measured lengths
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
    for name in ("BlockAllocator", "measure_kv_utilization", "answer_utilization_8192", "max_concurrent",
                 "paged_decode_kernel", "measure_time_batch"):
        assert meta[name][1]["solution"] and "### BEGIN SOLUTION" in meta[name][0].source
    graded = {gid: m for gid, (c, m) in meta.items() if m.get("grade")}
    assert set(graded) == {"test_allocate_slot", "test_append", "test_free", "test_fork", "test_allocator_vs_engine",
                           "test_measure_kv_utilization", "test_answer_utilization_8192", "test_max_concurrent",
                           "test_paged_decode_blocks", "test_paged_decode_gqa", "test_measure_time_batch"}
    for gid in graded:
        assert "### BEGIN HIDDEN TESTS" in meta[gid][0].source, f"{gid} has no hidden tests"
        assert graded[gid]["locked"] and graded[gid]["points"] > 0
    assert sum(m["points"] for m in graded.values()) == 19
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "### BEGIN MODEL ANSWER" not in cell.source:  # the answers cell is theirs
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
    jobs = [("paged_decode_kernel",
             {"out_ptr": "*" + dtype, "q_ptr": "*" + dtype, "k_cache_ptr": "*" + dtype, "v_cache_ptr": "*" + dtype,
              "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "scale": "fp32", "num_heads": "i32",
              "num_slots": "i32", "max_blocks": "i32", "GROUP": "constexpr", "HEAD_DIM": "constexpr",
              "BLOCK_SIZE": "constexpr"},
             {"GROUP": 3, "HEAD_DIM": 64, "BLOCK_SIZE": 16}) for dtype in ("fp32", "bf16", "fp16")]
    assert_compiles_for_gpus(path, jobs)


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


# --------------------------------------------------------------------- the learner's measurement and answer
BYTES_PER_TOKEN = 46_080   # bytes of KV per token (SmolLM2, fp32): the stub's records are in whole tokens
STUB_LENGTHS = [49, 51, 47]
STUB_STEPS = {  # (tokens used, tokens reserved, num_running, num_seqs) after each step: 3 requests, 1024 slots
    "contiguous (paged=False)": [(90, 1024, 2, 2), (92, 1024, 2, 2), (94, 1024, 2, 2), (47, 512, 1, 1),
                                 (48, 512, 1, 1), (0, 0, 0, 0)],
    "paged (paged=True)": [(141, 160, 3, 3), (144, 160, 3, 3), (147, 160, 3, 3), (0, 0, 0, 0)],
}


def stub_waste() -> dict:
    """What measure_waste returns, as far as the measurement and answer cells read it (no engine run)."""
    from minillm.engine.metrics import RunStats

    waste = {"_meta": {"max_model_len": 512, "budget_tokens": 1024, "block_size": 16, "bytes_per_token": BYTES_PER_TOKEN,
                       "num_requests": 3, "max_tokens": 4, "device": "stub"}}
    for label, rows in STUB_STEPS.items():
        steps = lab04._steps([(u * BYTES_PER_TOKEN, r * BYTES_PER_TOKEN, running, seqs) for u, r, running, seqs in rows])
        waste[label] = {"paged": label.startswith("paged"), "lengths": list(STUB_LENGTHS),
                        "stats": RunStats(device="stub", hourly_usd=0.0, steps=steps)}
    return waste


def test_solution_measurement_and_answer_pass(solution, passes):
    waste = stub_waste()
    assert passes(lab04.check_kv_measurement, solution.kv_utilization, solution.peak_at_once, waste).startswith("✓")
    for label in STUB_STEPS:
        stats = waste[label]["stats"]
        assert solution.kv_utilization(stats.steps) == pytest.approx(stats.kv_utilization)   # the engine's own
        assert solution.peak_at_once(stats.steps) == max(s.num_running for s in stats.steps)
    assert passes(lab04.check_answer_utilization_8192, sum(STUB_LENGTHS) / (3 * 8192), STUB_LENGTHS, 512).startswith("✓")


# --------------------------------------------------------------------- wrong answers, cell by cell
LAUNCHER_SOURCE = next(c.source for c in nbformat.read(MASTER, as_version=4).cells
                       if c.cell_type == "code" and c.source.startswith(LAUNCHER))
KERNEL_LINE = {  # a wrong kernel: the solution with one line changed (old, new)
    "no_rescale": [("row_sum = row_sum * correction + ", "row_sum = row_sum + "), ("acc = acc * correction + ", "acc = acc + ")],
    "mask_off_by_one": [("is_token = positions < seq_len", "is_token = positions <= seq_len")],
    "first_sequence_table": [("tl.load(block_tables_ptr + seq * max_blocks + b)", "tl.load(block_tables_ptr + b)")],
    "no_scale": [("tl.sum(k * q[None, :], axis=1) * scale", "tl.sum(k * q[None, :], axis=1)")],
    "no_kv_base": [("tile = kv_base + (block", "tile = (block")],
    "store_at_kv_head": [("tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM", "tl.store(out_ptr + (seq * num_heads + kv_head) * HEAD_DIM")],
}


def kernel_mistake(name: str) -> str:
    """The learner's notebook with a wrong kernel: the kernel cell, then the launcher cell, re-run."""
    return f"paged_decode_kernel = WRONG[{name!r}]\n{LAUNCHER_SOURCE}"


def subclass(body: str) -> str:
    return "class BlockAllocator(BlockAllocator):\n" + textwrap.indent(textwrap.dedent(body), "    ")


STUB_BATCH = {"contiguous": {"median_s": 2.0, "min_s": 1.9, "max_s": 2.5, "tokens": 12, "tokens_per_s": 6.0},
              "paged": {"median_s": 1.2, "min_s": 1.1, "max_s": 1.4, "tokens": 12, "tokens_per_s": 10.0},
              "speedup": 10.0 / 6.0}


def _batch(stat: str = "statistics.median(samples)", warm: str = "range(warmup)", timed: str = "range(repeats)",
           start: str = "start = clock()", stop: str = "samples.append(clock() - start)",
           ratio: str = 'result["paged"]["tokens_per_s"] / result["contiguous"]["tokens_per_s"]',
           send: str = "prompts") -> str:
    """A time_batch with one piece changed (the solution with the defaults)."""
    return f"""import statistics
def time_batch(engines, prompts, params, warmup=1, repeats=3, clock=time.perf_counter):
    result = {{}}
    for name in ("contiguous", "paged"):
        for _ in {warm}:
            engines[name].generate({send}, params, use_tqdm=False)
        samples = []
        for _ in {timed}:
            {start}
            outputs = engines[name].generate({send}, params, use_tqdm=False)
            {stop}
        tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        median = {stat}
        result[name] = {{"median_s": median, "min_s": min(samples), "max_s": max(samples), "tokens": tokens,
                        "tokens_per_s": tokens / median}}
    result["speedup"] = {ratio}
    return result
"""


MISTAKES = {
    "test_measure_time_batch": [
        (_batch(warm="range(0)", timed="range(warmup + repeats)"), "warm-up included"),
        (_batch(stat="statistics.fmean(samples)"), "the mean"),
        (_batch(stat="min(samples)"), "the minimum"),
        (_batch(ratio='result["contiguous"]["tokens_per_s"] / result["paged"]["tokens_per_s"]'), "inverted"),
        (_batch(start="start = time.perf_counter()", stop="samples.append(time.perf_counter() - start)"), "never read"),
        (_batch(send="prompts[0]"), "each with the whole batch"),
    ],
    "test_allocate_slot": [
        (subclass("""
            def allocate(self, num_tokens):   # floor division: the partly filled last block is missing
                table = []
                for _ in range(num_tokens // self.block_size):
                    block = self.free_blocks.pop()
                    self.ref_count[block] = 1
                    table.append(block)
                return table
        """), "floor division"),
        (subclass("""
            def slot(self, table, position):   # as if the table were one contiguous run
                return table[0] * self.block_size + position
        """), "contiguous run"),
        (subclass("""
            def allocate(self, num_tokens):   # takes blocks before checking there are enough
                table = []
                for _ in range(-(-num_tokens // self.block_size)):
                    block = self.free_blocks.pop()
                    self.ref_count[block] = 1
                    table.append(block)
                return table
        """), "allocate(17)"),
        (subclass("""
            def slot(self, table, position):   # checks only the upper end: slot(table, -1) reads table[-1]
                if position >= len(table) * self.block_size:
                    raise IndexError(position)
                return table[position // self.block_size] * self.block_size + position % self.block_size
        """), ", -1)"),
    ],
    "test_append": [
        (subclass("""
            def append(self, table, num_tokens):   # returns a grown copy; the engine's list never grows
                return super().append(list(table), num_tokens)
        """), "in place"),
        (subclass("""
            def append(self, table, num_tokens):   # forgets the blocks the table already holds
                for _ in range(-(-num_tokens // self.block_size)):
                    block = self.free_blocks.pop()
                    self.ref_count[block] = 1
                    table.append(block)
                return table
        """), "append(table, 4)"),
        (subclass("""
            def append(self, table, num_tokens):   # one block per call, however many tokens arrived
                if len(table) * self.block_size < num_tokens:
                    block = self.free_blocks.pop()
                    self.ref_count[block] = 1
                    table.append(block)
                return table
        """), "13 tokens need 4 blocks"),
    ],
    "test_free": [
        (subclass("""
            def free(self, table):   # no double-free check: counts go below 0
                for block in table:
                    self.ref_count[block] -= 1
                    if self.ref_count[block] == 0:
                        self.free_blocks.append(block)
        """), "double free"),
        (subclass("""
            def free(self, table):   # checks each block as it goes: a refused free has already freed some
                for block in table:
                    if self.ref_count[block] < 1:
                        raise ValueError(f"block {block} is already free")
                    self.ref_count[block] -= 1
                    if self.ref_count[block] == 0:
                        self.free_blocks.append(block)
        """), "before changing any"),
        (subclass("""
            def free(self, table):   # counts down but never returns a block to the pool
                if any(self.ref_count[block] < 1 for block in table):
                    raise ValueError(table)
                for block in table:
                    self.ref_count[block] -= 1
        """), "goes back to the pool"),
    ],
    "test_fork": [
        (subclass("""
            def fork(self, table):   # a copy of the table, but no new owner counted
                return list(table)
        """), "count owners"),
        (subclass("""
            def fork(self, table):   # counts the owner, returns the same list
                super().fork(table)
                return table
        """), "same list object"),
        (subclass("""
            def free(self, table):   # returns every block at once, whatever its count
                if any(self.ref_count[block] < 1 for block in table):
                    raise ValueError(table)
                for block in table:
                    self.ref_count[block] -= 1
                    self.free_blocks.append(block)
        """), "count owners"),
    ],
    "test_allocator_vs_engine": [
        (subclass("""
            def free(self, table):   # leaks the last block of every table
                super().free(table[:-1])
        """), "engine's BlockManager has"),
        (subclass("""
            def slot(self, table, position):   # forgets that a block holds block_size slots
                return table[position // self.block_size] + position % self.block_size
        """), "slot(["),
        (subclass("""
            def fork(self, table):   # shares the blocks without counting the new owner
                return list(table)
        """), "engine's BlockManager has"),
    ],
    "test_measure_kv_utilization": [
        ("""
def kv_utilization(steps):   # total used / total reserved: the big steps weigh more
    reserved = sum(s.kv_bytes_reserved for s in steps)
    return sum(s.kv_bytes_used for s in steps) / reserved if reserved else float("nan")
""", "total used / total reserved"),
        ("""
def kv_utilization(steps):   # counts a step that reserved nothing as 0 % full
    if not steps:
        return float("nan")
    return sum(s.kv_bytes_used / s.kv_bytes_reserved if s.kv_bytes_reserved else 0.0 for s in steps) / len(steps)
""", "skip the steps that reserved nothing"),
        ("""
def kv_utilization(steps):   # divides by zero on a step that reserved nothing
    return sum(s.kv_bytes_used / s.kv_bytes_reserved for s in steps) / len(steps)
""", "ZeroDivisionError"),
        ("""
def peak_at_once(steps):   # how many hold KV after the last step
    return steps[-1].num_running if steps else 0
""", "after the last step"),
        ("""
def peak_at_once(steps):   # sequences stepped, not sequences holding KV
    return max((s.num_seqs for s in steps), default=0)
""", "num_seqs counts"),
    ],
    "test_answer_utilization_8192": [
        ("answer_utilization_8192 = sum(lengths) / (len(lengths) * MAX_MODEL_LEN)   # this lab's max_model_len",
         "max_model_len=512"),
        ("answer_utilization_8192 = 100 * sum(lengths) / (len(lengths) * 8192)   # a percentage", "percentage"),
        ("answer_utilization_8192 = sum(lengths) / 8192   # one reservation for all", "len(lengths) * 8192"),
    ],
    "test_max_concurrent": [
        ("""
def max_concurrent(budget_tokens, lengths, max_model_len, block_size, paged):   # reservations not rounded to blocks
    if not paged:
        return min(len(lengths), budget_tokens // max_model_len)
    return lab04.reference_max_concurrent(budget_tokens, lengths, max_model_len, block_size, True)
""", "whole blocks"),
        ("""
def max_concurrent(budget_tokens, lengths, max_model_len, block_size, paged):   # skips a request that does not fit
    if not paged:
        return lab04.reference_max_concurrent(budget_tokens, lengths, max_model_len, block_size, False)
    free, count = budget_tokens // block_size, 0
    for n in lengths:
        if -(-n // block_size) <= free:
            free -= -(-n // block_size)
            count += 1
    return count
""", "first come"),
        ("""
def max_concurrent(budget_tokens, lengths, max_model_len, block_size, paged):   # forgets there are only so many
    budget_blocks = budget_tokens // block_size
    if not paged:
        return budget_blocks // -(-max_model_len // block_size)
    return lab04.reference_max_concurrent(budget_tokens, lengths, max_model_len, block_size, True)
""", "never more than len(lengths)"),
        ("""
def max_concurrent(budget_tokens, lengths, max_model_len, block_size, paged):   # paged in tokens, not whole blocks
    if not paged:
        return lab04.reference_max_concurrent(budget_tokens, lengths, max_model_len, block_size, False)
    count = used = 0
    for n in lengths:
        used += n
        if used > budget_tokens:
            break
        count += 1
    return count
""", "paged=True)"),
    ],
    "test_paged_decode_blocks": [
        (kernel_mistake("no_rescale"), "online softmax"),
        (kernel_mistake("mask_off_by_one"), "NaN: your kernel read a slot"),
        (kernel_mistake("first_sequence_table"), "block_tables[seq, b]"),
    ],
    "test_paged_decode_gqa": [
        (kernel_mistake("no_kv_base"), "every query head read KV head 0"),
        (kernel_mistake("store_at_kv_head"), "never stored"),
        (kernel_mistake("no_scale"), "multiplied by `scale`"),
    ],
}


@pytest.fixture(scope="module")
def wrong_kernels(tmp_path_factory) -> dict:
    """Each KERNEL_LINE variant of the solution kernel, imported from its own file (Triton reads the source)."""
    source = solution_source(MASTER, MODULE_HEADER, LAUNCHER)
    folder = tmp_path_factory.mktemp("lab04_wrong")
    kernels = {}
    for name, changes in KERNEL_LINE.items():
        wrong = source
        for old, new in changes:
            assert wrong.count(old) == 1, (name, old)
            wrong = wrong.replace(old, new)
        path = folder / f"lab04_{name}.py"
        path.write_text(wrong)
        kernels[name] = import_file(path, f"lab04_{name}").paged_decode_kernel
    return kernels


@pytest.fixture(scope="module")
def namespace(solution, wrong_kernels) -> dict:
    """The notebook's state when the graded cells run: the solution cells (imported from a file, for the kernel),
    the launcher and the torch spec, and a stub of section 3's measurement."""
    cells = nbgrader_cells(nbformat.read(MASTER, as_version=4))
    ns = {name: value for name, value in vars(solution).items() if not name.startswith("__")}
    ns.update(lab04=lab04, torch=torch, BLOCK_SIZE=16, MAX_MODEL_LEN=512, waste=stub_waste(), WRONG=wrong_kernels,
              time=time, batch_timing=STUB_BATCH)
    ns.update(notebook_functions(MASTER, "paged_decode_spec", torch=torch))
    exec(compile(LAUNCHER_SOURCE, "<launcher>", "exec"), ns)   # its globals are ns: the kernel is looked up there
    exec(compile(cells["answer_utilization_8192"][0].source, "<answer>", "exec"), ns)   # lengths from the stub
    return ns


@pytest.mark.parametrize("grade_id,mistake,names_the_case",
                         [(g, m, c) for g, cases in MISTAKES.items() for m, c in cases],
                         ids=[f"{g}-{i}" for g, cases in MISTAKES.items() for i in range(len(cases))])
def test_graded_cell_fails_on_a_plausible_mistake(namespace, grade_id, mistake, names_the_case):
    assert_check_fails(MASTER, grade_id, namespace, mistake, names_the_case)


def test_throughput_printout_figure_and_questions(capsys):
    lab04.print_throughput(STUB_BATCH)
    lab04.print_explain_questions({"paged": 0.9, "contiguous": 0.1}, {"paged": 3, "contiguous": 1}, STUB_BATCH)
    out = capsys.readouterr().out
    assert "paged over contiguous, tokens/s: yours 1.67" in out and "90%" in out and "1.67x the tokens/s" in out
    fig = lab04.throughput_figure(STUB_BATCH, "cpu: test device")
    assert len(fig.data) == 2 and list(fig.data[0].x) == ["contiguous", "paged"]
    lab04.print_explain_questions(None, None, None)

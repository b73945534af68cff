"""Lab 07 (speculative decoding): the master's solutions pass every check; the checks name each usual
mistake (no bonus token, the guess kept at a disagreement, verifying past it, the earliest or the
shortest n-gram match, a replacement drawn from p instead of the residual, no bonus draw, k terms for
k + 1, a chi-square test with the wrong degrees of freedom, a speed-up divided the wrong way); every
graded test cell fails on two or more plausible mistakes (MISTAKES, run by lab_utils.assert_check_fails);
the engine runs on the learner's functions with speculation-off tokens and gets its own back
afterwards; the toy reproduces three rounds / twelve tokens / three passes; the sweep and its
figures come out right on a tiny run."""

from __future__ import annotations

import math
import re
import time

from kernel_utils import DEVICE, assert_compiles_for_gpus  # first: picks the interpreter before triton is imported

import nbformat
import pytest
import torch

from lab_utils import (assert_check_fails, import_file, nbgrader_cells, notebook_functions, solution_source)

from grading.build import REPO_ROOT, SOURCE_DIR
from minillm.lab import lab07
from minillm.lab.common import CheckFailed, figure_subtitle

MASTER = SOURCE_DIR / "07_speculative_decoding" / "07_speculative_decoding.ipynb"
EXERCISES = {"greedy_verify", "ngram_propose", "rejection_sample", "measure_chi_square", "expected_tokens_per_pass",
             "answer_tokens_limit", "measure_spec_rates", "accept_length_kernel", "measure_time_speculation"}
MODULE_HEADER = """\
import os
import time
import torch
import triton
import triton.language as tl
from minillm import SamplingParams
from minillm.lab import lab07
"""
LAUNCHER = "def accept_lengths("   # the code cell that launches the kernel, kept with the solution cells
LAUNCHER_SOURCE = next(c.source for c in nbformat.read(MASTER, as_version=4).cells
                       if c.cell_type == "code" and c.source.startswith(LAUNCHER))


@pytest.fixture(scope="module")
def solution_module(tmp_path_factory):
    """The master's solution cells and the kernel's launcher, imported from a file (Triton reads the kernel's source)."""
    path = tmp_path_factory.mktemp("lab07_solution") / "lab07_solution.py"
    path.write_text(solution_source(MASTER, MODULE_HEADER, LAUNCHER))
    return import_file(path, "lab07_solution")


@pytest.fixture(scope="module")
def solution(solution_module) -> dict:
    """The master's solution cells' names, as one namespace."""
    return {name: value for name, value in vars(solution_module).items() if not name.startswith("__")}


@pytest.fixture(scope="module")
def experiments() -> dict:
    """The experiments the notebook defines in its own cells (the toy, the engine on the learner's functions)."""
    return notebook_functions(MASTER, "toy_rounds", "run_plugged", "run_sampled", "run_with_kernel")


@pytest.fixture(scope="module")
def llm():
    from minillm import LLM

    return LLM()


def test_master_has_every_graded_piece_with_hidden_tests():
    nb = nbformat.read(MASTER, as_version=4)
    meta = nbgrader_cells(nb)
    for name in EXERCISES:
        assert meta[name][1]["solution"] and "### BEGIN SOLUTION" in meta[name][0].source
    graded = {gid: m for gid, (c, m) in meta.items() if m.get("grade")}
    assert set(graded) == {"test_greedy_verify", "test_greedy_verify_edges", "test_ngram_propose", "test_ngram_edges",
                           "test_engine_plugged", "test_rejection_sample_corners", "test_rejection_sample_chi_square",
                           "test_measure_chi_square", "test_expected_tokens_per_pass", "test_answer_tokens_limit",
                           "test_measure_spec_rates", "test_accept_lengths", "test_accept_lengths_edges",
                           "test_engine_kernel", "test_measure_time_speculation"}
    for gid in graded:
        assert "### BEGIN HIDDEN TESTS" in meta[gid][0].source, f"{gid} has no hidden tests"
        assert graded[gid]["locked"] and graded[gid]["points"] > 0
    assert sum(m["points"] for m in graded.values()) == 25 and "**Graded (25 points)**" in nb.cells[0].source
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "BEGIN MODEL ANSWER" not in cell.source:
            assert cell.metadata["nbgrader"]["locked"], f"markdown cell {cell.id} is editable"
    assert 'QUICK = os.environ.get("MINILLM_QUICK") == "1"' in nb.cells[1].source
    setup = nb.cells[2].source   # the interpreter must be chosen before the notebook imports triton
    assert setup.index('os.environ["TRITON_INTERPRET"] = "1"') < setup.index("import triton")
    assert nb.metadata["minillm"]["kernels"] == {"accept_length_kernel": ["accept_length_kernel"]}


def test_student_copy_has_stubs_and_no_solution():
    student = nbformat.read(REPO_ROOT / "labs" / "07_speculative_decoding.ipynb", as_version=4)
    stubs = {c.metadata["nbgrader"]["grade_id"]: c.source for c in student.cells
             if c.metadata.get("nbgrader", {}).get("solution")}
    assert set(stubs) == EXERCISES
    for gid, source in stubs.items():
        assert "raise NotImplementedError()" in source, gid
    assert "clamp_min" not in stubs["rejection_sample"]


# --------------------------------------------------------------------- the solutions pass
def test_solution_passes_every_check(solution):
    for seed in (0, 1, 2, 3):
        lab07.check_greedy_verify(solution["greedy_verify"], seed=seed)
    lab07.check_greedy_verify_edges(solution["greedy_verify"])
    for seed in (0, 5, 6, 7):
        lab07.check_ngram_propose(solution["ngram_propose"], seed=seed)
    lab07.check_ngram_edges(solution["ngram_propose"])
    lab07.check_rejection_sample_shape(solution["rejection_sample"])
    lab07.check_rejection_sample(solution["rejection_sample"])
    lab07.check_rejection_sample(solution["rejection_sample"], seed=7, vocab=8, k=2)
    lab07.check_rejection_sample(solution["rejection_sample"], seed=8, vocab=5, k=4, far=False)
    lab07.check_expected_tokens_per_pass(solution["expected_tokens_per_pass"])
    lab07.check_chi_square_test(solution["chi_square_test"],
                                lab07.chi_square_report(solution["rejection_sample"], num_rounds=500))
    lab07.check_answer_tokens_limit(solution["answer_tokens_limit"])
    lab07.check_spec_rates(solution["spec_rates"], STUB_SWEEP)
    for seed in (0, 11, 12):
        lab07.check_accept_lengths(solution["accept_lengths"], seed=seed, device=DEVICE)
    lab07.check_accept_lengths(solution["accept_lengths"], cases=lab07.VERIFY_EDGE_CASES, device=DEVICE)
    lab07.check_time_speculation(solution["time_speculation"])
    lab07.check_time_speculation(solution["time_speculation"], warmup=3, repeats=3, seed=9)


def test_chi_square_test_solution_matches_the_reference_p_value(solution):
    for counts, probs in (([520, 240, 240], [0.5, 0.25, 0.25]), ([5, 5, 0], [0.5, 0.5, 0.0]), ([90, 10], [0.5, 0.5])):
        stat, p_value = solution["chi_square_test"](torch.tensor(counts), torch.tensor(probs))
        assert p_value == pytest.approx(lab07.chi_square_p_value(torch.tensor(counts), torch.tensor(probs)), rel=1e-9)
        assert stat >= 0
    assert solution["chi_square_test"](torch.tensor([5, 5, 1]), torch.tensor([0.5, 0.5, 0.0])) == (float("inf"), 0.0)


# --------------------------------------------------------------------- the checks name mistakes
def _no_bonus(proposal, target):
    out = []
    for g, t in zip(proposal, target):
        out.append(t)
        if g != t:
            return out
    return out


def _keeps_guess(proposal, target):
    out = []
    for g, t in zip(proposal, target):
        out.append(g)
        if g != t:
            return out
    return out + [target[-1]]


def _verifies_past_disagreement(proposal, target):
    return [t for g, t in zip(proposal, target)] + [target[-1]]


@pytest.mark.parametrize("wrong, words", [(_no_bonus, "bonus"), (_keeps_guess, "not the proposal's"),
                                          (_verifies_past_disagreement, "stop at the first disagreement")])
def test_greedy_checks_name_the_mistake(wrong, words):
    with pytest.raises(CheckFailed, match=words):
        lab07.check_greedy_verify(wrong)
    with pytest.raises(CheckFailed):
        lab07.check_greedy_verify_edges(wrong)


def test_ngram_checks_name_the_mistake():
    with pytest.raises(CheckFailed, match="most recent"):
        lab07.check_ngram_propose(lab07._variant_first_occurrence)
    with pytest.raises(CheckFailed, match="max_n first"):
        lab07.check_ngram_propose(lab07._variant_shortest_first)

    def unclipped(token_ids, k, max_n=3, min_n=1):
        return lab07.ref_ngram_propose(token_ids, k + 1, max_n, min_n)

    with pytest.raises(CheckFailed, match="at most k"):
        lab07.check_ngram_edges(unclipped)

    def self_match(token_ids, k, max_n=3, min_n=1):   # the tail matches itself first: nothing follows it
        return []

    with pytest.raises(CheckFailed, match="a match exists"):
        lab07.check_ngram_propose(self_match)


def test_rejection_checks_name_the_mistake(solution):
    with pytest.raises(CheckFailed, match="draws the replacement from p itself"):
        lab07.check_rejection_sample(lab07.skip_correction_sample)

    def inverted(proposal, q, p, generator=None):   # accepts with q/p instead of p/q
        out = []
        for i, x in enumerate(proposal):
            if torch.rand(1, generator=generator).item() < min(1.0, (q[i][x] / p[i][x]).item()):
                out.append(x)
                continue
            r = (p[i] - q[i]).clamp_min(0)
            out.append(int(torch.multinomial(r / r.sum(), 1, generator=generator)))
            return out
        return out + [int(torch.multinomial(p[len(proposal)], 1, generator=generator))]

    with pytest.raises(CheckFailed, match="chi-square"):
        lab07.check_rejection_sample(inverted)

    def no_bonus(proposal, draft_probs, target_probs, generator=None):
        out = solution["rejection_sample"](proposal, draft_probs, target_probs, generator)
        return out[:len(proposal)] if len(out) == len(proposal) + 1 and proposal else out

    with pytest.raises(CheckFailed, match="bonus"):
        lab07.check_rejection_sample_shape(no_bonus)

    def keeps_going(proposal, draft_probs, target_probs, generator=None):   # appends after a rejection
        out = solution["rejection_sample"](proposal, draft_probs, target_probs, generator)
        return out + [proposal[0]] if len(out) <= len(proposal) and proposal else out

    with pytest.raises(CheckFailed):
        lab07.check_rejection_sample(keeps_going, num_rounds=200)


def test_expected_tokens_check_names_the_mistake():
    with pytest.raises(CheckFailed, match="k \\+ 1"):
        lab07.check_expected_tokens_per_pass(lambda a, k: sum(a ** i for i in range(k)))
    with pytest.raises(CheckFailed, match="target's own token"):
        lab07.check_expected_tokens_per_pass(lambda a, k: sum(a ** i for i in range(1, k + 1)))


def test_chi_square_p_value():
    probs = torch.tensor([0.5, 0.25, 0.25])
    assert lab07.chi_square_p_value(torch.tensor([500, 250, 250]), probs) == pytest.approx(1.0)
    assert lab07.chi_square_p_value(torch.tensor([600, 200, 200]), probs) < 1e-6
    # chi-square with 2 degrees of freedom: survival function exp(-x / 2)
    counts = torch.tensor([520, 240, 240])
    x = 20 ** 2 / 500 + 2 * 10 ** 2 / 250
    assert lab07.chi_square_p_value(counts, probs) == pytest.approx(math.exp(-x / 2), rel=1e-6)
    assert lab07.chi_square_p_value(torch.tensor([5, 5, 1]), torch.tensor([0.5, 0.5, 0.0])) == 0.0


# --------------------------------------------------------------------- the engine
def test_toy_reproduces_three_rounds_twelve_tokens_three_passes(llm, experiments, capsys):
    toy = experiments["toy_rounds"](llm, k=3, rounds=3)
    assert toy["passes"] == 3 and toy["emitted"] == 12 and len(toy["tokens"]) == 13
    assert [len(r["kept"]) for r in toy["rounds"]] == [4, 4, 4]
    lab07.print_toy(toy)
    assert "12 tokens from 3 target passes" in capsys.readouterr().out


def test_engine_on_the_solution_and_restored_afterwards(llm, solution, experiments):
    from minillm.speculative import ngram, verify

    before = (ngram.ngram_propose, verify.greedy_verify, verify.rejection_sample)
    result = experiments["run_plugged"](llm, solution["greedy_verify"], solution["ngram_propose"],
                                        [lab07.repeat_prompt(llm), lab07.open_prompt(llm)], k=3, max_tokens=10)
    assert result["equal"] and result["record"]["verify_calls"] > 0 and result["accepted"] > 0
    lab07.check_plugged(result)
    assert (ngram.ngram_propose, verify.greedy_verify, verify.rejection_sample) == before
    with pytest.raises(RuntimeError), lab07.plugged(verify=_no_bonus):
        raise RuntimeError("boom")
    assert (ngram.ngram_propose, verify.greedy_verify, verify.rejection_sample) == before


def test_engine_with_a_wrong_verifier_fails_the_check(llm, solution, experiments):
    result = experiments["run_plugged"](llm, _verifies_past_disagreement, solution["ngram_propose"],
                                        [lab07.open_prompt(llm)], k=4, max_tokens=12)
    assert not result["equal"]
    with pytest.raises(CheckFailed, match="they part at output token"):
        lab07.check_plugged(result)


def test_engine_samples_with_the_learner_sampler(llm, solution, experiments):
    out = experiments["run_sampled"](llm, solution["rejection_sample"], lab07.repeat_prompt(llm), k=3, max_tokens=8)
    assert out["calls"] > 0 and out["text"]


def test_sweep_and_figures(llm, solution, capsys):
    raw = lab07.sweep(llm, [("ngram", 1), ("ngram", 3)], num_requests=1, max_tokens=8)
    lab07.print_runs(raw)
    lab07.check_spec_rates(solution["spec_rates"], raw)   # the learner's rates, recomputed from the raw counters
    result = lab07.sweep_rows(raw, solution["spec_rates"])
    rows = result["rows"]
    assert [r["k"] for r in rows] == [0, 1, 3]
    assert all(r["identical"] == 1 for r in rows)
    assert rows[0]["speedup"] == pytest.approx(1.0) and rows[0]["pass_cost"] == pytest.approx(1.0)
    assert 1.0 <= rows[2]["tokens_per_pass"] <= 4.0 and 0.0 <= rows[2]["acceptance_rate"] <= 1.0
    lab07.print_sweep(result)
    assert "ngram k=3" in capsys.readouterr().out
    device = "cpu: test device"
    fig = lab07.sweep_figure(result, device)
    assert device in figure_subtitle(fig) and list(fig.data[0].text) == ["k=1", "k=3"]
    fig2 = lab07.tokens_per_pass_figure(result, device, solution["expected_tokens_per_pass"])
    assert len(fig2.data) == 4 and device in figure_subtitle(fig2)


def test_distribution_figure(solution):
    report = lab07.chi_square_report(solution["rejection_sample"], num_rounds=300)
    wrong = lab07.chi_square_report(lab07.skip_correction_sample, num_rounds=300)
    fig = lab07.distribution_figure(report, wrong)
    assert len(fig.data) == 4 and list(fig.data[0].y) == pytest.approx(report["rows"][0]["target"])


# --------------------------------------------------------------------- every graded cell fails on plausible mistakes
# A stub of lab07.sweep's result (its raw counters, as the engine reports them: emitted == decode_tokens).
_OFF = {"label": "off", "method": None, "k": 0, "decode_s": 1.2, "decode_tokens": 23, "passes": 0, "emitted": 0,
        "proposed": 0, "accepted": 0, "identical": 1, "outputs": [[1] * 24]}
STUB_SWEEP = {"device": "cpu: stub", "num_requests": 1, "output_tokens": 24, "runs": [
    _OFF,
    dict(_OFF, label="ngram k=1", method="ngram", k=1, decode_s=0.9, passes=14, emitted=23, proposed=14, accepted=9),
    dict(_OFF, label="ngram k=2", method="ngram", k=2, decode_s=0.8, passes=10, emitted=23, proposed=20, accepted=13),
    dict(_OFF, label="ngram k=4", method="ngram", k=4, decode_s=0.85, passes=8, emitted=23, proposed=32, accepted=15)]}

_ENGINE_PROMPTS = "[lab07.repeat_prompt(llm), lab07.open_prompt(llm)]"
KERNEL_PROMPTS = lambda llm: [lab07.repeat_prompt(llm), lab07.open_prompt(llm)]   # noqa: E731
STUB_TIMING = {"off": {"median_s": 2.0, "min_s": 1.9, "max_s": 2.4, "tokens": 32, "tokens_per_s": 16.0},
               "on": {"median_s": 1.0, "min_s": 0.9, "max_s": 1.3, "tokens": 32, "tokens_per_s": 32.0}, "speedup": 2.0}

KERNEL_LINE = {  # a wrong kernel: the solution with one line changed (old, new)
    "sum_matches": [("first_miss = tl.min(tl.where(valid & (guess != target), cols, n), axis=0)",
                     "first_miss = tl.sum((valid & (guess == target)).to(tl.int32), axis=0)")],
    "no_length_mask": [("valid = cols < n", "valid = cols < K"), ("cols, n), axis=0)", "cols, K), axis=0)")],
    "wrong_stride": [("target_ptr + seq * (K + 1) + cols", "target_ptr + seq * K + cols")],
    "sentinel_k": [("cols, n), axis=0)", "cols, K), axis=0)")],
    "sentinel_zero": [("cols, n), axis=0)", "cols, 0), axis=0)")],
    "always_zero": [("tl.store(out_ptr + seq, first_miss)", "tl.store(out_ptr + seq, first_miss * 0)")],
}


def kernel_mistake(name: str, rerun: str = "") -> str:
    """The learner's notebook with a wrong kernel: the kernel cell, then the launcher cell (and `rerun`), re-run."""
    return f"accept_length_kernel = WRONG[{name!r}]\n{LAUNCHER_SOURCE}\n{rerun}"


_RERUN_KERNEL = "kernel_run = run_with_kernel(llm, accept_lengths, " + _ENGINE_PROMPTS + ", k=4, max_tokens=8)\n"


def _harness(samples_line: str = "samples.append(clock() - start)", stat: str = "statistics.median(samples)",
             ratio: str = 'result["on"]["tokens_per_s"] / result["off"]["tokens_per_s"]',
             start: str = "start = clock()", timed: str = "range(repeats)", warm: str = "range(warmup)") -> str:
    """A time_speculation with one piece changed (the solution with the defaults)."""
    return f"""import statistics
def time_speculation(engines, prompts, params, warmup=1, repeats=5, clock=time.perf_counter):
    result = {{}}
    for name in ("off", "on"):
        engine = engines[name]
        for _ in {warm}:
            engine.generate(prompts, params, use_tqdm=False)
        samples = []
        for _ in {timed}:
            {start}
            outputs = engine.generate(prompts, params, use_tqdm=False)
            {samples_line}
        tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        median = {stat}
        result[name] = {{"median_s": median, "min_s": min(samples), "max_s": max(samples), "tokens": tokens,
                        "tokens_per_s": tokens / median}}
    result["speedup"] = {ratio}
    return result
"""

MISTAKES = {
    "test_greedy_verify": [
        ("""def greedy_verify(proposal, target_argmax):   # forgets the bonus token
    kept = []
    for guess, target in zip(proposal, target_argmax):
        kept.append(target)
        if guess != target:
            return kept
    return kept
""", "bonus"),
        ("""def greedy_verify(proposal, target_argmax):   # keeps the guess, not the target's token, at the disagreement
    kept = []
    for guess, target in zip(proposal, target_argmax):
        kept.append(guess)
        if guess != target:
            return kept
    return kept + [target_argmax[len(proposal)]]
""", "not the proposal's"),
        ("""def greedy_verify(proposal, target_argmax):   # verifies past the first disagreement
    return [t for g, t in zip(proposal, target_argmax)] + [target_argmax[len(proposal)]]
""", "stop at the first disagreement"),
    ],
    "test_greedy_verify_edges": [
        ("""def greedy_verify(proposal, target_argmax):   # the bonus read from the loop variable: none when k = 0
    kept = []
    for i in range(len(proposal)):
        kept.append(target_argmax[i])
        if proposal[i] != target_argmax[i]:
            return kept
    return kept + [target_argmax[i + 1]]
""", "greedy_verify([], [7]) raised UnboundLocalError"),
        ("""def greedy_verify(proposal, target_argmax):   # 1-based: compares g_i with target_argmax[i + 1]
    kept = []
    for i, guess in enumerate(proposal):
        if guess != target_argmax[i + 1]:
            return kept + [target_argmax[i + 1]]
        kept.append(guess)
    return kept + [target_argmax[-1]]
""", "greedy_verify([1, 2, 3], [9, 2, 3, 4])"),
        ("""def greedy_verify(proposal, target_argmax):   # keeps every agreeing guess, even after a disagreement
    kept = [g for g, t in zip(proposal, target_argmax) if g == t]
    return kept + [target_argmax[len(kept)]]
""", "greedy_verify([1, 2, 3], [9, 2, 3, 4])"),
    ],
    "test_ngram_propose": [
        ("ngram_propose = lab07._variant_first_occurrence   # the earliest occurrence\n", "most recent"),
        ("ngram_propose = lab07._variant_shortest_first   # short n-grams first\n", "max_n first"),
        ("""def ngram_propose(token_ids, k, max_n=3, min_n=1):   # the tail matches itself: nothing follows it
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = token_ids[length - n:]
        for start in range(length - n, -1, -1):
            if token_ids[start:start + n] == tail:
                return list(token_ids[start + n:start + n + k])
    return []
""", "a match exists"),
    ],
    "test_ngram_edges": [
        ("""def ngram_propose(token_ids, k, max_n=3, min_n=1):   # the match may not overlap the tail
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = token_ids[length - n:]
        for start in range(length - 2 * n, -1, -1):
            if token_ids[start:start + n] == tail:
                return list(token_ids[start + n:start + n + k])
    return []
""", "overlapping"),
        ("""def ngram_propose(token_ids, k, max_n=3, min_n=1):   # off by one: k + 1 tokens
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = token_ids[length - n:]
        for start in range(length - n - 1, -1, -1):
            if token_ids[start:start + n] == tail:
                return list(token_ids[start + n:start + n + k + 1])
    return []
""", "at most k"),
        ("""def ngram_propose(token_ids, k, max_n=3, min_n=1):   # ignores min_n
    length = len(token_ids)
    for n in range(min(max_n, length - 1), 0, -1):
        tail = token_ids[length - n:]
        for start in range(length - n - 1, -1, -1):
            if token_ids[start:start + n] == tail:
                return list(token_ids[start + n:start + n + k])
    return []
""", "min_n = 2"),
    ],
    "test_engine_plugged": [
        ("""def greedy_verify(proposal, target_argmax):   # keeps the guess at the disagreement
    kept = []
    for guess, target in zip(proposal, target_argmax):
        kept.append(guess)
        if guess != target:
            return kept
    return kept + [target_argmax[len(proposal)]]
plug_run = run_plugged(llm, greedy_verify, ngram_propose, """ + _ENGINE_PROMPTS + """, k=4, max_tokens=12)
""", "they part at output token"),
        ("""def ngram_propose(token_ids, k, max_n=3, min_n=1):   # proposes the match itself, not what followed it
    length = len(token_ids)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        tail = token_ids[length - n:]
        for start in range(length - n - 1, -1, -1):
            if token_ids[start:start + n] == tail:
                return list(token_ids[start:start + min(n, k)])
    return []
plug_run = run_plugged(llm, greedy_verify, ngram_propose, """ + _ENGINE_PROMPTS + """, k=4, max_tokens=12)
""", "no proposed token was accepted"),
        ("plug_run = None   # the run cell was not run\n", "run the cell above"),
    ],
    "test_rejection_sample_corners": [
        ("""def rejection_sample(proposal, draft_probs, target_probs, generator=None):   # no bonus draw
    kept = []
    for i, x in enumerate(proposal):
        p, q = target_probs[i], draft_probs[i]
        u = torch.rand(1, generator=generator).item()
        if q[x] > 0 and u < min(1.0, (p[x] / q[x]).item()):
            kept.append(int(x))
            continue
        residual = (p - q).clamp_min(0)
        residual = residual / residual.sum() if residual.sum() > 0 else p
        kept.append(int(torch.multinomial(residual, 1, generator=generator)))
        return kept
    return kept or [int(torch.multinomial(target_probs[0], 1, generator=generator))]
""", "bonus"),
        ("""def rejection_sample(proposal, draft_probs, target_probs, generator=None):   # no q(x) = 0 guard
    kept = []
    for i, x in enumerate(proposal):
        p, q = target_probs[i], draft_probs[i]
        u = torch.rand(1, generator=generator).item()
        if u < min(1.0, (p[x] / q[x]).item()):
            kept.append(int(x))
            continue
        residual = (p - q).clamp_min(0)
        kept.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return kept
    kept.append(int(torch.multinomial(target_probs[len(proposal)], 1, generator=generator)))
    return kept
""", "the residual sums to zero"),
        ("""def rejection_sample(proposal, draft_probs, target_probs, generator=None):   # goes on after a rejection
    kept = []
    for i, x in enumerate(proposal):
        p, q = target_probs[i], draft_probs[i]
        u = torch.rand(1, generator=generator).item()
        if q[x] > 0 and u < min(1.0, (p[x] / q[x]).item()):
            kept.append(int(x))
            continue
        residual = (p - q).clamp_min(0)
        residual = residual / residual.sum() if residual.sum() > 0 else p
        kept.append(int(torch.multinomial(residual, 1, generator=generator)))
    kept.append(int(torch.multinomial(target_probs[len(proposal)], 1, generator=generator)))
    return kept
""", "rejected at once"),
    ],
    "test_rejection_sample_chi_square": [
        ("rejection_sample = lab07.skip_correction_sample   # replacement drawn from p\n",
         "draws the replacement from p itself"),
        ("""def rejection_sample(proposal, draft_probs, target_probs, generator=None):   # accepts with q/p, not p/q
    kept = []
    for i, x in enumerate(proposal):
        p, q = target_probs[i], draft_probs[i]
        if p[x] > 0 and torch.rand(1, generator=generator).item() < min(1.0, (q[x] / p[x]).item()):
            kept.append(int(x))
            continue
        residual = (p - q).clamp_min(0)
        kept.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return kept
    kept.append(int(torch.multinomial(target_probs[len(proposal)], 1, generator=generator)))
    return kept
""", "chi-square test at position"),
        ("""def rejection_sample(proposal, draft_probs, target_probs, generator=None):   # accepts with p(x), forgets q
    kept = []
    for i, x in enumerate(proposal):
        p, q = target_probs[i], draft_probs[i]
        if torch.rand(1, generator=generator).item() < p[x].item():
            kept.append(int(x))
            continue
        residual = (p - q).clamp_min(0)
        kept.append(int(torch.multinomial(residual / residual.sum(), 1, generator=generator)))
        return kept
    kept.append(int(torch.multinomial(target_probs[len(proposal)], 1, generator=generator)))
    return kept
""", "chi-square test at position"),
    ],
    "test_measure_chi_square": [
        ("""def chi_square_test(counts, probs):   # degrees of freedom = the vocabulary size
    counts, probs = counts.double(), probs.double()
    keep = probs > 0
    if counts[~keep].sum() > 0:
        return float("inf"), 0.0
    expected = probs * counts.sum()
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = len(counts)
    return float(statistic), float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))
""", "degrees of freedom"),
        ("""def chi_square_test(counts, probs):   # divides by the observed counts
    counts, probs = counts.double(), probs.double()
    keep = probs > 0
    if counts[~keep].sum() > 0:
        return float("inf"), 0.0
    expected = probs * counts.sum()
    statistic = ((counts[keep] - expected[keep]) ** 2 / counts[keep]).sum()
    df = int(keep.sum()) - 1
    return float(statistic), float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))
""", "divide by the expected count"),
        ("""def chi_square_test(counts, probs):   # gammaincc(df, x): forgets both halves
    counts, probs = counts.double(), probs.double()
    keep = probs > 0
    if counts[~keep].sum() > 0:
        return float("inf"), 0.0
    expected = probs * counts.sum()
    statistic = ((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(statistic), float(torch.special.gammaincc(torch.tensor(float(df), dtype=torch.float64), statistic))
""", "both halved"),
        ("""def chi_square_test(counts, probs):   # forgets the tokens of probability 0
    counts, probs = counts.double(), probs.double()
    expected = probs * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    df = len(counts) - 1
    return float(statistic), float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), statistic / 2))
""", "probability 0"),
    ],
    "test_expected_tokens_per_pass": [
        ("""def expected_tokens_per_pass(alpha, k):   # k terms, not k + 1
    return float(sum(alpha ** i for i in range(k)))
""", "k + 1"),
        ("""def expected_tokens_per_pass(alpha, k):   # the accepted guesses only
    return float(sum(alpha ** i for i in range(1, k + 1)))
""", "target's own token"),
        ("""def expected_tokens_per_pass(alpha, k):   # the closed form, which divides by zero at alpha = 1
    return (1 - alpha ** (k + 1)) / (1 - alpha)
""", "expected_tokens_per_pass(1.0, 5) raised ZeroDivisionError"),
    ],
    "test_answer_tokens_limit": [
        ("answer_tokens_limit = 4.0   # alpha / (1 - alpha): the accepted guesses only\n", "only the accepted guesses"),
        ("answer_tokens_limit = float('inf')   # more guesses, more tokens\n", "does not grow without bound"),
        ("answer_tokens_limit = 1 / 0.8   # 1 / alpha\n", "1 / (1 - alpha)"),
    ],
    "test_accept_lengths": [
        (kernel_mistake("sum_matches"), "stop at the first disagreement"),
        (kernel_mistake("no_length_mask"), "padding past num_proposed"),
        (kernel_mistake("wrong_stride"), "K + 1 entries"),
    ],
    "test_accept_lengths_edges": [
        (kernel_mistake("sentinel_k"), "num_proposed=[0, 0, 0]"),
        (kernel_mistake("no_length_mask"), "num_proposed=[0, 0, 0]"),
        (kernel_mistake("sentinel_zero"), "the sentinel of the min"),
    ],
    "test_engine_kernel": [
        (kernel_mistake("always_zero", _RERUN_KERNEL), "no proposed token was accepted"),
        ("kernel_run = None   # the run cell was not run\n", "run the cell above"),
        (kernel_mistake("sum_matches", "kernel_run = dict(kernel_run, tokens=[t[:3] + [0] + t[4:] for t in kernel_run['tokens']])\n"),
         "they part at output token 3"),
    ],
    "test_measure_time_speculation": [
        (_harness(warm="range(0)", timed="range(warmup + repeats)"), "warm-up included"),
        (_harness(stat="statistics.fmean(samples)"), "the mean"),
        (_harness(stat="min(samples)"), "the minimum"),
        (_harness(ratio='result["off"]["tokens_per_s"] / result["on"]["tokens_per_s"]'), "inverted"),
        (_harness(start="start = time.perf_counter()", samples_line="samples.append(time.perf_counter() - start)"),
         "never read"),
    ],
    "test_measure_spec_rates": [
        ("""def spec_rates(run, base):   # speed-up divided the wrong way
    passes = run["passes"] if run["k"] > 0 else run["decode_tokens"]
    step_s = base["decode_s"] / base["decode_tokens"]
    return {"acceptance_rate": run["accepted"] / run["proposed"] if run["proposed"] else float("nan"),
            "tokens_per_pass": run["emitted"] / passes if run["k"] > 0 else 1.0,
            "pass_cost": run["decode_s"] / passes / step_s,
            "speedup": (base["decode_tokens"] / base["decode_s"]) / (run["decode_tokens"] / run["decode_s"])}
""", "divided the wrong way"),
        ("""def spec_rates(run, base):   # tokens per pass = accepted guesses per pass
    passes = run["passes"] if run["k"] > 0 else run["decode_tokens"]
    step_s = base["decode_s"] / base["decode_tokens"]
    return {"acceptance_rate": run["accepted"] / run["proposed"] if run["proposed"] else float("nan"),
            "tokens_per_pass": run["accepted"] / passes if run["k"] > 0 else 1.0,
            "pass_cost": run["decode_s"] / passes / step_s,
            "speedup": (run["decode_tokens"] / run["decode_s"]) / (base["decode_tokens"] / base["decode_s"])}
""", "target's own token"),
        ("""def spec_rates(run, base):   # forgets that k = 0 counts no speculative passes
    step_s = base["decode_s"] / base["decode_tokens"]
    return {"acceptance_rate": run["accepted"] / run["proposed"] if run["proposed"] else float("nan"),
            "tokens_per_pass": run["emitted"] / run["passes"] if run["k"] > 0 else 1.0,
            "pass_cost": run["decode_s"] / run["passes"] / step_s,
            "speedup": (run["decode_tokens"] / run["decode_s"]) / (base["decode_tokens"] / base["decode_s"])}
""", "spec_rates(run 'off', base 'off') raised ZeroDivisionError"),
        ("""def spec_rates(run, base):   # acceptance over the emitted tokens, pass cost per emitted token
    step_s = base["decode_s"] / base["decode_tokens"]
    emitted = run["emitted"] if run["k"] > 0 else run["decode_tokens"]
    passes = run["passes"] if run["k"] > 0 else run["decode_tokens"]
    return {"acceptance_rate": run["accepted"] / emitted if run["proposed"] else float("nan"),
            "tokens_per_pass": emitted / passes,
            "pass_cost": run["decode_s"] / emitted / step_s,
            "speedup": (run["decode_tokens"] / run["decode_s"]) / (base["decode_tokens"] / base["decode_s"])}
""", "not / emitted"),
    ],
}


@pytest.fixture(scope="module")
def wrong_kernels(tmp_path_factory) -> dict:
    """Each KERNEL_LINE variant of the solution kernel, imported from its own file (Triton reads the source)."""
    source = solution_source(MASTER, MODULE_HEADER, LAUNCHER)
    folder = tmp_path_factory.mktemp("lab07_wrong")
    kernels = {}
    for name, changes in KERNEL_LINE.items():
        wrong = source
        for old, new in changes:
            assert wrong.count(old) == 1, (name, old)
            wrong = wrong.replace(old, new)
        path = folder / f"lab07_{name}.py"
        path.write_text(wrong)
        kernels[name] = import_file(path, f"lab07_{name}").accept_length_kernel
    return kernels


@pytest.fixture(scope="module")
def graded_namespace(llm, experiments, solution, wrong_kernels) -> dict:
    """What the graded test cells read: the master's solution cells, the default model, the notebook's
    experiments, and the state the run cells leave (a small engine run, the chi-square counts, a sweep stub)."""
    ns = dict(solution)
    ns.update(lab07=lab07, torch=torch, time=time, WRONG=wrong_kernels, llm=llm, run_plugged=experiments["run_plugged"],
              run_with_kernel=experiments["run_with_kernel"], spec_sweep=STUB_SWEEP, spec_timing=STUB_TIMING)
    ns.update(notebook_functions(MASTER, "accept_lengths_spec", torch=torch))
    exec(compile(LAUNCHER_SOURCE, "<launcher>", "exec"), ns)   # its globals are ns: the kernel is looked up there
    ns["kernel_run"] = ns["run_with_kernel"](llm, ns["accept_lengths"], KERNEL_PROMPTS(llm), k=4, max_tokens=8)
    ns["plug_run"] = ns["run_plugged"](llm, ns["greedy_verify"], ns["ngram_propose"],
                                       [lab07.repeat_prompt(llm), lab07.open_prompt(llm)], k=4, max_tokens=12)
    ns["chi"] = lab07.chi_square_report(ns["rejection_sample"], num_rounds=3000, test=ns["chi_square_test"])
    return ns


@pytest.mark.parametrize("grade_id, mistake, names_the_case",
                         [(gid, m, case) for gid, cases in MISTAKES.items() for m, case in cases],
                         ids=[f"{gid}-{i}" for gid, cases in MISTAKES.items() for i in range(len(cases))])
def test_graded_cell_fails_on_a_plausible_mistake(graded_namespace, grade_id, mistake, names_the_case):
    assert_check_fails(MASTER, grade_id, graded_namespace, mistake, names_the_case)


# --------------------------------------------------------------------- the kernel and the timing harness
def test_kernel_agrees_with_the_spec_and_the_engine_verifier(solution):
    from minillm.speculative.verify import greedy_verify

    proposals, target, lengths = lab07.make_verify_inputs([5, 0, 3, 8, 8, 1], 8, vocab=3, seed=21, device=DEVICE)
    got = solution["accept_lengths"](proposals, target, lengths).cpu()
    spec = notebook_functions(MASTER, "accept_lengths_spec", torch=torch)["accept_lengths_spec"]
    assert torch.equal(got, spec(proposals.cpu(), target.cpu(), lengths.cpu()))
    for b, n in enumerate(lengths.tolist()):   # the kept tokens are the engine's greedy_verify's
        p, t = proposals[b, :n].tolist(), target[b, :n + 1].tolist()
        assert p[:got[b]] + [t[got[b]]] == greedy_verify(p, t)


def test_kernel_checks_name_the_mistake(wrong_kernels, solution):
    ns = dict(solution)
    for name, words in (("sum_matches", "stop at the first disagreement"), ("no_length_mask", "padding past"),
                        ("wrong_stride", "K + 1 entries")):
        ns["accept_length_kernel"] = wrong_kernels[name]
        exec(compile(LAUNCHER_SOURCE, "<launcher>", "exec"), ns)
        with pytest.raises(CheckFailed, match=re.escape(words)):
            lab07.check_accept_lengths(ns["accept_lengths"], device=DEVICE)


def test_stub_kernel_raises_not_implemented(tmp_path):
    source = solution_source(MASTER, MODULE_HEADER, LAUNCHER)
    start = source.index("    ### BEGIN SOLUTION\n    valid = cols < n")
    end = source.index("    ### END SOLUTION\n", start) + len("    ### END SOLUTION\n")
    path = tmp_path / "lab07_stub.py"
    path.write_text(source[:start] + "    # YOUR CODE HERE\n    raise NotImplementedError()\n" + source[end:])
    module = import_file(path, "lab07_stub")
    with pytest.raises(NotImplementedError):
        module.accept_lengths(*lab07.make_verify_inputs([2], 2))


def test_solution_kernel_compiles_for_sm80_and_sm90(tmp_path):
    """What the interpreter forgives (types, shapes) fails here, without a GPU."""
    path = tmp_path / "lab07_aot.py"
    path.write_text(solution_source(MASTER, MODULE_HEADER, LAUNCHER))
    assert_compiles_for_gpus(path, [("accept_length_kernel",
                                     {"out_ptr": "*i32", "proposals_ptr": "*i32", "target_ptr": "*i32",
                                      "num_proposed_ptr": "*i32", "K": "i32", "BLOCK_K": "constexpr"},
                                     {"BLOCK_K": 8})])


def test_engine_runs_the_kernel_one_launch_per_step(llm, solution, experiments, capsys):
    result = experiments["run_with_kernel"](llm, solution["accept_lengths"], KERNEL_PROMPTS(llm), k=3, max_tokens=8)
    lab07.check_kernel_verify_run(result)
    assert result["tokens"] == result["expected"] and result["sequences"] > result["launches"] > 0
    lab07.print_kernel_verify_run(result)
    assert "sequences per launch" in capsys.readouterr().out


def test_batch_verifier_results_are_validated(llm):
    class Liar(lab07.KernelVerifier):
        def greedy_batch(self, proposals, target_argmax):
            return [list(p) + [t[-1], t[-1]] for p, t in zip(proposals, target_argmax)]   # one token too many

    engine = llm.with_levers(speculative="ngram", num_speculative_tokens=2, verifier=Liar(None))
    with pytest.raises(ValueError, match="greedy_batch kept"):
        engine.generate(lab07.repeat_prompt(llm), lab07.SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)


def test_time_speculation_on_the_engine_and_the_figure(llm, solution):
    engines = {"off": llm, "on": llm.with_levers(speculative="ngram", num_speculative_tokens=4)}
    result = solution["time_speculation"](engines, [lab07.repeat_prompt(llm)],
                                          lab07.SamplingParams(max_tokens=8, temperature=0), warmup=1, repeats=3)
    assert result["off"]["tokens"] == result["on"]["tokens"] == 8 and result["speedup"] > 0
    assert result["off"]["min_s"] <= result["off"]["median_s"] <= result["off"]["max_s"]
    fig = lab07.timing_figure(result, "cpu: test device")
    assert len(fig.data) == 2 and "cpu: test device" in figure_subtitle(fig)


def test_explain_questions_quote_the_numbers(capsys):
    rows = lab07.sweep_rows(STUB_SWEEP, lab07._ref_spec_rates)
    lab07.print_explain_questions(rows, STUB_TIMING, {"launches": 4, "sequences": 8})
    out = capsys.readouterr().out
    assert "2.00x" in out and "32.0 tokens/s" in out and "2.0 sequences per launch" in out
    lab07.print_explain_questions(None, None, None)   # before the measurements ran: no crash

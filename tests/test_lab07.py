"""Lab 07 (speculative decoding): the master's solutions pass every check; the checks name each usual
mistake (no bonus token, the guess kept at a disagreement, verifying past it, the earliest or the
shortest n-gram match, a replacement drawn from p instead of the residual, no bonus draw, k terms for
k + 1); the engine runs on the learner's functions with speculation-off tokens and gets its own back
afterwards; the toy reproduces three rounds / twelve tokens / three passes; the sweep and its
figures come out right on a tiny run."""

from __future__ import annotations

import math

import nbformat
import pytest
import torch

from lab_utils import nbgrader_cells, notebook_functions, solution_fixture

from grading.build import REPO_ROOT, SOURCE_DIR
from minillm.lab import lab07
from minillm.lab.common import CheckFailed, figure_subtitle

MASTER = SOURCE_DIR / "07_speculative_decoding" / "07_speculative_decoding.ipynb"
EXERCISES = {"greedy_verify", "ngram_propose", "rejection_sample", "expected_tokens_per_pass"}


solution = solution_fixture(MASTER, {"lab07": lab07})  # the master's solution cells, run in one namespace


@pytest.fixture(scope="module")
def experiments() -> dict:
    """The experiments the notebook defines in its own cells (the toy, the engine on the learner's functions)."""
    return notebook_functions(MASTER, "toy_rounds", "run_plugged", "run_sampled")


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
                           "test_expected_tokens_per_pass"}
    for gid in graded:
        assert "### BEGIN HIDDEN TESTS" in meta[gid][0].source, f"{gid} has no hidden tests"
        assert graded[gid]["locked"] and graded[gid]["points"] > 0
    assert sum(m["points"] for m in graded.values()) == 14
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            assert cell.metadata["nbgrader"]["locked"], f"markdown cell {cell.id} is editable"
    assert 'QUICK = os.environ.get("MINILLM_QUICK") == "1"' in nb.cells[1].source


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
    from minillm.engine import speculative as spec_mod

    before = (spec_mod.ngram_propose, spec_mod.greedy_verify, spec_mod.rejection_sample)
    result = experiments["run_plugged"](llm, solution["greedy_verify"], solution["ngram_propose"],
                                        [lab07.repeat_prompt(llm), lab07.open_prompt(llm)], k=3, max_tokens=10)
    assert result["equal"] and result["record"]["verify_calls"] > 0 and result["accepted"] > 0
    lab07.check_plugged(result)
    assert (spec_mod.ngram_propose, spec_mod.greedy_verify, spec_mod.rejection_sample) == before
    with pytest.raises(RuntimeError), lab07.plugged(verify=_no_bonus):
        raise RuntimeError("boom")
    assert (spec_mod.ngram_propose, spec_mod.greedy_verify, spec_mod.rejection_sample) == before


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
    result = lab07.sweep(llm, [("ngram", 1), ("ngram", 3)], num_requests=1, max_tokens=8)
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

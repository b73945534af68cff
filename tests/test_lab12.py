"""Lab 12 (distillation, the smallest model that meets the bar, on a device): the master's solutions pass every check;
the checks name each usual mistake (no T^2, the KL reversed, the temperature on one side only, sums or the vocabulary
mean for the positions' mean, alpha swapped; a block of first layers, the last layer dropped, rounding down, 1-based
indices; the mean, the warm-up kept, the minimum, the tokens of one prompt; the best score, a strict bar, a relative
margin, an index for the row; the inverse ratio, 4 bits for Q4_0); every graded test cell fails on two or more
plausible mistakes (MISTAKES, run by lab_utils.assert_check_fails); the notebook's experiments (the teacher's data,
the toggle, the sweep with the learner's harness, the GGUF export read back) run on a tiny random teacher with the
default model's tokenizer and give what follows from their construction."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import pytest
import torch

from lab_utils import (assert_check_fails, assert_master_structure, notebook_functions, run_solution_cells,
                       solution_fixture, student_stubs)

from grading.build import REPO_ROOT, SOURCE_DIR
from minillm.lab import lab12
from minillm.lab.common import CheckFailed, FakeClock, figure_subtitle

MASTER = SOURCE_DIR / "12_distillation" / "12_distillation.ipynb"
EXERCISES = {"distillation_loss", "select_layers", "measure_speed", "pick_model", "answer_smallest_ratio",
             "answer_q4_bits"}
GRADED = {"test_distillation_loss": 3, "test_select_layers": 2, "test_measure_speed": 3, "test_pick_model": 2,
          "test_answer_smallest_ratio": 1, "test_answer_q4_bits": 1}


def _sweep_row(name, score, weight_mb):
    return {"name": name, "score": score, "weight_bytes": int(weight_mb * 1e6), "kv_bytes_per_token": 12_000,
            "ttft_s": 0.1, "median_s": 0.5, "min_s": 0.4, "max_s": 0.7, "tokens_per_s": 16.0, "s_per_token": 1 / 16}


# What run_sweep returns, for the teacher and a 1-layer student in fp32 and int8 (the answer cell reads only this).
STUB_SWEEP = [_sweep_row("teacher fp32", 1.0, 141.6), _sweep_row("teacher int8", 1.0, 35.6),
              _sweep_row("1 layers fp32", 0.53, 127.4), _sweep_row("1 layers int8", 0.53, 32.1)]
NAMESPACE = {"lab12": lab12, "torch": torch, "time": time, "sweep": STUB_SWEEP}

solution = solution_fixture(MASTER, NAMESPACE)


def test_master_has_every_graded_piece_with_hidden_tests():
    assert_master_structure(MASTER, EXERCISES, GRADED, 12)


def test_student_copy_has_stubs_and_no_solution():
    stubs = student_stubs(REPO_ROOT / "labs" / "12_distillation.ipynb", EXERCISES)
    assert "kl_div" not in stubs["distillation_loss"] and "round(" not in stubs["select_layers"]
    assert "statistics.median(samples)" not in stubs["measure_speed"] and "1e-9" not in stubs["pick_model"]
    assert "4.5" not in stubs["answer_q4_bits"] and "max(row" not in stubs["answer_smallest_ratio"]


def test_master_declares_the_references():
    import nbformat

    references = nbformat.read(MASTER, as_version=4).metadata["minillm"]["references"]
    assert "minillm.distill.loss:distillation_loss_parts" in references["distillation_loss"]
    assert "minillm.distill.student:select_layers" in references["select_layers"]
    assert set(references) == EXERCISES


# --------------------------------------------------------------------- the solutions pass, the references agree
def test_solution_passes_every_check(solution, passes):
    for seed in (0, 1, 2):
        assert passes(lab12.check_distillation_loss, solution["distillation_loss"], seed=seed).startswith("✓")
    assert passes(lab12.check_select_layers, solution["select_layers"]).startswith("✓")
    assert passes(lab12.check_measure_speed, solution["measure_speed"]).startswith("✓")
    assert passes(lab12.check_pick_model, solution["pick_model"]).startswith("✓")
    assert passes(lab12.check_answer_q4_bits, solution["answer_q4_bits"]).startswith("✓")
    assert passes(lab12.check_answer_smallest_ratio, solution["answer_smallest_ratio"], STUB_SWEEP).startswith("✓")
    assert solution["answer_smallest_ratio"] == pytest.approx(141.6 / 32.1)


def test_references_agree_with_the_engine_side():
    """The lab's references are minillm.distill's: the loss, the layer choice (within the half-layer the check allows)."""
    from minillm.distill.loss import distillation_loss
    from minillm.distill.student import select_layers

    for name, student, teacher, labels, temperature, alpha in lab12.loss_cases(3):
        assert float(distillation_loss(student, teacher, labels, temperature, alpha)) == pytest.approx(
            lab12.reference_loss(student, teacher, labels, temperature, alpha), rel=1e-5), name
    for num_layers, num_keep in lab12.SELECT_CASES:
        ideal = lab12.reference_select(num_layers, num_keep)
        assert all(abs(a - b) <= 0.5 for a, b in zip(select_layers(num_layers, num_keep), ideal))
    assert select_layers(30, 6) == [0, 6, 12, 17, 23, 29] and lab12.reference_select(30, 1) == [29.0]


def test_reference_pick_on_the_hand_made_rows():
    picks = [lab12.reference_pick(rows, score, margin, cost) for _, rows, score, margin, cost in lab12.PICK_CASES]
    assert [p["name"] if p else None for p in picks] == [
        "8 layers int8", "2 layers int4", "6 layers", "teacher", None, "B", "first", "8 layers fp32"]


def test_the_loss_variants_are_each_a_different_value():
    """Every named mistake gives a value of its own on the first case (else the check could name the wrong one)."""
    name, student, teacher, labels, temperature, alpha = lab12.loss_cases(0)[0]
    want = lab12.reference_loss(student, teacher, labels, temperature, alpha)
    values = [value for value, _ in lab12._loss_variants(student, teacher, labels, temperature, alpha)]
    assert all(abs(v - want) > 1e-3 * abs(want) for v in values)
    assert len({round(v, 6) for v in values}) == len(values)


# --------------------------------------------------------------------- the checks catch mistakes
def _loss(kl_scale=lambda t: t ** 2, reverse=False, t_student=True, t_teacher=True, reduction="batchmean",
          swap=False):
    import torch.nn.functional as F

    def loss(s, t, labels, temperature=2.0, alpha=0.5):
        log_s = F.log_softmax(s / (temperature if t_student else 1.0), -1)
        log_t = F.log_softmax(t / (temperature if t_teacher else 1.0), -1)
        kl = (F.kl_div(log_t, log_s, log_target=True, reduction=reduction) if reverse
              else F.kl_div(log_s, log_t, log_target=True, reduction=reduction)) * kl_scale(temperature)
        a = 1 - alpha if swap else alpha
        return a * kl + (1 - a) * F.cross_entropy(s, labels)

    return loss


@pytest.mark.parametrize("wrong, message", [
    (_loss(kl_scale=lambda t: 1.0), r"not multiplied by T\^2"),
    (_loss(kl_scale=lambda t: t), r"multiplied by T, not by T\^2"),
    (_loss(reverse=True), "the KL is reversed"),
    (_loss(t_student=False), "divide the student's logits by T too"),
    (_loss(t_teacher=False), "divide the teacher's logits by T too"),
    (_loss(reduction="mean"), "reduction='mean'"),
    (_loss(reduction="sum"), "KL part is summed over the positions"),
    (_loss(swap=True), "alpha is swapped"),
    (lambda s, t, labels, temperature=2.0, alpha=0.5: float(_loss()(s, t, labels, temperature, alpha)),
     "expected a one-number tensor"),
])
def test_loss_check_names_the_mistake(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        lab12.check_distillation_loss(wrong)


@pytest.mark.parametrize("wrong, message", [
    (lambda n, k: list(range(k)), "the first num_keep layers"),
    (lambda n, k: list(range(0, n, n // k))[:k], "the last layer"),
    (lambda n, k: [int(i * (n - 1) / (k - 1)) for i in range(k)], "rounded down"),
    (lambda n, k: [round(i * (n - 1) / (k - 1)) + 1 for i in range(k)], "1-based"),
    (lambda n, k: [round(i * n / k) for i in range(k)], "the last layer"),
    (lambda n, k: [0] + [round(i * (n - 1) / (k - 1)) for i in range(k)], "returned 7 layers"),
])
def test_select_check_names_the_mistake(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        lab12.check_select_layers(wrong)


def _harness(stat=statistics.median, keep_warmup=False, per_prompt=False, spread=True):
    def measure_speed(generate, num_tokens, clock=time.perf_counter, warmup=1, repeats=5):
        def timed(n):
            samples, tokens = [], 0
            for i in range(warmup + repeats):
                start = clock()
                tokens = generate(n)
                if i >= warmup or keep_warmup:
                    samples.append(clock() - start)
            return samples, tokens

        first, _ = timed(1)
        samples, tokens = timed(num_tokens)
        median = stat(samples)
        return {"ttft_s": stat(first), "median_s": median, "min_s": min(samples) if spread else median,
                "max_s": max(samples), "tokens_per_s": (num_tokens if per_prompt else tokens) / median}

    return measure_speed


@pytest.mark.parametrize("wrong, message", [
    (_harness(stat=statistics.fmean), "the mean: one slow outlier"),
    (_harness(keep_warmup=True), "warm-up included"),
    (_harness(stat=min), "the minimum"),
    (_harness(per_prompt=True), "use what generate returns"),
    (_harness(spread=False), "min_s"),
])
def test_speed_check_names_the_mistake(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        lab12.check_measure_speed(wrong)


def test_speed_check_counts_the_calls():
    def once(generate, num_tokens, clock=time.perf_counter, warmup=1, repeats=5):
        start = clock()
        tokens = generate(num_tokens)
        seconds = clock() - start
        return {"ttft_s": seconds, "median_s": seconds, "min_s": seconds, "max_s": seconds, "tokens_per_s": tokens / seconds}

    with pytest.raises(CheckFailed, match=r"called generate\(1\) 0 times; expected warmup \+ repeats"):
        lab12.check_measure_speed(once)
    clock = FakeClock()
    model = lab12.FakeModel(clock, 4, [1.0], [2.0])
    assert model(4) == 12 and clock() == pytest.approx(1002.0)
    with pytest.raises(CheckFailed, match="more than warmup"):
        model(4)


def _pick(strict=False, relative=False, best_score=False, index=False):
    def pick_model(rows, teacher_score, margin, cost="weight_bytes"):
        bar = teacher_score * (1 - margin) if relative else teacher_score - margin
        meeting = [(i, r) for i, r in enumerate(rows) if (r["score"] > bar if strict else r["score"] >= bar - 1e-9)]
        if not meeting:
            return None
        key = (lambda p: -p[1]["score"]) if best_score else (lambda p: (p[1][cost], -p[1]["score"], p[0]))
        i, row = min(meeting, key=key)
        return i if index else row

    return pick_model


@pytest.mark.parametrize("wrong, message", [
    (_pick(best_score=True), "that is the best score"),
    (_pick(strict=True), "exactly at the bar"),
    (_pick(relative=True), "not a fraction of the teacher's score"),
    (_pick(index=True), "not its index"),
    (lambda rows, teacher_score, margin, cost="weight_bytes": min(rows, key=lambda r: r[cost]), "misses the bar"),
])
def test_pick_check_names_the_mistake(wrong, message):
    with pytest.raises(CheckFailed, match=message):
        lab12.check_pick_model(wrong)


def test_answer_checks_name_the_mistake():
    with pytest.raises(CheckFailed, match="16 bits shared by 32 weights"):
        lab12.check_answer_q4_bits(4)
    with pytest.raises(CheckFailed, match="not a float32"):
        lab12.check_answer_q4_bits(5.0)
    with pytest.raises(CheckFailed, match="still None"):
        lab12.check_answer_q4_bits(None)
    with pytest.raises(CheckFailed, match="divide the other way"):
        lab12.check_answer_smallest_ratio(32.1 / 141.6, STUB_SWEEP)
    with pytest.raises(CheckFailed, match="your sweep's table gives 4.41"):
        lab12.check_answer_smallest_ratio(141.6 / 127.4, STUB_SWEEP)


def test_stubs_raise_not_implemented():
    def stub(*args, **kwargs):
        raise NotImplementedError()

    for check in (lab12.check_distillation_loss, lab12.check_select_layers, lab12.check_measure_speed,
                  lab12.check_pick_model):
        with pytest.raises(NotImplementedError):
            check(stub)


# --------------------------------------------------------------------- every graded cell fails on plausible mistakes
NO_T2 = """
import torch.nn.functional as F
def distillation_loss(student_logits, teacher_logits, labels, temperature=2.0, alpha=0.5):
    log_s = F.log_softmax(student_logits / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits / temperature, dim=-1)
    kl = F.kl_div(log_s, log_t, log_target=True, reduction="batchmean")
    return alpha * kl + (1 - alpha) * F.cross_entropy(student_logits, labels)
"""
KL_REVERSED = NO_T2.replace("F.kl_div(log_s, log_t", "F.kl_div(log_t, log_s").replace(
    'reduction="batchmean")', 'reduction="batchmean") * temperature ** 2')
ONE_SIDE = NO_T2.replace("student_logits / temperature", "student_logits").replace(
    'reduction="batchmean")', 'reduction="batchmean") * temperature ** 2')
KL_MEAN = NO_T2.replace('reduction="batchmean")', 'reduction="mean") * temperature ** 2')
ALPHA_SWAPPED = NO_T2.replace('reduction="batchmean")', 'reduction="batchmean") * temperature ** 2').replace(
    "return alpha * kl + (1 - alpha) *", "return (1 - alpha) * kl + alpha *")

FIRST_BLOCK = "def select_layers(num_layers, num_keep):\n    return list(range(num_keep))\n"
LAST_DROPPED = "def select_layers(num_layers, num_keep):\n    return list(range(0, num_layers, num_layers // num_keep))[:num_keep]\n"
ROUNDED_DOWN = ("def select_layers(num_layers, num_keep):\n    if num_keep == 1:\n        return [num_layers - 1]\n"
                "    return [int(i * (num_layers - 1) / (num_keep - 1)) for i in range(num_keep)]\n")
ONE_BASED = ("def select_layers(num_layers, num_keep):\n    if num_keep == 1:\n        return [num_layers]\n"
             "    return [1 + round(i * (num_layers - 1) / (num_keep - 1)) for i in range(num_keep)]\n")

HARNESS = """
import statistics
def measure_speed(generate, num_tokens, clock=time.perf_counter, warmup=1, repeats=5):
    def timed(n):
        samples, tokens = [], 0
        for i in range(warmup + repeats):
            start = clock()
            tokens = generate(n)
            if i >= warmup:
                samples.append(clock() - start)
        return samples, tokens
    first, _ = timed(1)
    samples, tokens = timed(num_tokens)
    median = statistics.median(samples)
    return {"ttft_s": statistics.median(first), "median_s": median, "min_s": min(samples), "max_s": max(samples),
            "tokens_per_s": tokens / median}
"""
HARNESS_MEAN = HARNESS.replace("statistics.median(", "statistics.fmean(")
HARNESS_WARMUP_KEPT = HARNESS.replace("if i >= warmup:", "if True:")
HARNESS_MIN = HARNESS.replace("median = statistics.median(samples)", "median = min(samples)")
HARNESS_PER_PROMPT = HARNESS.replace('"tokens_per_s": tokens / median', '"tokens_per_s": num_tokens / median')

PICK = """
def pick_model(rows, teacher_score, margin, cost="weight_bytes"):
    meeting = [r for r in rows if r["score"] >= teacher_score - margin - 1e-9]
    if not meeting:
        return None
    return min(meeting, key=lambda r: (r[cost], -r["score"]))
"""
PICK_BEST_SCORE = PICK.replace('key=lambda r: (r[cost], -r["score"])', 'key=lambda r: -r["score"]')
PICK_STRICT = PICK.replace('r["score"] >= teacher_score - margin - 1e-9', 'r["score"] > teacher_score - margin')
PICK_RELATIVE = PICK.replace("teacher_score - margin - 1e-9", "teacher_score * (1 - margin)")
PICK_NO_BAR = PICK.replace('[r for r in rows if r["score"] >= teacher_score - margin - 1e-9]', "list(rows)")

MISTAKES = {
    "test_distillation_loss": [(NO_T2, "T^2"), (KL_REVERSED, "the KL is reversed"), (ONE_SIDE, "one side only"),
                               (KL_MEAN, "reduction='mean'"), (ALPHA_SWAPPED, "alpha is swapped")],
    "test_select_layers": [(FIRST_BLOCK, "the first num_keep layers"), (LAST_DROPPED, "the last layer (29) is not kept"),
                           (ROUNDED_DOWN, "rounded down"), (ONE_BASED, "1-based")],
    "test_measure_speed": [(HARNESS_MEAN, "the mean"), (HARNESS_WARMUP_KEPT, "warm-up included"),
                           (HARNESS_MIN, "the minimum"), (HARNESS_PER_PROMPT, "use what generate returns")],
    "test_pick_model": [(PICK_BEST_SCORE, "the best score"), (PICK_STRICT, "exactly at the bar"),
                        (PICK_RELATIVE, "not a fraction"), (PICK_NO_BAR, "misses the bar")],
    "test_answer_smallest_ratio": [("answer_smallest_ratio = 32.1 / 141.6", "divide the other way"),
                                   ("answer_smallest_ratio = 141.6 / 127.4", "your sweep's table gives"),
                                   ("answer_smallest_ratio = None", "still None")],
    "test_answer_q4_bits": [("answer_q4_bits = 4", "16 bits shared by 32"), ("answer_q4_bits = 5.0", "not a float32"),
                            ("answer_q4_bits = 8.5", "count the bits of one block")],
}


@pytest.fixture(scope="module")
def graded_namespace() -> dict:
    """What the graded test cells read: the solution cells, with the stub sweep as `sweep`."""
    return run_solution_cells(MASTER, dict(NAMESPACE))


@pytest.mark.parametrize("grade_id, mistake, names_the_case",
                         [(gid, m, n) for gid, cases in MISTAKES.items() for m, n in cases],
                         ids=[f"{gid}-{i}" for gid, cases in MISTAKES.items() for i in range(len(cases))])
def test_graded_cell_fails_on_a_plausible_mistake(graded_namespace, grade_id, mistake, names_the_case):
    assert_check_fails(MASTER, grade_id, graded_namespace, mistake, names_the_case)


# --------------------------------------------------------------------- the experiments, on a tiny random teacher
@pytest.fixture(scope="module")
def tiny_teacher_dir(tmp_path_factory, default_model_dir):
    """Quick mode's teacher: a 4-layer random Llama with the default model's vocabulary and tokenizer."""
    return lab12.tiny_teacher(default_model_dir, tmp_path_factory.mktemp("teacher") / "tiny")


@pytest.fixture(scope="module")
def experiments(solution) -> dict:
    from minillm import LLM, SamplingParams

    return notebook_functions(MASTER, "prepare", "train", "run_toggle", "agreement", "run_sweep", "export_and_check",
                              LLM=LLM, SamplingParams=SamplingParams, lab12=lab12, TASK="intent", NUM_TRAIN=4,
                              NUM_HELDOUT=2, MAX_ANSWER_TOKENS=4)


@pytest.fixture(scope="module")
def toggled(experiments, solution, tiny_teacher_dir, tmp_path_factory) -> tuple[dict, dict]:
    data = experiments["prepare"](False, tmp_path_factory.mktemp("work"), model_dir=str(tiny_teacher_dir))
    experiments["export_and_check"].__globals__["data"] = data     # the notebook's export cell reads `data`
    toggle = experiments["run_toggle"](data, solution["distillation_loss"], solution["select_layers"], 2, 2)
    return data, toggle


def test_prepare_and_toggle_on_the_tiny_teacher(toggled, capsys):
    data, toggle = toggled
    assert len(data["items"]) == 4 and len(data["heldout_answers"]) == 2
    assert all(item.teacher_logits.shape == (len(item.answer_ids), 49152) for item in data["items"])
    rows = toggle["rows"]
    assert list(rows) == ["untrained", "tokens only", "distilled"] and toggle["keep"] == [0, 3]
    assert rows["untrained"]["history"] == [] and [len(rows[n]["history"]) for n in ("tokens only", "distilled")] == [2, 2]
    assert all(0 <= row["agreement"] <= 1 for row in rows.values())
    manifest = json.loads((Path(toggle["path"]) / "minillm-distill.json").read_text())
    assert manifest["recipe"]["task"] == "intent" and manifest["keep_layers"] == [0, 3]
    lab12.print_toggle(rows)
    assert "distilled" in capsys.readouterr().out
    fig = lab12.loss_figure({n: r["history"] for n, r in rows.items() if r["history"]}, "cpu: test device")
    assert len(fig.data) == 2 and "test device" in figure_subtitle(fig)


def test_the_toggle_trains_with_the_learners_loss(experiments, toggled):
    """The training loop calls the loss it is given, with alpha and temperature, and steps the student's layers."""
    from minillm.distill.student import build_student

    data, _ = toggled
    calls = []

    def loss(s, t, labels, temperature, alpha):
        calls.append((tuple(s.shape), tuple(t.shape), temperature, alpha))
        return torch.nn.functional.cross_entropy(s, labels)

    student = build_student(data["teacher"], [1])
    before = student.model.layers[0].mlp.up_proj.weight.detach().clone()
    history = experiments["train"](student, data["items"], loss, 2, 0.25, temperature=3.0, batch_size=2)
    assert len(history) == 2 and len(calls) == 2 and all(c[2:] == (3.0, 0.25) and c[0] == c[1] for c in calls)
    assert not torch.equal(before, student.model.layers[0].mlp.up_proj.weight)
    assert torch.equal(student.model.embed_tokens.weight, data["teacher"].model.embed_tokens.weight)


def test_the_sweep_scores_and_times_each_point(experiments, toggled, solution, capsys):
    data, toggle = toggled
    paths = {"teacher": data["model_dir"], "2 layers": toggle["path"]}
    rows = experiments["run_sweep"](data, paths, solution["measure_speed"], ("fp32", "int8"),
                                    {"num_tokens": 2, "warmup": 0, "repeats": 1})
    assert [r["name"] for r in rows] == ["teacher fp32", "teacher int8", "2 layers fp32", "2 layers int8"]
    by_name = {r["name"]: r for r in rows}
    assert by_name["teacher fp32"]["score"] == 1.0      # the teacher agrees with its own greedy answers
    assert by_name["teacher int8"]["weight_bytes"] < by_name["teacher fp32"]["weight_bytes"]
    assert by_name["2 layers fp32"]["weight_bytes"] < by_name["teacher fp32"]["weight_bytes"]
    assert all(r["tokens_per_s"] > 0 and r["min_s"] <= r["median_s"] <= r["max_s"] for r in rows)
    lab12.print_sweep(rows)
    pick = lab12.reference_pick(rows, 1.0, 0.05)
    fig = lab12.pareto_figure(rows, 1.0, 0.05, pick, "cpu: test device")
    assert len(fig.data) == 3 and len(fig.data[0].x) == 4
    lab12.print_memory_budget([("teacher", by_name["teacher fp32"]["weight_bytes"], 1000)], 4096, 16e9)
    assert "this machine" in capsys.readouterr().out


def test_the_export_reads_back_within_the_formats_rounding(experiments, toggled, tmp_path):
    _, toggle = toggled
    result = experiments["export_and_check"](toggle["path"], tmp_path / "gguf", read_back=("q4_0",),
                                             through_transformers=False)   # the quick mode's check (10 s a file)
    rows = {row["file"].split(".")[1]: row for row in result["formats"]}
    assert set(rows) == {"Q8_0", "Q4_0"} and rows["Q8_0"]["error"] is None
    assert 0.02 < rows["Q4_0"]["error"] <= rows["Q4_0"]["bound"]     # 4-bit rounding shows; a wrong tensor would be ~1
    assert rows["Q4_0"]["bytes"] < rows["Q8_0"]["bytes"]     # both files also hold the 49k-token tokenizer
    assert rows["Q8_0"]["bits_per_weight"] is None and 4.5 <= rows["Q4_0"]["bits_per_weight"] < 5.0   # norms: f32
    assert "Classify the customer's message" in result["modelfile"] and 'PARAMETER stop "\\n"' in result["modelfile"]
    lab12.print_gguf(result)


def test_pareto_front_and_memory_rows():
    rows = [_sweep_row("a", 0.9, 100), _sweep_row("b", 0.5, 20), _sweep_row("c", 0.4, 50), _sweep_row("d", 0.95, 300)]
    assert [r["name"] for r in lab12.pareto_front(rows)] == ["b", "a", "d"]
    table = lab12.memory_rows(1e9, 1e5, 4096, own_ram=32e9)
    assert [r["device"] for r in table][-1] == "this machine" and table[0]["need"] == pytest.approx(1e9 + 4096e5)
    assert table[0]["tokens_per_s_bound"] == pytest.approx(25.0) and table[-1]["tokens_per_s_bound"] is None
    with pytest.raises(ValueError, match="context_tokens=0"):
        lab12.memory_rows(1e9, 1e5, 0)

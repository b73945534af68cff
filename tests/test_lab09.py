"""Lab 09 (decoding settings): the master's solutions pass every check; the checks name each usual mistake (a
repetition penalty that divides negative logits, or applies once per occurrence; top-p that drops the crossing
token or runs before top-k; min-p taken as absolute; the temperature after the filters; logits changed in place;
distinct-2 averaged per sample; repetition across samples; entropy in bits; a forgotten n or 1e6; a validator that
raises or takes true for an age); every graded test cell fails on two or more plausible mistakes (MISTAKES, run by
lab_utils.assert_check_fails); the engine on the learner's sampler gives the engine's own tokens and fails on a
wrong function; the sweep, its figures and the widget, the limits, parallel-sampling and structured-output runs
come out right on tiny runs."""

from __future__ import annotations

from kernel_utils import DEVICE as KERNEL_DEVICE  # first: picks the interpreter before triton is imported

import math

import nbformat
import pytest
import torch

from lab_utils import (assert_check_fails, assert_master_structure, import_file, nbgrader_cells, notebook_functions,
                       solution_source, student_stubs)

from grading.build import REPO_ROOT, SOURCE_DIR
from minillm import SamplingParams
from minillm.lab import lab09
from minillm.lab.common import CheckFailed, FakeClock, figure_subtitle

MASTER = SOURCE_DIR / "09_decoding_settings" / "09_decoding_settings.ipynb"
EXERCISES = {"process_logits", "fused_mask_kernel", "measure_sampling", "measure_diversity", "answer_worst_case_usd",
             "valid_person"}
GRADED = {"test_process_logits_cases": 2, "test_process_logits_random": 2, "test_fused_mask_cases": 2,
          "test_fused_mask_random": 2, "test_measure_sampling": 2,
          "test_measure_diversity": 2, "test_answer_worst_case_usd": 1, "test_valid_person": 2}
DEVICE = "cpu: test device"

# the master's solution cells and the kernel's launcher, imported from a file (Triton reads a kernel's source there)
MODULE_HEADER = """import os
import torch
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton
import triton.language as tl
from minillm import SamplingParams
from minillm.lab import lab09
"""
LAUNCHER = "def fused_mask("


def _kernel_cell() -> str:
    return nbgrader_cells(nbformat.read(MASTER, as_version=4))["fused_mask_kernel"][0].source


def _launcher_cell() -> str:
    return next(c.source for c in nbformat.read(MASTER, as_version=4).cells if c.source.startswith(LAUNCHER))


@pytest.fixture(scope="module")
def solution(tmp_path_factory) -> dict:
    """The master's solution cells and the launcher, imported from one file: {name: value}."""
    path = tmp_path_factory.mktemp("lab09_solution") / "lab09_solution.py"
    path.write_text(solution_source(MASTER, MODULE_HEADER, LAUNCHER))
    return dict(vars(import_file(path, "lab09_solution")))


# wrong kernels: the solution's kernel cell with one line changed (old, new), each imported from its own file
KERNEL_LINE = {
    "topk_off_by_one": ("keep = keep & (key >= lo)   ", "keep = keep & (key > lo)   "),
    "row_not_offset": ("tl.store(out_ptr + row * V + cols", "tl.store(out_ptr + cols"),
    "min_p_absolute": ('keep = (x > float("-inf")) & (e >= min_p)', 'keep = (x > float("-inf")) & (e / tl.sum(e, axis=0) >= min_p)'),
    "crossing_dropped": ("tl.sum(tl.where(keep & (key > mid), p, 0.0), axis=0) < top_p",
                         "tl.sum(tl.where(keep & (key >= mid), p, 0.0), axis=0) < top_p"),
    "no_renormalize": ("    p = p / tl.sum(p, axis=0)\n", "    p = p / tl.sum(e, axis=0)\n"),
}


@pytest.fixture(scope="module")
def wrong_kernels(tmp_path_factory) -> dict:
    kernels, source = {}, _kernel_cell()
    for name, (old, new) in KERNEL_LINE.items():
        assert old in source, (name, old)
        path = tmp_path_factory.mktemp(f"lab09_{name}") / f"lab09_{name}.py"
        path.write_text(MODULE_HEADER + source.replace(old, new, 1) + "\n")
        kernels[name] = import_file(path, f"lab09_{name}").fused_mask_kernel
    return kernels


def kernel_mistake(name: str) -> str:
    """The learner's notebook with a wrong kernel: the kernel, then the launcher cell, re-run."""
    return f"fused_mask_kernel = WRONG_MASK[{name!r}]\n{_launcher_cell()}"


@pytest.fixture(scope="module")
def experiments() -> dict:
    """The experiments the notebook defines in its own cells (LearnerSampler is a class: its locked cell is run as
    it is, with the notebook's imports)."""
    from minillm import SamplingParams

    found = notebook_functions(MASTER, "decode_sweep", "cost_of_limits", "parallel_kv", "json_runs", DEVICE=DEVICE)
    scope = {"torch": torch, "SamplingParams": SamplingParams}
    exec(compile(nbgrader_cells(nbformat.read(MASTER, as_version=4))["def-learner-sampler"][0].source,
                 str(MASTER), "exec"), scope)
    runs = notebook_functions(MASTER, "run_with_mask")
    return {**found, **runs, "LearnerSampler": scope["LearnerSampler"], "run_with_sampler": scope["run_with_sampler"]}


@pytest.fixture(scope="module")
def llm():
    from minillm import LLM

    return LLM()


def test_master_has_every_graded_piece_with_hidden_tests():
    assert_master_structure(MASTER, EXERCISES, GRADED, 15)
    setup = nbformat.read(MASTER, as_version=4).cells[2].source
    assert setup.index('os.environ["TRITON_INTERPRET"] = "1"') < setup.index("import triton")


def test_student_copy_has_stubs_and_no_solution():
    stubs = student_stubs(REPO_ROOT / "labs" / "09_decoding_settings.ipynb", EXERCISES)
    assert "cumsum" not in stubs["process_logits"] and "isinstance" not in stubs["valid_person"]


# --------------------------------------------------------------------- the solutions pass
def test_solution_passes_every_check(solution):
    lab09.check_process_logits_cases(solution["process_logits"])
    for seed in (0, 1, 2, 3):
        lab09.check_process_logits(solution["process_logits"], seed=seed)
    lab09.check_diversity_stats(solution["diversity_stats"], STUB_SWEEP)
    lab09.check_answer_worst_case_usd(solution["answer_worst_case_usd"])
    lab09.check_valid_person(solution["valid_person"])


def test_process_logits_matches_the_engine_on_the_real_vocabulary(solution):
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(0)) * 4
    for setting in ({}, {"temperature": 0.7, "top_p": 0.9}, {"min_p": 0.1, "top_k": 50, "repetition_penalty": 1.3}):
        mine = solution["process_logits"](logits.clone(), list(range(0, 400, 3)), **setting)
        want = lab09.reference_probs(logits, list(range(0, 400, 3)), **setting)
        assert torch.equal(mine > 0, want > 0) and torch.allclose(mine.double(), want.double(), atol=1e-6)


def test_valid_person_reference_agrees_with_jsonschema():
    jsonschema = pytest.importorskip("jsonschema")
    for text, _ in lab09.VALID_CASES:
        try:
            value = __import__("json").loads(text)
        except ValueError:
            assert not lab09.reference_valid_person(text)
            continue
        if isinstance(value, dict) and isinstance(value.get("age"), float) and value["age"] == int(value["age"]):
            continue   # 36.0: an integer to JSON Schema, not to this lab's contract (the notebook says so)
        valid = jsonschema.Draft202012Validator(lab09.PERSON_SCHEMA).is_valid(value)
        assert valid == lab09.reference_valid_person(text), text


# --------------------------------------------------------------------- the checks name mistakes
def _variant(solution_source: str, old: str, new: str) -> dict:
    assert old in solution_source, old
    scope = {"torch": torch}
    exec(solution_source.replace(old, new), scope)
    return scope


@pytest.fixture(scope="module")
def process_source() -> str:
    return nbgrader_cells(nbformat.read(MASTER, as_version=4))["process_logits"][0].source


@pytest.mark.parametrize("old, new, words", [
    ("torch.where(logits[seen] > 0, logits[seen] / repetition_penalty,\n                                   "
     "logits[seen] * repetition_penalty)", "logits[seen] / repetition_penalty", "MULTIPLIES a negative"),
    ("mass_before >= top_p", "probs.cumsum(-1) > top_p", "the token whose probability crosses"),
    ("probs < min_p * probs.max()", "probs < min_p", "min_p is relative"),
    ("logits = logits.clone().float()", "logits = logits.float()", "changed the logits it was given"),
])
def test_process_checks_name_the_mistake(process_source, old, new, words):
    wrong = _variant(process_source, old, new)["process_logits"]
    with pytest.raises(CheckFailed, match=words):
        lab09.check_process_logits_cases(wrong)
    with pytest.raises(CheckFailed, match=words):
        lab09.check_process_logits(wrong)


def test_diversity_check_names_the_mistake():
    def per_sample(run):
        values = [len(set(zip(s, s[1:]))) / (len(s) - 1) for s in run["samples"] if len(s) > 1]
        return dict(lab09.reference_diversity_stats(run), distinct_2=sum(values) / len(values) if values else 0.0)

    with pytest.raises(CheckFailed, match="pool the bigrams"):
        lab09.check_diversity_stats(per_sample, STUB_SWEEP)

    def bits(run):
        stats = lab09.reference_diversity_stats(run)
        return dict(stats, mean_entropy=stats["mean_entropy"] / math.log(2))

    with pytest.raises(CheckFailed, match="nats already"):
        lab09.check_diversity_stats(bits, STUB_SWEEP)
    with pytest.raises(CheckFailed, match="run the sweep"):
        lab09.check_diversity_stats(lab09.reference_diversity_stats, None)


def test_chi_square_p_value():
    probs = torch.tensor([0.5, 0.25, 0.25, 0.0])
    assert lab09.chi_square_p_value(torch.tensor([500, 250, 250, 0]), probs) == pytest.approx(1.0)
    assert lab09.chi_square_p_value(torch.tensor([520, 240, 240, 0]), probs) == pytest.approx(math.exp(-0.8), rel=1e-6)
    assert lab09.chi_square_p_value(torch.tensor([500, 250, 249, 1]), probs) == 0.0


# --------------------------------------------------------------------- the engine
def test_engine_on_the_solution_and_on_a_wrong_function(llm, solution, experiments, capsys, process_source):
    prompts = lab09.chat_prompts(llm, [lab09.STORY_MESSAGES, lab09.LIST_MESSAGES])
    result = experiments["run_with_sampler"](llm, solution["process_logits"], prompts, max_tokens=6)
    assert result["greedy"]["equal"] and result["sampled"]["equal"] and result["calls"] == 2 * 2 * 6
    lab09.check_engine_run(result)
    lab09.print_engine_run(result)
    assert "the same tokens as the engine's own sampler" in capsys.readouterr().out
    no_penalty = _variant(process_source, "if repetition_penalty != 1.0 and history:", "if False:")["process_logits"]
    wrong = experiments["run_with_sampler"](llm, no_penalty, prompts, max_tokens=12)
    assert not wrong["greedy"]["equal"]
    with pytest.raises(CheckFailed, match="check the repetition penalty"):
        lab09.check_engine_run(wrong)
    with pytest.raises(CheckFailed, match="chi-square"):
        lab09.check_sampler_chi_square(experiments["LearnerSampler"](no_penalty))


def test_first_token_distribution(llm, capsys):
    first = lab09.first_token_logits(llm)
    assert first["logits"].shape == (49152,)
    assert 1 <= lab09.kept_tokens(first, top_p=0.9) < 1000 and lab09.kept_tokens(first) == 49152
    assert lab09.kept_tokens(first, top_k=3) == 3 and lab09.kept_tokens(first, min_p=1.0) == 1
    lab09.print_distribution(first, [{}, {"top_p": 0.9}])
    out = capsys.readouterr().out
    assert "keeps  49152 tokens" in out and "top_p 0.9" in out


def test_sweep_figures_and_widget(llm, solution, experiments, capsys):
    prompt = {"prompt_token_ids": llm.chat_token_ids([{"role": "user", "content": "Write a poem about the sea."}])}
    settings = [{"temperature": 0.0}, {"temperature": 0.0, "repetition_penalty": 1.3},
                {"temperature": 0.7, "top_p": 1.0}, {"temperature": 1.5, "top_p": 1.0}, {"temperature": 1.5, "top_p": 0.5}]
    sweep = experiments["decode_sweep"](llm, prompt, settings, 2, 6)
    assert [len(run["samples"]) for run in sweep] == [2] * 5 and all(len(s) == 6 for s in sweep[2]["samples"])
    assert sweep[0]["samples"][0] == sweep[0]["samples"][1] and sweep[0]["entropies"] == [0.0] * 12
    assert len(sweep[3]["entropies"]) == 12 and min(sweep[3]["entropies"]) > 0
    lab09.check_diversity_stats(solution["diversity_stats"], sweep)
    rows = lab09.sweep_rows(sweep, solution["diversity_stats"])
    lab09.print_sweep(rows, DEVICE)
    assert "temperature 1.5, top_p 0.5" in capsys.readouterr().out
    assert lab09.row_for(rows, temperature=0.0)["distinct_2"] == pytest.approx(0.5)
    fig = lab09.diversity_figure(rows, DEVICE)
    assert len(fig.data) == 4 and DEVICE in figure_subtitle(fig)
    assert len(lab09.entropy_figure(rows, DEVICE).data) == 2
    view = lab09.DecodingExplorer(rows, DEVICE)
    assert view.chosen is not None and "distinct-2" in view.label.value
    view.top_p.value = 0.5
    view.temperature.value = 1.5
    assert view.chosen["label"] == "temperature 1.5, top_p 0.5" and list(view.figure.data[-1].x) == [1.5]
    view.temperature.value = 0.7
    assert view.chosen is None and "not measured" in view.label.value


def test_limits_parallel_and_structured_runs(llm, solution, experiments, capsys):
    prompt = {"prompt_token_ids": llm.chat_token_ids(lab09.LIST_MESSAGES)}
    rows = experiments["cost_of_limits"](llm, prompt, [("max_tokens=8", {"max_tokens": 8}),
                                                       ('stop=["2."]', {"max_tokens": 32, "stop": ["2."]})])
    assert rows[0]["tokens"] == 8 and rows[0]["finish_reason"] == "length"
    assert rows[1]["finish_reason"] == "stop" and "2." not in rows[1]["text"]
    assert rows[0]["usd"] == pytest.approx(rows[0]["hourly_usd"] / 3600 * rows[0]["wall_s"])
    lab09.print_limits(rows, DEVICE)

    from minillm.lab.common import prompt_token_ids

    parallel = experiments["parallel_kv"](llm, {"prompt_token_ids": prompt_token_ids(llm.tokenizer, 58)}, 3, 4)
    assert parallel["same_texts"] and parallel["shared"]["peak_kv_bytes"] < parallel["separate"]["peak_kv_bytes"]
    measured = parallel["shared"]["peak_kv_bytes"] / parallel["separate"]["peak_kv_bytes"]
    assert measured == pytest.approx(lab09.kv_ratio_model(58, 4, 3, parallel["block_size"]), abs=0.03)
    lab09.print_parallel(parallel)
    lab09.print_kv_models(parallel)

    people = [{"prompt_token_ids": llm.chat_token_ids([{"role": "user", "content": "Describe a person as JSON."}])}]
    structured = experiments["json_runs"](llm, people, lab09.PERSON_SCHEMA, max_tokens=40)
    assert all(solution["valid_person"](t) for t in structured["constrained"]["texts"])
    assert structured["constrained"]["mask_steps"] > 0 and structured["free"]["mask_steps"] == 0
    lab09.print_structured(structured, solution["valid_person"])
    out = capsys.readouterr().out
    assert "finish" in out and "ratio" in out and "1 of 1 valid" in out


# --------------------------------------------------------------------- every graded cell fails on plausible mistakes
STUB_SWEEP = [
    {"label": "temperature 0.0", "setting": {"temperature": 0.0}, "samples": [[1, 2, 3, 1, 2, 3, 1], [1, 2, 3, 1, 2, 3, 1]],
     "texts": ["a", "a"], "entropies": [0.0] * 14},
    {"label": "temperature 1.0, top_p 1.0", "setting": {"temperature": 1.0, "top_p": 1.0},
     "samples": [[4, 5, 6, 7, 4, 5], [8, 9, 4, 5, 6, 1]], "texts": ["b", "c"], "entropies": [1.5, 2.5, 0.5] * 4},
]

_PROCESS_HEAD = '''def process_logits(logits, history, temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, repetition_penalty=1.0):
'''
_PROCESS_TAIL = '''    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).float()
    logits = logits / temperature
    if min_p > 0:
        probs = logits.softmax(-1)
        logits[probs < min_p * probs.max()] = float("-inf")
    if 0 < top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits[logits < kth] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        logits[order[mass_before >= top_p]] = float("-inf")
    return logits.softmax(-1)
'''
_PENALTY = '''    logits = logits.clone().float()
    if repetition_penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / repetition_penalty, logits[seen] * repetition_penalty)
'''
DIVIDES_ALL = _PROCESS_HEAD + '''    # divides every seen logit by the penalty
    logits = logits.clone().float()
    if repetition_penalty != 1.0 and history:
        seen = torch.tensor(sorted(set(history)))
        logits[seen] = logits[seen] / repetition_penalty
''' + _PROCESS_TAIL
PER_OCCURRENCE = _PROCESS_HEAD + '''    # penalizes a token once per occurrence
    logits = logits.clone().float()
    for token in history:
        logits[token] = logits[token] / repetition_penalty if logits[token] > 0 else logits[token] * repetition_penalty
''' + _PROCESS_TAIL
DROPS_CROSSING = (_PROCESS_HEAD + "    # top-p drops the token that crosses top_p\n" + _PENALTY
                  + _PROCESS_TAIL.replace("mass_before >= top_p", "probs.cumsum(-1) > top_p"))
MIN_P_ABSOLUTE = (_PROCESS_HEAD + "    # min_p as an absolute threshold\n" + _PENALTY
                  + _PROCESS_TAIL.replace("probs < min_p * probs.max()", "probs < min_p"))
IN_PLACE = (_PROCESS_HEAD + "    # works on the engine's tensor in place\n"
            + _PENALTY.replace("logits = logits.clone().float()", "logits = logits.float()") + _PROCESS_TAIL)
TOP_P_FIRST = (_PROCESS_HEAD + "    # top-p on the whole distribution, before top-k\n" + _PENALTY + '''    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).float()
    logits = logits / temperature
    if min_p > 0:
        probs = logits.softmax(-1)
        logits[probs < min_p * probs.max()] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        logits[order[mass_before >= top_p]] = float("-inf")
    if 0 < top_k < logits.numel():
        kth = logits.topk(top_k).values[-1]
        logits[logits < kth] = float("-inf")
    return logits.softmax(-1)
''')
TEMPERATURE_LAST = (_PROCESS_HEAD + "    # divides by the temperature after the filters\n" + _PENALTY
                    + _PROCESS_TAIL.replace("    logits = logits / temperature\n", "").replace(
                        "    return logits.softmax(-1)\n", "    return (logits / temperature).softmax(-1)\n"))
NO_PENALTY = (_PROCESS_HEAD + "    # forgets the repetition penalty\n    logits = logits.clone().float()\n" + _PROCESS_TAIL)

_DIVERSITY_HEAD = "def diversity_stats(run):\n"
_DIVERSITY_REST = '''    repeats = trigrams = 0
    for s in run["samples"]:
        seen = set()
        for i in range(len(s) - 2):
            trigrams += 1
            repeats += tuple(s[i:i + 3]) in seen
            seen.add(tuple(s[i:i + 3]))
'''
_DIVERSITY_RETURN = '''    return {"distinct_2": len(set(bigrams)) / len(bigrams) if bigrams else 0.0,
            "repetition": repeats / trigrams if trigrams else 0.0,
            "mean_entropy": sum(run["entropies"]) / len(run["entropies"])}
'''
_POOLED_BIGRAMS = '''    bigrams = [tuple(s[i:i + 2]) for s in run["samples"] for i in range(len(s) - 1)]
'''

_MEASURE = """import statistics
import time


def measure_sampling(runs, clock=time.perf_counter, warmup=1, repeats=5):   # MISTAKE
    result = {}
    for name, request in runs.items():
        for _ in range(warmup):
            request()
        samples = []
        for _ in range(repeats):
            start = clock()
            request()
            samples.append(clock() - start)
        result[name] = {"median": statistics.median(samples), "min": min(samples), "max": max(samples),
                        "n": len(samples)}
    result["ratio"] = result["filtered"]["median"] / result["greedy"]["median"]
    return result
"""
MEASURE_KEEPS_WARMUP = _MEASURE.replace("# MISTAKE", "# times the warm-up too").replace(
    """        for _ in range(warmup):
            request()
        samples = []
        for _ in range(repeats):""", """        samples = []
        for _ in range(warmup + repeats):""").replace('"n": len(samples)', '"n": repeats')
MEASURE_MEAN = _MEASURE.replace('"median": statistics.median(samples)', '"median": statistics.fmean(samples)')
MEASURE_MIN = _MEASURE.replace('"median": statistics.median(samples)', '"median": min(samples)')
MEASURE_INVERTED = _MEASURE.replace('result["filtered"]["median"] / result["greedy"]["median"]',
                                    'result["greedy"]["median"] / result["filtered"]["median"]')
MEASURE_PERF_COUNTER = _MEASURE.replace("start = clock()", "start = time.perf_counter()").replace(
    "samples.append(clock() - start)", "samples.append(time.perf_counter() - start)")

MISTAKES = {
    "test_process_logits_cases": [
        (DIVIDES_ALL, "MULTIPLIES a negative"),
        (PER_OCCURRENCE, "a token repeated in the history is penalized once"),
        (DROPS_CROSSING, "top_p 0.9: the token that crosses 0.9 stays"),
        (MIN_P_ABSOLUTE, "min_p is relative"),
        (IN_PLACE, "changed the logits it was given"),
    ],
    "test_process_logits_random": [
        (TOP_P_FIRST, "random case"),
        (TEMPERATURE_LAST, "divide the logits by the temperature first"),
        (PER_OCCURRENCE, "once to every token that occurs in the history"),
    ],
    "test_fused_mask_cases": [
        (kernel_mistake("topk_off_by_one"), "off by one at the k-th largest"),
        (kernel_mistake("row_not_offset"), "your kernel never stored it"),
        (kernel_mistake("min_p_absolute"), "min_p=0.1"),
    ],
    "test_fused_mask_random": [
        (kernel_mistake("crossing_dropped"), "the most likely token always stays"),
        (kernel_mistake("no_renormalize"), "top_p=0.7, min_p=0.3"),
        (kernel_mistake("topk_off_by_one"), "row 4 (every filter off)"),
    ],
    "test_measure_sampling": [
        (MEASURE_KEEPS_WARMUP, "drop the first `warmup` calls"),
        (MEASURE_MEAN, "the mean: one slow outlier"),
        (MEASURE_MIN, "the minimum"),
        (MEASURE_INVERTED, "inverted"),
        (MEASURE_PERF_COUNTER, "the FakeClock was never read"),
    ],
    "test_measure_diversity": [
        (_DIVERSITY_HEAD + '''    # distinct-2 averaged per sample
    per_sample = [len(set(zip(s, s[1:]))) / (len(s) - 1) for s in run["samples"] if len(s) > 1]
''' + _DIVERSITY_REST + '''    return {"distinct_2": sum(per_sample) / len(per_sample) if per_sample else 0.0,
            "repetition": repeats / trigrams if trigrams else 0.0,
            "mean_entropy": sum(run["entropies"]) / len(run["entropies"])}
''', "pool the bigrams of all samples first"),
        (_DIVERSITY_HEAD + "    # repeats counted across samples\n" + _POOLED_BIGRAMS + '''    grams = [tuple(s[i:i + 3]) for s in run["samples"] for i in range(len(s) - 2)]
    repeats, trigrams = len(grams) - len(set(grams)), len(grams)
''' + _DIVERSITY_RETURN, "samples do not see each other"),
        (_DIVERSITY_HEAD + "    # entropy converted to bits\n    import math\n" + _POOLED_BIGRAMS + _DIVERSITY_REST
         + _DIVERSITY_RETURN.replace('/ len(run["entropies"])}', '/ len(run["entropies"]) / math.log(2)}'),
         "nats already"),
        (_DIVERSITY_HEAD + "    # bigrams across the joined samples\n"
         + '''    joined = [t for s in run["samples"] for t in s]
    bigrams = [tuple(joined[i:i + 2]) for i in range(len(joined) - 1)]
''' + _DIVERSITY_REST + _DIVERSITY_RETURN, "never spans two samples"),
    ],
    "test_answer_worst_case_usd": [
        ("answer_worst_case_usd = 500 * 0.60 / 1e6   # one completion\n", "each of the n completions"),
        ("answer_worst_case_usd = 4 * 500 * 0.60   # forgets per million\n", "per MILLION tokens"),
        ("answer_worst_case_usd = None\n", "set it to a number"),
    ],
    "test_valid_person": [
        ('''def valid_person(text):   # lets json.loads raise
    value = json.loads(text)
    return isinstance(value, dict) and set(value) == {"name", "age", "city"} and isinstance(value["age"], int) \\
        and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120 \\
        and all(isinstance(value[k], str) and 1 <= len(value[k]) <= 20 for k in ("name", "city"))
''', "catch json.JSONDecodeError"),
        ('''def valid_person(text):   # takes true for an age
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"name", "age", "city"} and isinstance(value["age"], int) \\
        and 0 <= value["age"] <= 120 and all(isinstance(value[k], str) and 1 <= len(value[k]) <= 20 for k in ("name", "city"))
''', "true is a bool"),
        ('''def valid_person(text):   # allows extra keys
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and {"name", "age", "city"} <= set(value) and isinstance(value["age"], int) \\
        and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120 \\
        and all(isinstance(value[k], str) and 1 <= len(value[k]) <= 20 for k in ("name", "city"))
''', "additionalProperties"),
        ('''def valid_person(text):   # strips a Markdown fence first
    text = text.strip().removeprefix("```json").removesuffix("```")
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"name", "age", "city"} and isinstance(value["age"], int) \\
        and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120 \\
        and all(isinstance(value[k], str) and 1 <= len(value[k]) <= 20 for k in ("name", "city"))
''', "a Markdown fence around it is not JSON"),
        ('''def valid_person(text):   # checks only the name's length
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, dict) and set(value) == {"name", "age", "city"} and isinstance(value["age"], int) \\
        and not isinstance(value["age"], bool) and 0 <= value["age"] <= 120 and isinstance(value["city"], str) \\
        and isinstance(value["name"], str) and 1 <= len(value["name"]) <= 20
''', "an empty city"),
    ],
}


@pytest.fixture(scope="module")
def graded_namespace(llm, experiments, solution, wrong_kernels) -> dict:
    """What the graded test cells read: the master's solution cells, the default model, the notebook's experiments,
    and the state the run cells leave (a short engine run on the solution, a sweep stub)."""
    ns = dict(solution)
    ns.update(notebook_functions(MASTER, "mask_spec"), SamplingParams=SamplingParams, WRONG_MASK=wrong_kernels)
    ns.update(llm=llm, LearnerSampler=experiments["LearnerSampler"], run_with_sampler=experiments["run_with_sampler"],
              sweep=STUB_SWEEP)
    return ns


@pytest.mark.parametrize("grade_id, mistake, names_the_case",
                         [(gid, m, case) for gid, cases in MISTAKES.items() for m, case in cases],
                         ids=[f"{gid}-{i}" for gid, cases in MISTAKES.items() for i in range(len(cases))])
def test_graded_cell_fails_on_a_plausible_mistake(graded_namespace, grade_id, mistake, names_the_case):
    assert_check_fails(MASTER, grade_id, graded_namespace, mistake, names_the_case)


# --------------------------------------------------------------------- the fused mask kernel and the timing harness
def test_solution_kernel_matches_the_reference_on_every_case(solution):
    for seed, cases in ((0, lab09.MASK_CASES), (5, lab09.HIDDEN_MASK_CASES), (9, lab09.MASK_CASES[2:])):
        lab09.check_mask_kernel(solution["fused_mask"], cases=cases, seed=seed, device=KERNEL_DEVICE)


def test_mask_reference_is_the_engine_filter_on_the_real_vocabulary():
    from minillm.layers.sampler import filter_batch

    for seed, row in enumerate(({"top_k": 50, "top_p": 0.9, "min_p": 0.05}, {"top_p": 0.7}, {"top_k": 3},
                                {"min_p": 0.2}, {"top_k": 100, "top_p": 0.95})):
        logits, top_k, top_p, min_p = lab09.make_mask_inputs([row] * 3, 49152, seed)
        want = filter_batch(logits, torch.ones(3), top_k.long(), top_p, min_p)
        assert torch.equal(lab09.mask_reference(logits, top_k, top_p, min_p), want), row


def test_stub_kernel_raises_not_implemented(tmp_path):
    student = nbformat.read(REPO_ROOT / "labs" / "09_decoding_settings.ipynb", as_version=4)
    kernel = nbgrader_cells(student)["fused_mask_kernel"][0].source
    assert "raise NotImplementedError()" in kernel and "tl.store" not in kernel and "e = tl.exp" in kernel
    path = tmp_path / "lab09_stub.py"
    path.write_text(MODULE_HEADER + "\n" + kernel + "\n\n" + _launcher_cell() + "\n")
    with pytest.raises(NotImplementedError, match="fused_mask_kernel is still a stub"):
        import_file(path, "lab09_stub").fused_mask(*lab09.make_mask_inputs([{}], 8))


def test_mask_check_names_a_kernel_that_keeps_everything():
    with pytest.raises(CheckFailed, match="a filter that is on was never applied"):
        lab09.check_mask_kernel(lambda logits, k, p, m: logits.clone())
    with pytest.raises(CheckFailed, match="never stored"):
        lab09.check_mask_kernel(lambda logits, k, p, m: torch.full_like(logits, float("nan")))


def test_engine_runs_the_learner_kernel_with_its_own_tokens(llm, solution, experiments, capsys):
    prompts = lab09.chat_prompts(llm, [lab09.STORY_MESSAGES])
    result = experiments["run_with_mask"](llm, solution["fused_mask"], prompts, 3)
    assert result["equal"] and result["launches"] == 3 and result["vocab"] == 49152, result
    lab09.check_mask_run(result)
    lab09.print_mask_run(result)
    assert "the same as the engine's own sampler" in capsys.readouterr().out
    with pytest.raises(CheckFailed, match="part from the engine's at output token 1"):
        lab09.check_mask_run({**result, "equal": False, "expected": [[result["tokens"][0][0], -1, -1]]})
    lab09.print_mask_timing(lab09.time_mask_kernel(solution["fused_mask"]) if KERNEL_DEVICE == "cuda" else {"device": "cpu"})
    assert "No GPU here" in capsys.readouterr().out or KERNEL_DEVICE == "cuda"


def test_measure_sampling_on_a_fake_engine_and_its_printouts(solution, capsys):
    lab09.check_measure_sampling(solution["measure_sampling"])
    clock = FakeClock()
    costs = {"greedy": [1.0, 0.2, 0.3, 0.25], "filtered": [1.0, 0.4, 0.5, 0.45]}
    got = solution["measure_sampling"](lab09.FakeSamplingEngine(clock, costs).runs(), clock=clock, warmup=1, repeats=3)
    assert got["greedy"]["median"] == pytest.approx(0.25) and got["filtered"]["median"] == pytest.approx(0.45)
    assert got["ratio"] == pytest.approx(1.8) and got["greedy"]["min"] == pytest.approx(0.2)
    lab09.print_sampling(got, 8)
    out = capsys.readouterr().out
    assert "reference" in out and lab09.REFERENCE_SAMPLING["hardware"] in out and "1.8" in out
    fig = lab09.sampling_figure(got, 8, DEVICE)
    assert [round(y, 6) for y in fig.data[0].y] == [round(0.25 / 8 * 1e3, 6), round(0.45 / 8 * 1e3, 6)]
    lab09.print_your_numbers(None, None, None, None, got, None, DEVICE)
    assert "ratio 1.800" in capsys.readouterr().out


@pytest.mark.slow
def test_solution_kernel_compiles_for_sm80_and_sm90(tmp_path):
    """The learner's kernel at the default model's vocabulary (49,152 lanes rounded to 65,536), compiled ahead of
    time for the GPUs without one (the module header's interpreter switch left out)."""
    from kernel_utils import assert_compiles_for_gpus

    header = MODULE_HEADER.replace('    os.environ.setdefault("TRITON_INTERPRET", "1")', "    pass")
    path = tmp_path / "lab09_aot.py"
    path.write_text(solution_source(MASTER, header, LAUNCHER))
    assert_compiles_for_gpus(path, [("fused_mask_kernel",
                                     {"out_ptr": "*fp32", "logits_ptr": "*fp32", "top_k_ptr": "*i32",
                                      "top_p_ptr": "*fp32", "min_p_ptr": "*fp32", "V": "i32", "BLOCK_V": "constexpr"},
                                     {"BLOCK_V": 65536})])

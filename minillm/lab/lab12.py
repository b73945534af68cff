"""Lab 12 helpers — distillation and on-device: checks for the distillation loss, the layer selection, the sweep's
timing harness (a FakeClock and a fake model with scripted costs), the rule that picks the smallest model meeting
the bar and the short answers; the tables and figures of the notebook's experiments (the toggle, the Pareto sweep,
the GGUF export, the memory budget). The experiments themselves are `def`s in the notebook.

The learner writes, with fixed signatures:

    distillation_loss(student_logits, teacher_logits, labels, temperature=2.0, alpha=0.5) -> 0-dim tensor
        alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, labels),
        each part averaged over the positions (rows); logits [positions, vocab], labels [positions]
    select_layers(num_layers, num_keep) -> list[int]      the teacher's layers the student keeps, 0-based, ascending
    measure_speed(generate, num_tokens, clock=time.perf_counter, warmup=1, repeats=5) -> dict
    pick_model(rows, teacher_score, margin, cost="weight_bytes") -> the row, or None

and the short answers answer_q4_bits (Q4_0's bits per weight) and answer_smallest_ratio (from their own sweep).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence

import torch

from .common import (CheckFailed, FakeClock, call_learner, echo_prediction, format_si, is_close,  # noqa: F401
                     new_figure, passed, scripted_costs, timing_mistake, timing_summary)

# The bar: a student meets it when its held-out score is at most this far below the teacher's.
DEFAULT_MARGIN = 0.05
# Devices of the memory table: RAM and a typical memory bandwidth (bytes/s) of each.
DEVICES = (("phone, 4 GB", 4e9, 25e9), ("laptop, 8 GB", 8e9, 60e9), ("laptop, 16 GB", 16e9, 100e9))


def bits_per_weight(file_type: str) -> float:
    """Bits per weight of a GGUF format the lab exports: F16, or blocks of 32 weights with one float16 scale."""
    bits = {"F16": 16.0, "Q8_0": (32 * 8 + 16) / 32, "Q4_0": (32 * 4 + 16) / 32}
    if file_type not in bits:
        raise ValueError(f"file_type {file_type!r} is not one of {list(bits)}")
    return bits[file_type]


# =================================================================== quick mode's teacher
def tiny_teacher(tokenizer_dir, out_dir, num_layers: int = 4, hidden_size: int = 64, seed: int = 0):
    """Quick mode's stand-in teacher: a small random Llama with the default model's vocabulary and tokenizer (its
    answers are noise, but every step of the lab runs on it in seconds). Returns its directory."""
    import shutil
    from pathlib import Path

    from transformers import LlamaConfig, LlamaForCausalLM

    from ..distill.student import TOKENIZER_FILES

    if not 1 <= num_layers <= 64:
        raise ValueError(f"num_layers={num_layers} is outside 1..64")
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    source = json.loads((tokenizer_dir / "config.json").read_text())
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=source["vocab_size"], hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=hidden_size // 4, max_position_embeddings=2048, tie_word_embeddings=True,
                         bos_token_id=source.get("bos_token_id"), eos_token_id=source.get("eos_token_id"),
                         pad_token_id=source.get("pad_token_id"))
    LlamaForCausalLM(config).save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file() and name != "generation_config.json":
            shutil.copyfile(tokenizer_dir / name, out_dir / name)
    return out_dir


# =================================================================== A. the distillation loss
def reference_loss(student_logits, teacher_logits, labels, temperature: float = 2.0, alpha: float = 0.5) -> float:
    """The reference value (minillm.distill's float64 spec, one position at a time)."""
    from ..distill.loss import reference_distillation_loss

    return reference_distillation_loss(student_logits, teacher_logits, labels, temperature, alpha)


def _loss_variants(student, teacher, labels, temperature: float, alpha: float) -> list[tuple[float, str]]:
    """The value each usual mistake gives, with what it says."""
    s, t = student.double(), teacher.double()
    n, vocab = s.shape
    T = temperature

    def kl(p_logits, q_logits, tp=T, tq=T, reduce="mean"):   # KL(softmax(p / tp) || softmax(q / tq)) per row
        log_p, log_q = torch.log_softmax(p_logits / tp, -1), torch.log_softmax(q_logits / tq, -1)
        rows = (log_p.exp() * (log_p - log_q)).sum(-1)
        return float(rows.sum() if reduce == "sum" else rows.mean())

    ce_rows = -torch.log_softmax(s, -1)[torch.arange(n), labels]
    ce, ce_sum = float(ce_rows.mean()), float(ce_rows.sum())
    good_kl = kl(t, s)
    return [
        (alpha * good_kl + (1 - alpha) * ce, "the KL part is not multiplied by T^2 (temperature ** 2): softening "
                                            "shrinks its gradients by 1/T^2, the T^2 puts them back"),
        (alpha * T * good_kl + (1 - alpha) * ce, "the KL part is multiplied by T, not by T^2"),
        (alpha * T ** 2 * kl(s, t) + (1 - alpha) * ce, "the KL is reversed: it is KL(teacher || student), the "
                                                       "teacher's softened distribution weighting the log-ratio"),
        (alpha * T ** 2 * kl(t, s, tq=1.0) + (1 - alpha) * ce, "the temperature is on one side only: divide the "
                                                               "student's logits by T too"),
        (alpha * T ** 2 * kl(t, s, tp=1.0) + (1 - alpha) * ce, "the temperature is on one side only: divide the "
                                                               "teacher's logits by T too"),
        (alpha * T ** 2 * kl(t, s, reduce="sum") + (1 - alpha) * ce_sum,
         "the parts are summed over the positions: average them over the positions (rows)"),
        (alpha * T ** 2 * kl(t, s, reduce="sum") / (n * vocab) + (1 - alpha) * ce,
         "the KL is averaged over positions and vocabulary (F.kl_div's reduction='mean'): sum over the vocabulary, "
         "average over the positions (reduction='batchmean')"),
        (alpha * T ** 2 * kl(t, s, reduce="sum") + (1 - alpha) * ce,
         "the KL part is summed over the positions: average it over the positions (rows)"),
        ((1 - alpha) * T ** 2 * good_kl + alpha * ce, "alpha is swapped: alpha weights the KL, 1 - alpha the "
                                                      "cross-entropy"),
        (alpha * T ** 2 * good_kl + (1 - alpha) * float(-torch.log_softmax(s / T, -1)[torch.arange(n), labels].mean()),
         "the cross-entropy is on the softened student (logits / T): the hard labels use the plain logits"),
        (alpha * T ** 2 * good_kl, "the cross-entropy part is missing"),
        ((1 - alpha) * ce, "the KL part is missing"),
    ]


def loss_cases(seed: int = 0) -> list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, float, float]]:
    """(name, student logits, teacher logits, labels, temperature, alpha): fresh random logits of odd shapes."""
    generator = torch.Generator().manual_seed(1200 + seed)
    cases = []
    for name, rows, vocab, temperature, alpha in (
            ("5 positions, 11 tokens, T=2, alpha=0.3", 5, 11, 2.0, 0.3),
            ("7 positions, 37 tokens, T=4, alpha=1 (KL only: the T^2 scale)", 7, 37, 4.0, 1.0),
            ("3 positions, 29 tokens, T=0.5, alpha=0.6", 3, 29, 0.5, 0.6),
            ("9 positions, 53 tokens, T=1, alpha=0 (labels only)", 9, 53, 1.0, 0.0),
            ("1 position, 8 tokens, T=3, alpha=0.5", 1, 8, 3.0, 0.5),
            ("16 positions, 101 tokens, T=2, alpha=0.5", 16, 101, 2.0, 0.5)):
        student = torch.randn(rows, vocab, generator=generator) * 3
        teacher = torch.randn(rows, vocab, generator=generator) * 3
        labels = torch.randint(0, vocab, (rows,), generator=generator)
        cases.append((name, student, teacher, labels, temperature, alpha))
    return cases


def check_distillation_loss(distillation_loss: Callable, seed: int = 0) -> None:
    """The learner's loss against the reference on fresh random logits (several T and alpha, the T^2 scale with
    alpha=1, labels only with alpha=0); a wrong value names the usual mistake it matches."""
    for name, student, teacher, labels, temperature, alpha in loss_cases(seed):
        call = f"distillation_loss(<{name}>)"
        got = call_learner(distillation_loss, (student.clone(), teacher.clone(), labels.clone(), temperature, alpha),
                           call)
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            raise CheckFailed(f"{call} returned {type(got).__name__}"
                              f"{'' if not isinstance(got, torch.Tensor) else f' of shape {tuple(got.shape)}'}; "
                              "expected a one-number tensor (training calls .backward() on it)")
        want = reference_loss(student, teacher, labels, temperature, alpha)
        value = float(got)
        if not math.isfinite(value) or not is_close(value, want, rel=1e-4, abs_tol=1e-6):
            why = next((hint for wrong, hint in _loss_variants(student, teacher, labels, temperature, alpha)
                        if is_close(value, wrong, rel=1e-4, abs_tol=1e-6) and not is_close(wrong, want, rel=1e-4)),
                       "compare it with the formula above, part by part (alpha=1 leaves the KL alone, alpha=0 the "
                       "cross-entropy)")
            raise CheckFailed(f"{call} returned {value:.6g}, expected {want:.6g}: {why}")
    passed("distillation_loss", len(loss_cases(seed)))


# =================================================================== B. the layer selection
SELECT_CASES = ((30, 6), (30, 2), (30, 30), (12, 5), (7, 3), (6, 3), (30, 1), (2, 2), (24, 4), (9, 9))


def reference_select(num_layers: int, num_keep: int) -> list[float]:
    """The ideal (real) positions of the kept layers: first and last, evenly spread; one layer: the last."""
    if num_keep == 1:
        return [float(num_layers - 1)]
    return [i * (num_layers - 1) / (num_keep - 1) for i in range(num_keep)]


def _select_hint(num_layers: int, num_keep: int, got: list) -> str:
    ideal = reference_select(num_layers, num_keep)
    if got == list(range(num_keep)):
        return "the first num_keep layers in a block: spread them from the first to the last"
    if got == list(range(1, num_keep + 1)) or got == [round(x) + 1 for x in ideal]:
        return "the indices are 1-based: layers are numbered from 0"
    if num_keep > 1 and got and got[0] == 0 and got[-1] != num_layers - 1:
        return (f"the last layer ({num_layers - 1}) is not kept: it turns features into the head's input; space the "
                "steps over num_layers - 1")
    if got == [math.floor(x) for x in ideal]:
        return "the positions are rounded down: take the nearest layer"
    return "the i-th kept layer is the layer nearest to i * (num_layers - 1) / (num_keep - 1)"


def check_select_layers(select_layers: Callable) -> None:
    """num_keep distinct layers, ascending, 0-based, the first and the last kept and the rest evenly spread: each
    within half a layer of i * (num_layers - 1) / (num_keep - 1) (either neighbour at an exact half); one layer:
    the last."""
    for num_layers, num_keep in SELECT_CASES:
        call = f"select_layers({num_layers}, {num_keep})"
        got = call_learner(select_layers, (num_layers, num_keep), call)
        if not isinstance(got, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) for i in got):
            raise CheckFailed(f"{call} returned {got!r}; expected a list of ints (layer indices)")
        got = list(got)
        if len(got) != num_keep:
            raise CheckFailed(f"{call} returned {len(got)} layers ({got}); expected {num_keep}")
        if got != sorted(set(got)):
            raise CheckFailed(f"{call} returned {got}: the layers must be distinct and ascending")
        if got[0] < 0 or got[-1] > num_layers - 1:
            raise CheckFailed(f"{call} returned {got}: indices run from 0 to {num_layers - 1}: "
                              + _select_hint(num_layers, num_keep, got))
        ideal = reference_select(num_layers, num_keep)
        if any(abs(g - x) > 0.5 + 1e-9 for g, x in zip(got, ideal)):
            raise CheckFailed(f"{call} returned {got}; evenly spread is {[round(x, 2) for x in ideal]} rounded to the "
                              f"nearest layer: {_select_hint(num_layers, num_keep, got)}")
    passed("select_layers", len(SELECT_CASES))


# =================================================================== C. the sweep's timing harness
class FakeModel:
    """A model whose generate(max_tokens) moves a FakeClock by scripted costs: one list for max_tokens=1 (the
    first token, TTFT), one for max_tokens=num_tokens; each call returns the tokens it generated."""

    def __init__(self, clock: FakeClock, num_tokens: int, ttft_costs: list[float], costs: list[float],
                 num_prompts: int = 3):
        self.clock, self.num_tokens, self.num_prompts = clock, num_tokens, num_prompts
        self.scripts = {1: list(ttft_costs), num_tokens: list(costs)}
        self.calls = {1: 0, num_tokens: 0}

    def __call__(self, max_tokens):
        if max_tokens not in self.scripts:
            raise CheckFailed(f"generate({max_tokens!r}) called: time generate(1) (the first token) and "
                              f"generate({self.num_tokens}) (num_tokens) only")
        index = self.calls[max_tokens]
        if index >= len(self.scripts[max_tokens]):
            raise CheckFailed(f"generate({max_tokens}) called more than warmup + repeats = "
                              f"{len(self.scripts[max_tokens])} times")
        self.calls[max_tokens] += 1
        self.clock.advance(self.scripts[max_tokens][index])
        return self.num_prompts * max_tokens


SPEED_CASES = ((1, 5, 0), (2, 4, 1), (0, 3, 2), (3, 7, 3))   # (warmup, repeats, seed)


def expected_speed(ttft_costs: Sequence[float], costs: Sequence[float], warmup: int, tokens: int) -> dict:
    ttft, total = timing_summary(list(ttft_costs[warmup:])), timing_summary(list(costs[warmup:]))
    return {"ttft_s": ttft["median"], "median_s": total["median"], "min_s": total["min"], "max_s": total["max"],
            "tokens_per_s": tokens / total["median"]}


def check_measure_speed(measure_speed: Callable) -> None:
    """The harness on a fake model and a FakeClock: warm-up calls dropped, medians reported, min and max the spread,
    tokens/s from the tokens a call generated and the median; each call of the right length counted."""
    num_tokens = 16
    for warmup, repeats, seed in SPEED_CASES:
        clock = FakeClock()
        ttft_costs = scripted_costs(0.05, warmup, repeats, seed=seed)
        costs = scripted_costs(0.8, warmup, repeats, seed=seed + 100)
        model = FakeModel(clock, num_tokens, ttft_costs, costs)
        call = f"measure_speed(generate, {num_tokens}, clock, warmup={warmup}, repeats={repeats})"
        got = call_learner(measure_speed, (model, num_tokens, clock, warmup, repeats), call)
        if not isinstance(got, dict):
            raise CheckFailed(f"{call} returned {type(got).__name__}; expected a dict")
        for size in (1, num_tokens):
            if model.calls[size] != warmup + repeats:
                raise CheckFailed(f"{call} called generate({size}) {model.calls[size]} times; expected warmup + "
                                  f"repeats = {warmup + repeats}")
        want = expected_speed(ttft_costs, costs, warmup, model.num_prompts * num_tokens)
        for key, value in want.items():
            if key not in got:
                raise CheckFailed(f"{call} returned no {key!r} (keys {sorted(got)})")
            if not is_close(got[key], value, rel=1e-6):
                scripted = ttft_costs if key == "ttft_s" else costs
                why = ""
                if key in ("ttft_s", "median_s", "min_s", "max_s"):
                    why = timing_mistake(got[key], scripted, warmup)
                    if key in ("min_s", "max_s") and not why:
                        why = f"the {key[:3]} of the timed calls of generate({num_tokens}) (warm-up dropped)"
                elif is_close(got[key], num_tokens / want["median_s"], rel=1e-6):
                    why = "tokens/s counts every token a call generated: use what generate returns (all prompts)"
                elif is_close(got[key], model.num_prompts * num_tokens / statistics.fmean(costs[warmup:]), rel=1e-6):
                    why = "divided by the mean: divide by the median seconds of a call"
                raise CheckFailed(f"{call}: {key} = {got[key]!r}, expected {value:.6g}" + (f": {why}" if why else ""))
    passed("measure_speed", len(SPEED_CASES))


# =================================================================== D. the smallest model that meets the bar
def reference_pick(rows: Sequence[dict], teacher_score: float, margin: float, cost: str = "weight_bytes"):
    meeting = [(row[cost], -row["score"], index) for index, row in enumerate(rows)
               if row["score"] >= teacher_score - margin - 1e-9]
    return rows[min(meeting)[2]] if meeting else None


def _row(name, score, weight_mb, tokens_per_s=100.0):
    return {"name": name, "score": score, "weight_bytes": int(weight_mb * 1e6), "tokens_per_s": tokens_per_s,
            "s_per_token": 1 / tokens_per_s}


PICK_CASES = (   # (what it shows, rows, teacher_score, margin, cost)
    ("the smallest of those within the margin",
     [_row("teacher", 0.90, 540), _row("8 layers fp32", 0.88, 200), _row("4 layers fp32", 0.70, 150),
      _row("8 layers int8", 0.87, 60), _row("4 layers int8", 0.69, 45)], 0.90, 0.05, "weight_bytes"),
    ("a wide margin reaches the smallest student",
     [_row("teacher", 0.80, 540), _row("2 layers int4", 0.55, 20), _row("4 layers int4", 0.75, 30)], 0.80, 0.3,
     "weight_bytes"),
    ("a score exactly at the bar meets it (0.85 = 0.90 - 0.05; compare with a 1e-9 tolerance)",
     [_row("teacher", 0.90, 540), _row("6 layers", 0.85, 180), _row("4 layers", 0.849, 150)], 0.90, 0.05,
     "weight_bytes"),
    ("nobody but the teacher meets a margin of 0: the teacher is the pick",
     [_row("teacher", 0.90, 540), _row("8 layers", 0.89, 200), _row("4 layers", 0.60, 150)], 0.90, 0.0,
     "weight_bytes"),
    ("no row meets the bar: None",
     [_row("8 layers", 0.50, 200), _row("4 layers", 0.40, 150)], 0.90, 0.05, "weight_bytes"),
    ("a tie on cost: the higher score",
     [_row("teacher", 0.90, 540), _row("A", 0.86, 100), _row("B", 0.89, 100), _row("C", 0.88, 100)], 0.90, 0.05,
     "weight_bytes"),
    ("a tie on cost and score: the first row",
     [_row("teacher", 0.90, 540), _row("first", 0.88, 100), _row("second", 0.88, 100)], 0.90, 0.05, "weight_bytes"),
    ("another cost: seconds per token",
     [_row("teacher", 0.90, 540, 20.0), _row("8 layers fp32", 0.88, 200, 60.0), _row("8 layers int4", 0.86, 40, 45.0),
      _row("2 layers", 0.30, 80, 200.0)], 0.90, 0.05, "s_per_token"),
)


def _pick_hint(got, rows, teacher_score, margin, cost) -> str:
    def name_of(row):
        return row.get("name") if isinstance(row, dict) else row

    if got is None:
        return "a row meets the bar: return it"
    guesses = [
        (reference_pick([r for r in rows if r["score"] > teacher_score - margin + 1e-9], teacher_score, margin, cost),
         "a score exactly at the bar meets it (>=, with a 1e-9 tolerance)"),
        (max(rows, key=lambda r: r["score"]), "that is the best score: take the cheapest row that meets the bar"),
        (min(rows, key=lambda r: r[cost]), "that row is the cheapest but misses the bar (teacher_score - margin)"),
        (reference_pick(rows, teacher_score, teacher_score * margin, cost),
         "the margin is in points of score (teacher_score - margin), not a fraction of the teacher's score"),
    ]
    for row, why in guesses:
        if row is not None and got == row:
            return why
    if isinstance(got, int) and not isinstance(got, bool):
        return "return the row itself (the dict), not its index"
    return "among the rows with score >= teacher_score - margin, the smallest cost; a tie: the higher score, then the first"


def check_pick_model(pick_model: Callable) -> None:
    """Hand-made sweeps: the cheapest row within the margin, ties (higher score, then the first row), a score
    exactly at the bar, no row meeting it (None), the teacher as the pick, another cost column."""
    for what, rows, teacher_score, margin, cost in PICK_CASES:
        call = f"pick_model(<{what}>, teacher_score={teacher_score}, margin={margin}, cost={cost!r})"
        copies = [dict(r) for r in rows]
        got = call_learner(pick_model, (copies, teacher_score, margin, cost), call)
        if copies != rows:
            raise CheckFailed(f"{call} changed the rows: leave them as they are")
        want = reference_pick(rows, teacher_score, margin, cost)
        if want is None and got is not None:
            raise CheckFailed(f"{call} returned {got.get('name') if isinstance(got, dict) else got!r}; expected None "
                              "(no row meets the bar)")
        if got != want:
            shown = got.get("name") if isinstance(got, dict) else repr(got)
            raise CheckFailed(f"{call} returned {shown}, expected {want['name'] if want else None}: "
                              + _pick_hint(got, rows, teacher_score, margin, cost))
    passed("pick_model", len(PICK_CASES))


# =================================================================== E. short answers
def check_answer_q4_bits(answer) -> None:
    if answer is None:
        raise CheckFailed("answer_q4_bits is still None: set it to a number of bits")
    if not isinstance(answer, (int, float)) or isinstance(answer, bool):
        raise CheckFailed(f"answer_q4_bits = {answer!r}: a number of bits per weight")
    want = bits_per_weight("Q4_0")
    if is_close(answer, 4.0):
        raise CheckFailed("answer_q4_bits = 4: the block's float16 scale is stored too, 16 bits shared by 32 weights")
    if is_close(answer, (32 * 4 + 32) / 32):
        raise CheckFailed(f"answer_q4_bits = {answer}: the scale is a float16 (16 bits), not a float32")
    if not is_close(answer, want, rel=1e-3):
        raise CheckFailed(f"answer_q4_bits = {answer}: count the bits of one block (32 weights of 4 bits, one float16 "
                          "scale) and divide by its 32 weights")
    print(f"✓ answer_q4_bits: {want} bits per weight (Q8_0: {bits_per_weight('Q8_0')})")


def smallest_ratio(rows: Sequence[dict]) -> float:
    """The teacher's weight bytes over the smallest point's, in a sweep's rows."""
    teacher = next(r for r in rows if r["name"] == "teacher fp32")
    return teacher["weight_bytes"] / min(r["weight_bytes"] for r in rows)


def check_answer_smallest_ratio(answer, rows: Sequence[dict]) -> None:
    if answer is None:
        raise CheckFailed("answer_smallest_ratio is still None: set it from your sweep's table")
    if not isinstance(answer, (int, float)) or isinstance(answer, bool):
        raise CheckFailed(f"answer_smallest_ratio = {answer!r}: a number (teacher's bytes / smallest point's bytes)")
    want = smallest_ratio(rows)
    if is_close(answer, 1 / want, rel=0.03):
        raise CheckFailed(f"answer_smallest_ratio = {answer}: that is smallest / teacher; divide the other way")
    if not is_close(answer, want, rel=0.03):
        raise CheckFailed(f"answer_smallest_ratio = {answer}: your sweep's table gives {want:.3g} (the teacher's "
                          "weight MB over the smallest point's), within 3%")
    print(f"✓ answer_smallest_ratio: {want:.3g}x fewer weight bytes than the teacher")


# =================================================================== F. tables and figures
def print_toggle(rows: dict[str, dict]) -> None:
    """The held-out scores of the toggle: one row per model."""
    print(f"{'model':<22}{'layers':>7}{'params M':>10}{'top-1 agree':>13}{'loss first -> last':>22}")
    for name, row in rows.items():
        loss = "" if not row.get("history") else f"{row['history'][0]['loss']:.2f} -> {row['history'][-1]['loss']:.2f}"
        print(f"{name:<22}{row['layers']:>7}{row['params_m']:>10.1f}{row['agreement']:>13.1%}{loss:>22}")


def loss_figure(histories: dict[str, list[dict]], device: str):
    fig = new_figure("distillation: the training loss per step", "step", "loss", device=device)
    for name, history in histories.items():
        fig.add_scatter(x=[h["step"] for h in history], y=[h["loss"] for h in history], name=name, mode="lines+markers")
    return fig


def pareto_front(rows: Sequence[dict], cost: str = "weight_bytes") -> list[dict]:
    """The rows no other row beats on both cost (lower) and score (higher), by cost."""
    front, best = [], -math.inf
    for row in sorted(rows, key=lambda r: (r[cost], -r["score"])):
        if row["score"] > best:
            front.append(row)
            best = row["score"]
    return front


def print_sweep(rows: Sequence[dict]) -> None:
    print(f"{'point':<22}{'weights MB':>11}{'score':>8}{'TTFT ms':>9}{'tokens/s':>10}{'spread (s)':>16}")
    for row in rows:
        print(f"{row['name']:<22}{row['weight_bytes'] / 1e6:>11.1f}{row['score']:>8.1%}{row['ttft_s'] * 1e3:>9.1f}"
              f"{row['tokens_per_s']:>10.1f}{row['min_s']:>8.3f}-{row['max_s']:.3f}")


def pareto_figure(rows: Sequence[dict], teacher_score: float, margin: float, pick: dict | None, device: str):
    """Score against weight bytes (log), each point labelled; the Pareto front, the bar, the pick."""
    fig = new_figure("the smallest model that meets the bar", "weight bytes (MB, log)", "held-out score",
                     device=device, log_x=False)
    fig.update_xaxes(type="log")
    fig.add_scatter(x=[r["weight_bytes"] / 1e6 for r in rows], y=[r["score"] for r in rows], mode="markers+text",
                    text=[r["name"] for r in rows], textposition="top center", name="sweep points",
                    hovertext=[f"{r['tokens_per_s']:.0f} tokens/s, TTFT {r['ttft_s'] * 1e3:.0f} ms" for r in rows])
    front = pareto_front(rows)
    fig.add_scatter(x=[r["weight_bytes"] / 1e6 for r in front], y=[r["score"] for r in front], mode="lines",
                    name="Pareto front", line={"dash": "dot"})
    fig.add_hline(y=teacher_score - margin, line_dash="dash", annotation_text=f"bar: teacher - {margin:g}")
    if pick is not None:
        fig.add_scatter(x=[pick["weight_bytes"] / 1e6], y=[pick["score"]], mode="markers", name=f"pick: {pick['name']}",
                        marker={"size": 16, "symbol": "circle-open", "line": {"width": 3}})
    return fig


def print_gguf(result: dict) -> None:
    """The export's files and the round trip: each format's bytes per weight, its distance to the source."""
    for row in result["formats"]:
        line = f"{row['file']}: {row['bytes'] / 1e6:.1f} MB"
        if row["bits_per_weight"] is not None:
            line += f", {row['bits_per_weight']:.2f} bits per weight (its tensors, norms included)"
        line += f"; {row['check']}"
        if row["error"] is not None:
            line += (f": relative error {row['error']:.2e} (bound {row['bound']:.0e}) "
                     f"{'✓' if row['error'] <= row['bound'] else '✗'}")
        print(line)
    print("\nModelfile (ollama create my-student -f Modelfile):")
    print(result["modelfile"])


def memory_rows(weight_bytes: float, kv_bytes_per_token: float, context_tokens: int, own_ram: float | None = None):
    """Weights + KV cache at `context_tokens`, against each device's RAM, and the decode bound its bandwidth allows
    (every weight read once per token)."""
    if context_tokens < 1:
        raise ValueError(f"context_tokens={context_tokens} must be >= 1")
    need = weight_bytes + kv_bytes_per_token * context_tokens
    devices = list(DEVICES) + ([("this machine", own_ram, None)] if own_ram else [])
    return [{"device": name, "ram": ram, "need": need, "fits": need <= 0.5 * ram,
             "tokens_per_s_bound": None if bandwidth is None else bandwidth / weight_bytes}
            for name, ram, bandwidth in devices]


def print_memory_budget(points: Sequence[tuple[str, float, float]], context_tokens: int, own_ram: float | None) -> None:
    """points: (name, weight bytes, KV bytes per token). A model "fits" in half the device's RAM (the OS and
    other apps keep the rest)."""
    for name, weight_bytes, kv_per_token in points:
        print(f"{name}: weights {format_si(weight_bytes, 'B')} + KV {format_si(kv_per_token * context_tokens, 'B')} "
              f"at {context_tokens} tokens")
        for row in memory_rows(weight_bytes, kv_per_token, context_tokens, own_ram):
            bound = "" if row["tokens_per_s_bound"] is None else f", <= {row['tokens_per_s_bound']:.0f} tokens/s"
            print(f"   {row['device']:<16} {format_si(row['ram'], 'B'):>9}: "
                  f"{'fits' if row['fits'] else 'too big'} ({row['need'] / row['ram']:.1%} of RAM){bound}")

"""Scoring a task's answers: exact-field or intent accuracy, valid-JSON rate; a student beside its teacher.

    score_answers(task, examples, texts)      {"score", "valid_json", "exact"} for one model's answers
    generate_answers(llm, task, examples)     greedy answers through minillm's engine (the student's short prompt,
                                              or the teacher's few-shot one with teacher=True)
    format_report(rows)                       a table: one row per model, the teacher first

The score of "extract" is the fraction of fields (name, order_id, product) equal to the true value, over
every example (an answer that is not a JSON object scores 0 on each field); of "intent", the fraction of
answers whose "intent" is the true one. "exact" is the fraction of answers equal to the true JSON as a whole.
"""

from __future__ import annotations

import json

from ..sampling import SamplingParams
from .tasks import Example, check_task, prompt_text
from .teacher import MAX_ANSWER_TOKENS, student_prompt_text

FIELDS = ("name", "order_id", "product")


def parse_answer(text: str) -> dict | None:
    """The answer as a dict, or None when it is not one JSON object."""
    try:
        value = json.loads(text.strip())
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def score_answers(task: str, examples: list[Example], texts: list[str]) -> dict:
    check_task(task)
    if len(examples) != len(texts) or not examples:
        raise ValueError(f"{len(examples)} examples and {len(texts)} answers: give one answer per example (>= 1)")
    parsed = [parse_answer(t) for t in texts]
    valid = sum(p is not None for p in parsed) / len(texts)
    exact = sum(p == json.loads(e.answer) for p, e in zip(parsed, examples)) / len(texts)
    if task == "extract":
        right = sum(p is not None and p.get(f) == e.fields[f] for p, e in zip(parsed, examples) for f in FIELDS)
        score = right / (len(FIELDS) * len(examples))
    else:
        score = sum(p is not None and p.get("intent") == e.intent for p, e in zip(parsed, examples)) / len(texts)
    return {"score": score, "valid_json": valid, "exact": exact}


def generate_answers(llm, task: str, examples: list[Example], teacher: bool = False, lora_request=None,
                     use_tqdm: bool = False, max_tokens: int = MAX_ANSWER_TOKENS) -> list[str]:
    """Greedy answers (up to the first newline) to the student's prompt, or the teacher's with teacher=True."""
    make_prompt = prompt_text if teacher else student_prompt_text
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["\n"])
    outputs = llm.generate([make_prompt(task, e.message) for e in examples], params, use_tqdm=use_tqdm,
                           lora_request=lora_request)
    return [o.outputs[0].text.split("\n", 1)[0].strip() for o in outputs]


def format_report(task: str, rows: dict[str, dict]) -> str:
    """rows: {model name: {"score", "valid_json", "exact", optionally "agreement", "layers", "params_m"}}."""
    label = "field acc" if task == "extract" else "intent acc"
    lines = [f"{'model':<26}{'layers':>7}{'params M':>10}{label:>12}{'valid JSON':>12}{'exact':>8}{'top-1 agree':>13}"]
    for name, row in rows.items():
        cells = [("" if row.get(key) is None else f"{row[key]:.1%}") for key in ("score", "valid_json", "exact", "agreement")]
        lines.append(f"{name:<26}{row.get('layers', ''):>7}{row.get('params_m', float('nan')):>10.1f}"
                     f"{cells[0]:>12}{cells[1]:>12}{cells[2]:>8}{cells[3]:>13}")
    return "\n".join(lines)

"""The teacher writes the training data: greedy answers through minillm's engine, then its logits on those answers.

    answers = teacher_answers(llm, task, examples)           [[token ids]] per example, batched greedy decoding
    items = teacher_items(teacher_model, tokenizer, task, examples, answers)
                                                             [TrainingItem]: the student's ids, the answer's
                                                             labels and the teacher's logits on every answer token

The teacher reads the few-shot prompt (`tasks.prompt_text`); the student reads only the instruction and
the message (`student_prompt_text`), so it learns to do without the solved examples: its prompt is about a
quarter as long. The teacher's logits come from the teacher's own context, one row per answer token, and
are stored in float16 (the KL is computed in float32). The few-shot prefix is run once and its KV cache
copied for every example, so each example costs only its message and answer.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect

import torch

from ..sampling import SamplingParams
from .tasks import Example, check_task, prompt_text

MAX_ANSWER_TOKENS = 48


def student_prompt_text(task: str, message: str) -> str:
    """What the student reads: the instruction and the message, without the teacher's solved examples."""
    full = prompt_text(task, message)
    head = full.split("\n\n", 1)[0]
    return f"{head}\n\nMessage: {message}\nJSON:"


@dataclasses.dataclass
class TrainingItem:
    """One training sequence: the student's ids (its prompt + the answer) and what each answer position learns."""
    input_ids: list[int]            # student prompt + answer tokens
    answer_start: int               # index in input_ids of the first answer token
    answer_ids: list[int]           # the teacher's greedy answer tokens (the hard labels)
    teacher_logits: torch.Tensor | None   # [len(answer_ids), vocab] float16, or None (labels-only training)


def _answer_ids(token_ids: list[int], tokenizer) -> list[int]:
    """The answer up to and including its end: the first token that holds a newline (the few-shot format's end) or
    an end-of-sequence token (SmolLM2 often closes its turn instead; the student then learns to stop by itself)."""
    kept = []
    for token in token_ids:
        kept.append(token)
        if token in tokenizer.all_special_ids or "\n" in tokenizer.decode([token]):
            break
    return kept


def teacher_answers(llm, task: str, examples: list[Example], lora_request=None, use_tqdm: bool = True,
                    max_tokens: int = MAX_ANSWER_TOKENS) -> list[list[int]]:
    """The teacher's greedy answer to each example's few-shot prompt, as token ids ending at the newline."""
    check_task(task)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["\n"])
    outputs = llm.generate([prompt_text(task, e.message) for e in examples], params, use_tqdm=use_tqdm,
                           lora_request=lora_request)
    answers = []
    for output in outputs:
        ids = list(output.outputs[0].token_ids)
        answers.append(_answer_ids(ids, llm.tokenizer) or ids[:1])
    return answers


def decode_answer(tokenizer, answer_ids: list[int]) -> str:
    """The answer's text as generate() gives it: up to the newline, special tokens (the end of the turn) left out."""
    return tokenizer.decode(answer_ids, skip_special_tokens=True).split("\n", 1)[0].strip()


def _prefix_text(task: str) -> str:
    marker = "Message: \u0000"
    return prompt_text(task, "\u0000").rsplit(marker, 1)[0] + "Message:"


@torch.no_grad()
def teacher_items(teacher, tokenizer, task: str, examples: list[Example], answers: list[list[int]],
                  with_logits: bool = True, progress: bool = True) -> list[TrainingItem]:
    """Training items for the student; with_logits=False skips the teacher's forward (labels-only training)."""
    from tqdm.auto import tqdm

    if len(examples) != len(answers):
        raise ValueError(f"{len(examples)} examples but {len(answers)} answers; give one answer per example")
    prefix_ids = tokenizer.encode(_prefix_text(task))
    prefix_cache = None
    # transformers 5 names the KV cache `cache`; 4.x named it `past_key_values`
    cache_kw = "cache" if "cache" in inspect.signature(type(teacher).forward).parameters else "past_key_values"
    if with_logits:
        prefix_out = teacher(torch.tensor([prefix_ids]), use_cache=True)
        prefix_cache = prefix_out[cache_kw]
    items = []
    for example, answer in tqdm(list(zip(examples, answers)), desc="teacher logits", unit="example",
                                disable=not progress or not with_logits):
        student_ids = tokenizer.encode(student_prompt_text(task, example.message))
        logits = None
        if with_logits:
            full = tokenizer.encode(prompt_text(task, example.message)) + list(answer)
            answer_start = len(full) - len(answer)
            if full[:len(prefix_ids)] == prefix_ids:     # the usual case: reuse the few-shot prefix's KV
                rest = torch.tensor([full[len(prefix_ids):]])
                out = teacher(rest, use_cache=True, **{cache_kw: copy.deepcopy(prefix_cache)})
                offset = len(prefix_ids)
            else:
                out = teacher(torch.tensor([full]))
                offset = 0
            # the logits at position p predict token p + 1: rows answer_start - 1 .. end - 2
            rows = out.logits[0, answer_start - 1 - offset: len(full) - 1 - offset]
            logits = rows.to(torch.float16)
        items.append(TrainingItem(student_ids + list(answer), len(student_ids), list(answer), logits))
    return items


def label_items(tokenizer, task: str, examples: list[Example]) -> list[TrainingItem]:
    """Items whose answers are the task's true labels (no teacher): the labels-only baseline's data."""
    items = []
    for example in examples:
        student_ids = tokenizer.encode(student_prompt_text(task, example.message))
        answer = tokenizer.encode(" " + example.answer + "\n")
        items.append(TrainingItem(student_ids + answer, len(student_ids), answer, None))
    return items

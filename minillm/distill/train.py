"""The training loop: batches of TrainingItems through the student, the distillation loss, AdamW, a loss history.

    history = train_student(student, items, steps=60, batch_size=8, lr=3e-4, temperature=2.0, alpha=0.5, seed=0)
    history = train_student(student, items, loss_fn=my_loss)     # a loss of your own (lab 12's), same loop
    plot_loss_curves({"distilled": history, "labels only": other})   a plotly figure of loss per step

Only the answer positions reach the head (the prompt's positions predict nothing the student is asked to
learn), so the costly 49152-wide head runs on a few dozen rows per sequence instead of every token. The
embedding (tied to the head in SmolLM2) is frozen by default: it is most of the parameters and the
teacher's is already right. Items without teacher logits (labels-only training) need alpha=0.
"""

from __future__ import annotations

import random
from typing import Callable

import torch

from .loss import distillation_loss_parts
from .teacher import TrainingItem


def _batch(items: list[TrainingItem], pad_id: int):
    width = max(len(item.input_ids) for item in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    rows, cols, labels, teacher_rows = [], [], [], []
    for b, item in enumerate(items):
        n = len(item.input_ids)
        ids[b, :n] = torch.tensor(item.input_ids)
        mask[b, :n] = 1
        for j, label in enumerate(item.answer_ids):
            rows.append(b)
            cols.append(item.answer_start - 1 + j)     # position p predicts token p + 1
            labels.append(label)
        if item.teacher_logits is not None:
            teacher_rows.append(item.teacher_logits)
    teacher = torch.cat(teacher_rows).float() if len(teacher_rows) == len(items) else None
    return ids, mask, torch.tensor(rows), torch.tensor(cols), torch.tensor(labels), teacher


def answer_logits(model, ids: torch.Tensor, mask: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The model's logits at (row, col) positions only: [num_positions, vocab]."""
    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    return model.lm_head(hidden[rows, cols])


def train_student(student, items: list[TrainingItem], steps: int = 60, batch_size: int = 8, lr: float = 3e-4,
                  temperature: float = 2.0, alpha: float = 0.5, seed: int = 0, train_embeddings: bool = False,
                  pad_id: int = 0, progress: bool = True, desc: str = "distill",
                  loss_fn: Callable | None = None) -> list[dict]:
    """Train in place; returns [{"step", "loss", "kl", "ce"}] per step. alpha=1: KL only; alpha=0: labels only.

    loss_fn: a loss of your own in place of `distillation_loss_parts`, called as
    ``loss_fn(student_logits [N, vocab], teacher_logits [N, vocab], labels [N], temperature, alpha)`` on the batch's
    N answer positions and returning a scalar tensor; its steps record "kl" and "ce" as None."""
    from tqdm.auto import tqdm

    if not items:
        raise ValueError("no training items")
    if not 1 <= steps <= 100_000:
        raise ValueError(f"steps={steps} is outside 1..100000")
    if not 1 <= batch_size <= len(items):
        raise ValueError(f"batch_size={batch_size} is outside 1..{len(items)} (the number of training items)")
    if not 0 < lr <= 1:
        raise ValueError(f"lr={lr} is outside (0, 1]")
    if alpha > 0 and any(item.teacher_logits is None for item in items):
        raise ValueError(f"alpha={alpha} needs the teacher's logits on every item; labels-only items need alpha=0")
    torch.manual_seed(seed)
    order_rng = random.Random(seed)
    student.train()
    student.model.embed_tokens.weight.requires_grad_(train_embeddings)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / steps))
    history, order = [], []
    bar = tqdm(range(steps), desc=desc, unit="step", disable=not progress)
    try:
        for step in bar:
            if len(order) < batch_size:
                order += order_rng.sample(range(len(items)), len(items))
            batch, order = [items[i] for i in order[:batch_size]], order[batch_size:]
            ids, mask, rows, cols, labels, teacher = _batch(batch, pad_id)
            logits = answer_logits(student, ids, mask, rows, cols)
            target = teacher if teacher is not None else logits.detach()
            if loss_fn is None:
                parts = distillation_loss_parts(logits, target, labels, temperature, alpha)
                loss, kl, ce = parts.total, parts.kl.item(), parts.ce.item()
            else:
                loss, kl, ce = _own_loss(loss_fn, logits, target, labels, temperature, alpha, step), None, None
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            schedule.step()
            history.append({"step": step, "loss": loss.item(), "kl": kl, "ce": ce})
            bar.set_postfix(loss=f"{history[-1]['loss']:.3f}")
    finally:   # a refused loss leaves the student as it found it: eval mode, embedding trainable
        student.eval()
        student.model.embed_tokens.weight.requires_grad_(True)
    return history


def _own_loss(loss_fn: Callable, logits: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor,
              temperature: float, alpha: float, step: int) -> torch.Tensor:
    loss = loss_fn(logits, teacher, labels, temperature, alpha)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ValueError(f"loss_fn returned {getattr(loss, 'shape', type(loss).__name__)} at step {step}; expected a "
                         f"scalar tensor (the mean over the {len(labels)} answer positions)")
    if not loss.requires_grad:
        raise ValueError(f"loss_fn's loss at step {step} carries no gradient: compute it from the student's logits "
                         f"with torch operations (no .item(), no .detach(), no numpy)")
    if not bool(torch.isfinite(loss)):
        raise ValueError(f"loss_fn returned {loss.item()} at step {step}; a loss must be finite")
    return loss


@torch.no_grad()
def top1_agreement(model, items: list[TrainingItem], batch_size: int = 16, pad_id: int = 0) -> float:
    """Fraction of answer positions where the model's top-1 token is the teacher's (teacher-forced on its answer)."""
    if not items:
        raise ValueError("no items to score")
    model.eval()
    agree = total = 0
    for start in range(0, len(items), batch_size):
        ids, mask, rows, cols, labels, _ = _batch(items[start:start + batch_size], pad_id)
        predicted = answer_logits(model, ids, mask, rows, cols).argmax(-1)
        agree += int((predicted == labels).sum())
        total += len(labels)
    return agree / total


def plot_loss_curves(histories: dict[str, list[dict]], title: str = "distillation: loss per step"):
    """A plotly figure, one line per run (total loss), the KL and CE parts dotted where both are on."""
    import plotly.graph_objects as go

    figure = go.Figure()
    for name, history in histories.items():
        steps = [h["step"] for h in history]
        figure.add_trace(go.Scatter(x=steps, y=[h["loss"] for h in history], name=f"{name}: loss", mode="lines"))
        if any(h["kl"] for h in history) and any(h["ce"] for h in history):
            for part in ("kl", "ce"):
                figure.add_trace(go.Scatter(x=steps, y=[h[part] for h in history], name=f"{name}: {part}",
                                            mode="lines", line={"dash": "dot"}))
    figure.update_layout(title=title, xaxis_title="step", yaxis_title="loss", template="plotly_white")
    return figure


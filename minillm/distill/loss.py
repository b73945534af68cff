"""The distillation loss: KL divergence to the teacher's temperature-softened logits (x T^2) mixed with cross-entropy.

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(student, labels)

averaged over the positions whose label is not `ignore_index`. alpha=1 switches the cross-entropy off (pure
distillation), alpha=0 switches the KL off (the teacher's tokens as hard labels only). The T^2 keeps the
KL's gradient the same size as the cross-entropy's when T changes (Hinton et al., 2015: the soft targets'
gradients scale as 1/T^2). `reference_distillation_loss` spells the same sum out position by position in
float64: it is what lab 12 checks the learner's loss against.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


@dataclasses.dataclass(frozen=True)
class LossParts:
    """The mixed loss and its two parts (each averaged over the labelled positions, KL already x T^2)."""
    total: torch.Tensor
    kl: torch.Tensor
    ce: torch.Tensor


def _check(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
           temperature: float, alpha: float) -> None:
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} and teacher logits "
                         f"{tuple(teacher_logits.shape)} must have the same shape [..., vocab]")
    if labels.shape != student_logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must have the logits' shape without the vocab: "
                         f"{tuple(student_logits.shape[:-1])}")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha={alpha} must be in [0, 1] (1: KL only, 0: cross-entropy only)")


def distillation_loss_parts(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                            temperature: float = 2.0, alpha: float = 0.5,
                            ignore_index: int = IGNORE_INDEX) -> LossParts:
    """The loss and its parts; logits [..., vocab], labels [...] (positions labelled `ignore_index` count for nothing)."""
    _check(student_logits, teacher_logits, labels, temperature, alpha)
    vocab = student_logits.shape[-1]
    student = student_logits.reshape(-1, vocab).float()
    teacher = teacher_logits.reshape(-1, vocab).float().detach()
    flat_labels = labels.reshape(-1)
    keep = flat_labels != ignore_index
    if not bool(keep.any()):
        raise ValueError(f"every label is ignore_index={ignore_index}: no position to learn from")
    student, teacher, flat_labels = student[keep], teacher[keep], flat_labels[keep]
    zero = student.sum() * 0.0
    kl = zero
    if alpha > 0:
        log_p_student = F.log_softmax(student / temperature, dim=-1)
        log_p_teacher = F.log_softmax(teacher / temperature, dim=-1)
        kl = F.kl_div(log_p_student, log_p_teacher, log_target=True, reduction="batchmean") * temperature ** 2
    ce = F.cross_entropy(student, flat_labels) if alpha < 1 else zero
    return LossParts(alpha * kl + (1 - alpha) * ce, kl, ce)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                      temperature: float = 2.0, alpha: float = 0.5, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """`alpha * T^2 * KL(teacher_T || student_T) + (1 - alpha) * CE(student, labels)`, a scalar tensor."""
    return distillation_loss_parts(student_logits, teacher_logits, labels, temperature, alpha, ignore_index).total


def reference_distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor,
                                temperature: float = 2.0, alpha: float = 0.5,
                                ignore_index: int = IGNORE_INDEX) -> float:
    """The same loss written out one position at a time in float64: the spec lab 12's check compares against."""
    _check(student_logits, teacher_logits, labels, temperature, alpha)
    vocab = student_logits.shape[-1]
    student = student_logits.detach().reshape(-1, vocab).double()
    teacher = teacher_logits.detach().reshape(-1, vocab).double()
    kl_sum, ce_sum, count = 0.0, 0.0, 0
    for s_row, t_row, label in zip(student, teacher, labels.reshape(-1).tolist()):
        if label == ignore_index:
            continue
        p_teacher = torch.softmax(t_row / temperature, dim=0)
        p_student = torch.softmax(s_row / temperature, dim=0)
        kl_sum += float((p_teacher * (p_teacher.log() - p_student.log())).sum())
        ce_sum += float(-torch.log_softmax(s_row, dim=0)[label])
        count += 1
    if count == 0:
        raise ValueError(f"every label is ignore_index={ignore_index}: no position to learn from")
    return alpha * temperature ** 2 * kl_sum / count + (1 - alpha) * ce_sum / count

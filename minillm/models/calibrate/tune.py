"""End-to-end tuning of int4 group scales and zeros (EfficientQAT's E2E-QP), the second stage of
weight_calibration="autoround" and "gptq-tuned": the whole int4 model trained against the float
model's next-token distribution, the int4 levels fixed as the first stage chose them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.func import functional_call

from ...quant import QuantizedLinear
from ...quant.int4 import dequantize_int4
from ..llama import LlamaForCausalLM
from .common import LAYER_LINEARS, calibration_sequences, sequence_layout, training_pass

E2E_STEPS = 80            # Adam steps of tune_int4_grids on top of AutoRound
E2E_LR = 5e-4             # peak learning rate (cosine to 0) for the relative changes of scale and zero
E2E_BATCH_TOKENS = 2048   # calibration tokens per step (whole sequences of seq_len)


def _bf16_ste(x: torch.Tensor) -> torch.Tensor:
    """x rounded to bfloat16 (as QuantizedLinear stores scale and zero) forward, identity backward."""
    return x + (x.to(torch.bfloat16).float() - x).detach()


def tune_int4_grids(model: LlamaForCausalLM, token_ids: list[int], input_scales: dict[str, torch.Tensor],
                    parts: dict[str, tuple], steps: int = E2E_STEPS, lr: float = E2E_LR,
                    batch_tokens: int = E2E_BATCH_TOKENS, seq_len: int = 512, seed: int = 1,
                    tune_input_scales: bool = False, head_dtype: str | None = None, progress: bool = True
                    ) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """End-to-end tuning of every decoder int4 matrix's group scales and zeros, levels fixed
    (EfficientQAT's E2E-QP, Chen et al. 2024), on top of a layer-by-layer calibration's parts.

    calibrate_autoround fits each layer's output to the float layer's, one layer at a time. Here
    the whole int4 model is trained at once against what it is for, the float model's next-token
    distribution: the loss is KL(float || int4) over the vocabulary, averaged over random batches
    of about `batch_tokens` calibration tokens (whole sequences of seq_len), for `steps` Adam steps
    with a cosine learning rate from `lr`. Each group's scale and zero become
    scale * (1 + a) and zero + b * scale with a, b learned (from 0); the int4 levels q stay as the
    calibration chose them. The forward pass uses scale and zero rounded to bfloat16 as
    QuantizedLinear stores them (straight-through), so what is trained is what is served.
    tune_input_scales: each matrix's AWQ input scale s (the ones input_scales has) is learned too,
    as s * (1 + c) with c per input channel from 0: a column-wise gain on the int4 matrix that the
    levels, fixed per group of rows, cannot express (for qkv_proj and gate_up_proj it plays the part
    of the RMSNorm weight before them).
    head_dtype: the head the student uses, as it will be served ("int8": per-channel int8 of the
    float head, also its embedding table when tied; None: the float head). The teacher keeps the
    float head. Any "lm_head" part is left alone.
    Returns (input_scales, parts) with the tuned scales and the decoder matrices' (q, scale, zero)
    replaced; the model is left as it was.
    """
    from tqdm.auto import tqdm

    if head_dtype not in (None, "int8"):
        raise ValueError(f"tune_int4_grids(head_dtype={head_dtype!r}): the student's head is None (float) or 'int8'")
    seq_len, num_seqs, per_step = calibration_sequences("tune_int4_grids", token_ids, steps, batch_tokens, seq_len)
    keys = [f"layers.{i}.{name}" for i in range(len(model.layers)) for name in LAYER_LINEARS]
    missing = [key for key in keys if key not in parts]
    if missing:
        raise ValueError(f"tune_int4_grids needs int4 parts for every decoder matrix; missing {missing[:3]}")
    device = model.embed_tokens.weight.device
    ids = torch.tensor(token_ids[:num_seqs * seq_len], device=device).reshape(num_seqs, seq_len)
    positions, meta = sequence_layout(seq_len, per_step, device)
    in_features = {key: model.get_submodule(key).weight.shape[1] for key in keys}
    dtype = model.layers[0].qkv_proj.weight.dtype
    in_scale = {key: input_scales[key].to(device).float() for key in keys if key in input_scales}
    q = {key: parts[key][0].to(device).float() for key in keys}
    scale0 = {key: parts[key][1].to(device).float() for key in keys}
    zero0 = {key: parts[key][2].to(device).float() for key in keys}
    a = {key: torch.zeros_like(scale0[key], requires_grad=True) for key in keys}
    b = {key: torch.zeros_like(scale0[key], requires_grad=True) for key in keys}
    c = {key: torch.zeros_like(s, requires_grad=True) for key, s in in_scale.items()} if tune_input_scales else {}

    def grid(key):   # this matrix's (scale, zero) as they will be stored
        return _bf16_ste(scale0[key] * (1 + a[key])), _bf16_ste(zero0[key] + b[key] * scale0[key])

    def input_scale(key):
        return in_scale[key] * (1 + c[key]) if key in c else in_scale[key]

    head = model.lm_head_weight.detach()
    student_head = head if head_dtype is None else QuantizedLinear.from_float(head, None, "int8").dequantized_weight(head.dtype)
    tied = model.lm_head is None

    def weights():
        out = {"embed_tokens.weight": student_head} if tied and head_dtype is not None else {}
        for key in keys:
            scale, zero = grid(key)
            w = dequantize_int4(q[key], scale, zero)[:, :in_features[key]]
            out[f"{key}.weight"] = (w / input_scale(key) if key in in_scale else w).to(dtype)
        return out

    optimizer = torch.optim.Adam(list(a.values()) + list(b.values()) + list(c.values()), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    with training_pass(model):
        for step in tqdm(range(steps), desc="int4 grid tuning (end to end)", unit="step", disable=not progress,
                         leave=False):
            for group in optimizer.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
            x = ids[torch.randperm(num_seqs, generator=gen)[:per_step].to(device)].reshape(-1)
            with torch.no_grad():
                teacher = F.log_softmax(F.linear(model(x, positions, meta), head).float(), dim=-1)
            student = F.log_softmax(F.linear(functional_call(model, weights(), (x, positions, meta)),
                                             student_head).float(), dim=-1)
            loss = (teacher.exp() * (teacher - student)).sum(-1).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    tuned = dict(parts)
    with torch.no_grad():
        for key in keys:   # exactly the bf16 values (x + (r - x) in fp32 may miss r by an ulp)
            scale, zero = (t.to(torch.bfloat16).float().cpu() for t in grid(key))
            tuned[key] = (parts[key][0], scale, zero)
        scales = dict(input_scales)
        scales.update({key: input_scale(key).detach().cpu() for key in c})
    return scales, tuned

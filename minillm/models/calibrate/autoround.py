"""Learned int4 rounding of a model (weight_calibration="autoround", first stage): AWQ's scales and
ranges, then each decoder layer's rounding offsets and group ranges trained so the int4 layer's
output matches the float layer's. One matrix's learnable rounding is in quant/autoround.py
(LearnableInt4, SignRound)."""

from __future__ import annotations

import torch
from torch.func import functional_call

from ...quant.autoround import LearnableInt4
from ...quant.gptq import gptq_int4, input_hessian
from ..llama import LlamaForCausalLM
from .awq import AWQ_SEARCH_TOKENS, calibrate_awq
from .common import LAYER_LINEARS, calibration_sequences, sequence_layout, training_pass

AUTOROUND_STEPS = 100         # signed-gradient steps per decoder layer
AUTOROUND_BATCH_TOKENS = 1024  # calibration tokens per step (whole sequences of seq_len)


def calibrate_autoround(model: LlamaForCausalLM, token_ids: list[int], group_size: int = 128,
                        steps: int = AUTOROUND_STEPS, batch_tokens: int = AUTOROUND_BATCH_TOKENS, seq_len: int = 512,
                        lr: float | None = None, awq_tokens: int = AWQ_SEARCH_TOKENS, seed: int = 0,
                        head_group_size: int | None = None, relative: bool = True, progress: bool = True
                        ) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """Learned int4 rounding (quant/autoround.py, SignRound), layer by layer, on top of AWQ.

    1. AWQ's input scales and clipping ranges (calibrate_awq on the first `awq_tokens` tokens) are
       each matrix's starting point.
    2. token_ids are cut into sequences of seq_len. For each decoder layer in order, its four
       matrices get learnable rounding offsets and group ranges (LearnableInt4), trained together
       for `steps` signed-gradient steps (lr decaying linearly from lr, default 1 / steps) on
       random batches of about `batch_tokens` tokens, so that the int4 layer's output matches
       the float layer's output on the float model's activations. The int4 layer's input is the
       output of the int4 layers before it ("sequential"), so each layer also learns to absorb
       the error upstream of it. A layer whose error on all the calibration tokens (with its
       weights as they will be stored) ends higher than at the start keeps AWQ's rounding.
    3. head_group_size: also GPTQ the lm_head to int4 with that group size (as calibrate_gptq does),
       on the final norm of the int4 layers' output over all the calibration tokens; key "lm_head".
    relative: a token whose float output's mean square is above the median token's has its squared
    error divided by that excess (the scale the next RMSNorm divides out); the others keep the
    plain error (False: the plain mean squared error for all). SmolLM2's first token of a sequence
    (the attention sink) carries a residual stream far larger than the others' in the later layers
    (scripts/residual_norms.py); in a plain mean squared error those few tokens would make up most
    of the loss, and the others would teach little (docs/notes/performance-history.md).
    Returns ({"layers.<i>.<name>": input_scale}, {"layers.<i>.<name>": (q, scale, zero)}), the
    input_scales= and quantized= arguments of quantize_model; the model is left as it was.
    """
    from tqdm.auto import tqdm

    seq_len, num_seqs, per_step = calibration_sequences("calibrate_autoround", token_ids, steps, batch_tokens, seq_len)
    scales, clips = calibrate_awq(model, token_ids[:awq_tokens], "int4", group_size, progress=False)
    device = model.embed_tokens.weight.device
    ids = torch.tensor(token_ids[:num_seqs * seq_len], device=device)
    positions, meta = sequence_layout(seq_len, num_seqs, device)
    step_positions, step_meta = sequence_layout(seq_len, per_step, device)
    lr = 1.0 / steps if lr is None else lr
    gen = torch.Generator().manual_seed(seed)
    parts: dict[str, tuple] = {}
    with training_pass(model):
        with torch.no_grad():
            fp_in = model.embed_tokens(ids)
        q_in = fp_in
        for i, layer in enumerate(tqdm(model.layers, desc=f"AutoRound calibration (int4 g{group_size})",
                                       unit="layer", disable=not progress, leave=False)):
            dtype = layer.qkv_proj.weight.dtype
            learners = {name: LearnableInt4(getattr(layer, name).weight.data, group_size,
                                            scales[f"layers.{i}.{name}"], clips.get(f"layers.{i}.{name}"))
                        for name in LAYER_LINEARS}
            with torch.no_grad():
                fp_out = layer(positions, fp_in, meta)
                ms = fp_out.float().pow(2).mean(-1, keepdim=True).clamp_min(1e-12)   # each token's mean square [T, 1]
                weight = ms.median() / ms.clamp_min(ms.median()) if relative else torch.ones_like(ms)

            def run(x, pos, m, weights):
                return functional_call(layer, {f"{name}.weight": w.to(dtype) for name, w in weights.items()}, (pos, x, m))

            def stored_output():  # on every calibration token, with the weights as they will be stored
                with torch.no_grad():
                    return run(q_in, positions, meta, {n: lrn.stored_weight() for n, lrn in learners.items()})

            def error(out, rows=slice(None)):
                return ((out.float() - fp_out[rows].float()).pow(2) * weight[rows]).mean()

            start = {name: learner.state() for name, learner in learners.items()}
            start_error = float(error(stored_output()))
            for step in range(steps):
                pick = torch.randperm(num_seqs, generator=gen)[:per_step]
                rows = (pick[:, None] * seq_len + torch.arange(seq_len)).reshape(-1).to(device)
                out = run(q_in[rows], step_positions, step_meta, {n: lrn.weight() for n, lrn in learners.items()})
                error(out, rows).backward()
                for learner in learners.values():
                    learner.sign_step(lr * (1 - step / steps))
            out = stored_output()
            if float(error(out)) > start_error:  # never worse than AWQ's starting point on the calibration text
                for name, learner in learners.items():
                    learner.load_state(start[name])
                out = stored_output()
            for name, learner in learners.items():
                parts[f"layers.{i}.{name}"] = learner.export()
            q_in = out
            fp_in = fp_out
        if head_group_size is not None:
            with torch.no_grad():
                x = model.norm(q_in).float()
            parts["lm_head"] = gptq_int4(model.lm_head_weight.float(), input_hessian(x), head_group_size,
                                         act_order="static")
    return scales, parts


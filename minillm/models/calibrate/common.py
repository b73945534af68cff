"""What every weight calibration shares: the quantized matrices' names, a shallow copy of a model,
and running the model over whole calibration sequences (no KV pool: torch attention and torch ops)."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from ...layers.attention import AttentionMetadata
from ..llama import LlamaForCausalLM

LAYER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")   # each decoder layer's quantized matrices

# An int4 head (weight_head_dtype="int4") uses groups of 32 whatever the body's group size: it is the
# most sensitive matrix (every output is a logit), and with a tied embedding it is the embedding too.
HEAD_INT4_GROUP_SIZE = 32


def shallow_copy(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """A new module tree that shares every tensor of `model` (weights, buffers, a bound KV pool):
    replacing one of its submodules leaves `model` untouched."""
    memo: dict[int, object] = {}
    for module in model.modules():
        for value in list(module.__dict__.values()) + list(module._parameters.values()) + list(module._buffers.values()):
            if isinstance(value, torch.Tensor):
                memo[id(value)] = value
    return copy.deepcopy(model, memo)


@contextmanager
def training_pass(model: LlamaForCausalLM):
    """Autograd on (also inside inference mode) and the model's own parameters frozen: calibrations that
    train their own tensors through the model's forward (a pass without a KV pool: torch attention).
    Each parameter's requires_grad is given back afterwards."""
    params = list(model.parameters())
    trainable = [p.requires_grad for p in params]
    try:
        for p in params:
            p.requires_grad_(False)
        with torch.inference_mode(False), torch.enable_grad():
            yield
    finally:
        for p, flag in zip(params, trainable):
            p.requires_grad_(flag)


def calibration_sequences(who: str, token_ids: list[int], steps: int, batch_tokens: int, seq_len: int
                          ) -> tuple[int, int, int]:
    """A training calibration's batching, its arguments checked (`who` names it in the errors):
    (seq_len, at most the number of tokens; num_seqs, whole sequences of it in token_ids;
    per_step, sequences in a batch of about batch_tokens, at least 1 and at most num_seqs)."""
    if steps < 1 or batch_tokens < 1 or seq_len < 1:
        raise ValueError(f"steps={steps}, batch_tokens={batch_tokens} and seq_len={seq_len} must each be >= 1")
    if len(token_ids) < 2:
        raise ValueError(f"{who} needs at least 2 calibration tokens, got {len(token_ids)}")
    seq_len = min(seq_len, len(token_ids))
    num_seqs = len(token_ids) // seq_len
    return seq_len, num_seqs, max(1, min(num_seqs, batch_tokens // seq_len))


def sequence_layout(seq_len: int, n: int, device) -> tuple[torch.Tensor, AttentionMetadata]:
    """positions and kv_cache-free metadata for n sequences of seq_len tokens run together."""
    return (torch.arange(seq_len, device=device).repeat(n),
            AttentionMetadata(query_lens=[seq_len] * n, num_cached=[0] * n, slot_mapping=None, use_cache=False))

"""Rotary position embedding (RoPE), with Llama 3 / linear frequency scaling."""

from __future__ import annotations

import math

import torch

from ..kernels import cpu

def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] and the attention scaling factor for cos/sin."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv_freq, 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_context_len = float(scaling["original_max_position_embeddings"])
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the middle blended.
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, inv_freq_llama), 1.0
    raise ValueError(
        f"rope scaling type {kind!r} is not supported; supported: default, linear, llama3"
    )


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables [max_positions, head_dim], indexed by absolute position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None, dtype: torch.dtype):
        super().__init__()
        self.args = (head_dim, max_positions, theta, scaling, dtype)
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        if self.cos.device.type != "meta":
            self.build()

    def build(self, device=None) -> None:
        """(Re)compute the tables in fp32, then cast (after a meta-device construction too)."""
        head_dim, max_positions, theta, scaling, dtype = self.args
        inv_freq, attention_scaling = rope_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * attention_scaling).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * attention_scaling).to(dtype=dtype, device=device)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                ops: str = "torch") -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, Hq, D]; k: [T, Hkv, D] -> rotated q, k (in place with ops "triton" / "cpu":
        the Triton kernel or minillm's CPU kernel, kernels/cpu.py)."""
        if ops == "triton":
            from ..kernels import rotary  # imported late: the interpreter is chosen before triton is imported

            return rotary.rotary_embedding(positions, q, k, self.cos, self.sin)
        if ops == "cpu":   # the engine's positions are in range: not read back here
            return cpu.rotary(positions, q, k, self.cos, self.sin, check_ranges=False)
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

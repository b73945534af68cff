"""SiLU-and-multiply: the SwiGLU gate of the Llama MLP."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: [..., 2 * intermediate] -> silu(gate) * up: [..., intermediate]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

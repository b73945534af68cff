"""SiLU-and-multiply: the SwiGLU gate of the Llama MLP."""

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
    """gate_up: [..., 2 * intermediate] -> silu(gate) * up: [..., intermediate].

    use_triton: the fused Triton kernel (kernels/activation.py; gate_up must be [T, 2 * I]).
    """
    if use_triton:
        from ..kernels import activation  # imported late: the interpreter is chosen before triton is imported

        return activation.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

"""SiLU-and-multiply: the SwiGLU gate of the Llama MLP."""

import torch
import torch.nn.functional as F

from ..kernels import cpu


def silu_and_mul(gate_up: torch.Tensor, use_triton: bool = False, use_native: bool = False) -> torch.Tensor:
    """gate_up: [..., 2 * intermediate] -> silu(gate) * up: [..., intermediate].

    use_triton: the fused Triton kernel (kernels/activation.py; gate_up must be [T, 2 * I]);
    use_native: the CPU kernel (kernels/cpu.py; fp32 [T, 2 * I]).
    """
    if use_native:
        return cpu.silu_mul(gate_up)
    if use_triton:
        from ..kernels import activation  # imported late: the interpreter is chosen before triton is imported

        return activation.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

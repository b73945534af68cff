"""SiLU-and-multiply: the SwiGLU gate of the Llama MLP."""

import torch
import torch.nn.functional as F

from ..kernels import cpu


def silu_and_mul(gate_up: torch.Tensor, ops: str = "torch") -> torch.Tensor:
    """gate_up: [..., 2 * intermediate] -> silu(gate) * up: [..., intermediate].

    ops "triton": the fused Triton kernel (kernels/activation.py; gate_up must be [T, 2 * I]);
    "cpu": minillm's CPU kernel (kernels/cpu.py; fp32 [T, 2 * I]); "torch": the reference below.
    """
    if ops == "cpu":
        return cpu.silu_mul(gate_up)
    if ops == "triton":
        from ..kernels import activation  # imported late: the interpreter is chosen before triton is imported

        return activation.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up

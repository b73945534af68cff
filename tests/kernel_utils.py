"""Shared setup of the Triton kernel tests: the interpreter, dtypes, tolerances, device.

Import it before anything that imports triton (`from kernel_utils import ...` first): without
a GPU the kernels run in Triton's interpreter, which must be chosen before triton decorates
them (importing torch does not import triton). pytest puts tests/ on sys.path (rootdir
conftest), so the plain `from kernel_utils import ...` works from every test file.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Max error allowed, relative to max(1, largest reference magnitude): fp32 kernels accumulate in
# another order than torch; bf16 / fp16 round once at the end where torch rounds after each op.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def max_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max abs error, the error allowed for want's dtype and magnitude)."""
    err = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    scale = want.float().abs().max().item() if want.numel() else 0.0
    return err, TOLERANCE[want.dtype] * max(1.0, scale)

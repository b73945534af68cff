"""Triton kernels: values against the torch reference in the interpreter, and AOT compilation."""

import os
import subprocess
import sys

import pytest

import torch

# Without a GPU the kernels run in Triton's interpreter, which must be chosen before triton
# decorates them (importing torch does not import triton).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minillm.kernels.rmsnorm import rmsnorm, rmsnorm_reference  # noqa: E402

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (5, 80), (3, 576), (2, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_reference(dtype, num_tokens, hidden, with_residual):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w = torch.randn(hidden, generator=gen).to(dtype)
    r = torch.randn(num_tokens, hidden, generator=gen).to(dtype) if with_residual else None
    r_kernel = r.clone() if r is not None else None
    r_ref = r.clone() if r is not None else None
    got = rmsnorm(x, w, 1e-6, residual=r_kernel)
    want = rmsnorm_reference(x, w, 1e-6, residual=r_ref)
    tol = TOLERANCE[dtype]
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    assert err <= tol * max(1.0, scale), f"max error {err} (scale {scale}) for {dtype} [{num_tokens}, {hidden}]"
    if with_residual:
        assert torch.allclose(r_kernel.float(), r_ref.float(), atol=tol, rtol=tol), "residual was not updated to x + residual"


def test_rmsnorm_rejects_bad_shapes():
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(torch.randn(2, 8), torch.randn(9), 1e-6)


def test_kernels_compile_ahead_of_time_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "minillm.kernels.aot"], capture_output=True, text=True, env=env,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " 0 failed" in proc.stdout
    assert "sm_90" in proc.stdout and "sm_80" in proc.stdout

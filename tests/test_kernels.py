"""Triton kernels: values against the torch reference in the interpreter, and AOT compilation."""

import os
import subprocess
import sys

import pytest
import torch

from kernel_utils import DEVICE, DTYPES, TOLERANCE, max_error  # first: picks the interpreter before triton is imported

from minillm.kernels.activation import silu_and_mul, silu_and_mul_reference
from minillm.kernels.rmsnorm import rmsnorm, rmsnorm_reference
from minillm.kernels.rotary import rotary_embedding, rotary_embedding_reference


@pytest.mark.parametrize("dtype", DTYPES)
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


# ---------------------------------------------------------------- rotary embedding

# (head_dim, num_tokens, num_kv_heads, query group size): head_dim 80 pads its half (40) to 64.
ROTARY_CASES = [
    pytest.param(64, 1, 2, 1, id="d64-T1-mha"),
    pytest.param(80, 5, 1, 3, id="d80-T5-gqa3"),
    pytest.param(128, 100, 1, 8, id="d128-T100-gqa8"),
    pytest.param(80, 37, 3, 3, id="d80-T37-gqa3"),
    pytest.param(64, 5, 1, 8, id="d64-T5-gqa8"),
    pytest.param(128, 1, 2, 3, id="d128-T1-gqa3"),
]


def make_rotary_inputs(head_dim, num_tokens, num_kv_heads, group, dtype, seed, max_positions=300):
    """q, k as strided views of one fused qkv row (as the model makes them), random cos/sin tables
    (the two halves differ, so a kernel that reads the wrong half is caught) and scattered positions."""
    gen = torch.Generator().manual_seed(seed)
    num_heads = num_kv_heads * group
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype).to(DEVICE)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    cos = torch.randn(max_positions, head_dim, generator=gen).to(dtype).to(DEVICE)
    sin = torch.randn(max_positions, head_dim, generator=gen).to(dtype).to(DEVICE)
    positions = torch.randperm(max_positions, generator=gen)[:num_tokens].to(DEVICE)  # not 0..T-1
    return qkv, q, k, v, cos, sin, positions


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,num_tokens,num_kv_heads,group", ROTARY_CASES)
def test_rotary_matches_reference(dtype, head_dim, num_tokens, num_kv_heads, group):
    qkv, q, k, v, cos, sin, positions = make_rotary_inputs(head_dim, num_tokens, num_kv_heads, group, dtype,
                                                           seed=head_dim * 1000 + num_tokens * 10 + group)
    want_q, want_k = rotary_embedding_reference(positions, q, k, cos, sin)
    # Out of place into poisoned outputs: every element must be written.
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    got_q, got_k = rotary_embedding(positions, q, k, cos, sin, q_out=q_out, k_out=k_out)
    assert got_q.data_ptr() == q_out.data_ptr() and got_k.data_ptr() == k_out.data_ptr()
    # In place on the fused qkv views: q and k rotated, v (and the rest of each row) untouched.
    v_before = v.clone()
    rotary_embedding(positions, q, k, cos, sin)
    assert torch.equal(v, v_before), "the in-place kernel wrote outside q and k"
    for name, got, in_place, want in (("q", got_q, q, want_q), ("k", got_k, k, want_k)):
        nan = got.isnan().nonzero()
        assert nan.numel() == 0, (f"{name}: NaN at [token, head, dim] {nan[0].tolist()} ({len(nan)} elements): "
                                  "an output element was never written (check the head loop and the dim mask)")
        err, tol = max_error(got, want)
        if err > tol:
            err_map = (got.float() - want.float()).abs()
            token, head, dim = [i.item() for i in torch.unravel_index(err_map.argmax(), err_map.shape)]
            pytest.fail(f"{name}: max error {err:.3g} > {tol:.3g} at [token {token}, head {head}, dim {dim}] "
                        f"(position {positions[token].item()}, half {head_dim // 2}): got {got[token, head, dim].item():.5g}, "
                        f"expected {want[token, head, dim].item():.5g} — dims >= {head_dim // 2} use the table's second "
                        "half and +x1*sin, the first half -x2*sin")
        assert torch.equal(in_place, got), f"{name}: in place and out of place differ"


def test_rotary_matches_the_model_layer():
    """The kernel on the model's own cos/sin tables (Llama 3 scaling) gives the torch layer's result."""
    from minillm.layers.rotary import RotaryEmbedding

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    rope = RotaryEmbedding(80, 512, 500000.0, scaling, torch.float32)
    _, q, k, _, _, _, positions = make_rotary_inputs(80, 7, 2, 3, torch.float32, seed=3, max_positions=512)
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = rotary_embedding(positions, q.clone(), k.clone(), rope.cos, rope.sin)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


def test_rotary_rejects_bad_shapes():
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="cos, sin"):
        rotary_embedding(torch.arange(3), q, k, torch.randn(10, 32), torch.randn(10, 32))
    with pytest.raises(ValueError, match="positions"):
        rotary_embedding(torch.arange(4), q, k, torch.randn(10, 64), torch.randn(10, 64))


# ---------------------------------------------------------------- SiLU-and-multiply

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,intermediate", [(1, 14336), (5, 1536), (100, 100), (3, 1000)])
def test_silu_and_mul_matches_reference(dtype, num_tokens, intermediate):
    gen = torch.Generator().manual_seed(num_tokens * 100000 + intermediate)
    # A strided view (rows of a wider buffer), with large gates too: silu must not overflow to NaN.
    wide = (4 * torch.randn(num_tokens, 2 * intermediate + 8, generator=gen)).to(dtype).to(DEVICE)
    wide[0, :4] = torch.tensor([-100.0, 100.0, -30.0, 0.0], dtype=dtype)
    gate_up = wide[:, 3:3 + 2 * intermediate]
    out = torch.full((num_tokens, intermediate), float("nan"), dtype=dtype, device=DEVICE)
    got = silu_and_mul(gate_up, out=out)
    assert got.data_ptr() == out.data_ptr()
    want = silu_and_mul_reference(gate_up)
    nan = got.isnan().nonzero()
    assert nan.numel() == 0, (f"NaN at [token, column] {nan[0].tolist()} ({len(nan)} elements): a column past "
                              f"the last full block of {intermediate} was never written, or silu overflowed")
    err, tol = max_error(got, want)
    if err > tol:
        err_map = (got.float() - want.float()).abs()
        token, col = [i.item() for i in torch.unravel_index(err_map.argmax(), err_map.shape)]
        pytest.fail(f"max error {err:.3g} > {tol:.3g} at [token {token}, column {col}]: got {got[token, col].item():.5g}, "
                    f"expected {want[token, col].item():.5g} (gate {gate_up[token, col].item():.4g}, "
                    f"up {gate_up[token, intermediate + col].item():.4g})")


def test_silu_and_mul_rejects_odd_width():
    with pytest.raises(ValueError, match="gate_up"):
        silu_and_mul(torch.randn(2, 7))


FP8_MATMUL_FAMILIES = ("fp8_gemv", "fp8_gemm", "fp8_act_gemm")   # QuantizedLinear's fp8 kernels: sm_90+


def run_aot(*args: str) -> str:
    """python -m minillm.kernels.aot ARGS in a process without the interpreter; its report."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "minillm.kernels.aot", *args], capture_output=True, text=True,
                          env=env, timeout=3600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " 0 failed" in proc.stdout
    return proc.stdout


def compiled_targets(report: str) -> dict[str, set[int]]:
    """{kernel family: capabilities it compiled for} from the report's "ok  sm_90 name[...]: ..." lines."""
    from minillm.kernels.aot import family

    found: dict[str, set[int]] = {}
    for line in report.splitlines():
        if line.startswith("ok  sm_"):
            cc, name = line[len("ok  sm_"):].split(":", 1)[0].split(" ", 1)
            found.setdefault(family(name), set()).add(int(cc))
    return found


def test_representative_kernels_compile_ahead_of_time_for_every_target():
    """Each kernel family for sm_75, sm_80, sm_86, sm_89 and sm_90 (the fp8 matmuls: sm_90 only), every dtype,
    head_dim, group and KV format at least once. The whole grid: test_every_kernel_configuration_compiles."""
    from minillm.kernels import aot

    found = compiled_targets(run_aot("--representative", "--jobs", "2"))
    families = {aot.family(name) for name, *_ in aot.configurations()}
    assert set(found) == families, f"families never compiled: {sorted(families - set(found))}"
    for name, targets in found.items():
        want = {90} if name in FP8_MATMUL_FAMILIES else set(aot.CAPABILITIES)
        assert targets == want, f"{name} compiled for {sorted(targets)}, expected {sorted(want)}"


def test_representative_set_covers_every_setting_on_every_target():
    from minillm.kernels import aot

    chosen = aot.representative()
    configs = {name: (options[0] if options else {}) for name, _kernel, _sig, _constexprs, *options in aot.configurations()}
    assert len(chosen) < len(configs) * len(aot.CAPABILITIES) / 10, "the representative set is not much smaller"
    for fam in {aot.family(name) for name in configs}:
        members = [name for name in configs if aot.family(name) == fam]
        launched = {(name, cc) for name in members for cc in aot.CAPABILITIES
                    if aot.skip_reason(configs[name], cc) is None}
        picked = [pair for pair in chosen if aot.family(pair[0]) == fam]
        assert set(picked) <= launched, f"{fam}: a representative pair is one the engine never launches"
        for value in set().union(*(aot._values(name) for name, _ in launched)):
            assert any(value in aot._values(name) for name, _ in picked), f"{fam}: {value} never compiled"
        assert {cc for _, cc in picked} == {cc for _, cc in launched}, f"{fam}: a target never compiled"


def test_every_skipped_target_says_why():
    """bf16 is skipped on sm_75 only, fp8 KV below sm_89, the fp8 weight kernels below sm_90, each with the reason
    and what the engine does instead; nothing else is skipped."""
    from minillm.hardware import GPU_FEATURES
    from minillm.kernels import aot

    for name, _kernel, sig, _constexprs, *options in aot.configurations():
        options = options[0] if options else {}
        values = aot._values(name)
        for cc in aot.CAPABILITIES:
            why = aot.skip_reason(options, cc)
            expected = None
            if "bf16" in values and cc < 80:
                expected = GPU_FEATURES["bf16"][1]
            elif aot.family(name) in FP8_MATMUL_FAMILIES and cc < 90:
                expected = GPU_FEATURES["fp8_matmul"][1]
            elif "kv=fp8" in values and cc < 89:
                expected = GPU_FEATURES["fp8"][1]
            assert why == expected, f"sm_{cc} {name}: skip reason {why!r}, expected {expected!r}"


@pytest.mark.slow   # ~1,300 compiles: about 12 minutes on 2 cores when nothing else runs
@pytest.mark.timeout(3600)
def test_every_kernel_configuration_compiles_for_every_target():
    report = run_aot("--jobs", "2")
    assert all(f"sm_{cc}" in report for cc in (75, 80, 86, 89, 90))
    skipped = [line for line in report.splitlines() if line.startswith("skip ")]
    assert skipped and all("skipped: " in line and len(line.split("skipped: ", 1)[1]) > 20 for line in skipped)

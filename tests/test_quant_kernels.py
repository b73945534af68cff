"""The low-bit matmul kernels (minillm/kernels/channel_matmul.py, int4_matmul.py) against their torch references,
under the interpreter on the CPU: int8 / int4 / fp8 weight-only GEMV (decode, M <= 16, split-K)
and GEMM (prefill, tl.dot), fp8 x fp8 dots, and QuantizedLinear's "triton" path.

Shapes are odd on purpose: N not a multiple of any BLOCK_N (80, 131), K not a multiple of BLOCK_K
(96, 200, 600) and, for int4, not of the group size (200 -> Kp 256 with groups of 64: the padded
columns must meet zero activations), M across every GEMV BLOCK_M and the GEMM (1, 3, 5, 16, 37).
Inputs are fresh random draws per case (seeded by the case).

Error bounds (kernel_utils.TOLERANCE, relative to max(1, max |reference|); |y| is ~ sqrt(K) ~ 10-25
here, so the bound is relative): kernel and reference multiply the same dequantized weights (int8
and e4m3 values are exact in every activation dtype; int4's q * scale + zero is computed in fp32 by
both, and rounded to x's dtype by both in the GEMM) and sum in fp32 in another order, so
- fp32: the sums differ by about K * 2^-24 of sum |x w| ~ 1e-6 of |y|; bound 1e-5;
- bf16 / fp16: each side rounds its fp32 result once to x's dtype, so they may differ by one ulp,
  2^-8 (bf16) / 2^-11 (fp16) of |y|; the int4 GEMV keeps its weights in fp32 where the reference
  rounds them to x's dtype, which adds at most 2^-9 / 2^-12 of sum |x w| (~ 3 max |y| at these K);
  bounds 2e-2 / 2e-3.
A wrong nibble, group, scale or masked tail moves the result by a whole quantization step times
|x| (~ 1e-1 relative or more), far above every bound.
"""

import pytest
import torch
import torch.nn.functional as F

from kernel_utils import DEVICE, DTYPES, max_error  # first: picks the interpreter before triton is imported

from minillm.kernels.channel_matmul import (channel_gemm, channel_gemv, fp8_matmul, fp8_matmul_reference, int8_matmul,
                                            int8_matmul_reference)
from minillm.kernels.int4_matmul import int4_gemm, int4_gemv, int4_matmul, int4_matmul_reference
from minillm.kernels.quant_launch import GEMV_MAX_M, PROGRAMS_PER_SM, choose_split_k
from minillm.quant import (QuantizedLinear, dequantize_fp8, dequantize_int4, dequantize_int8, pack_int4,
                           quantize_fp8, quantize_int4, quantize_int8, unpack_int4)

# (M, N, K, group_size): M = 1, 3, 5, 16 run the GEMV (BLOCK_M 1, 4, 8, 16), 37 the GEMM.
CASES = [
    pytest.param(1, 131, 200, 64, id="M1-N131-K200-g64"),
    pytest.param(3, 80, 96, 32, id="M3-N80-K96-g32"),
    pytest.param(5, 131, 96, 64, id="M5-N131-K96-g64"),
    pytest.param(16, 131, 200, 32, id="M16-N131-K200-g32"),
    pytest.param(37, 80, 200, 64, id="M37-N80-K200-g64"),
]


def draw(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g)
    w[0, 0] = 8.0  # an outlier, as real checkpoints have: it widens its row's scale / group
    return x, w


def int4_layout(w, group):
    pad = (-w.shape[1]) % group
    q, scale, zero = quantize_int4(F.pad(w, (0, pad)), group)
    return pack_int4(q), scale, zero


def check(got, want, what):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype)
    assert not got.isnan().any(), f"{what}: NaN in the output (a masked lane or an unwritten element)"
    err, tol = max_error(got, want)
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g}"


def on_device(*tensors):
    return [t.to(DEVICE) for t in tensors]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("m, n, k, group", CASES)
def test_int8_matmul_matches_reference(m, n, k, group, dtype):
    x, w = draw(m, n, k, dtype, seed=m * 1000 + n + k)
    q, scale = quantize_int8(w)
    x, q, scale = on_device(x, q, scale)
    want = int8_matmul_reference(x, q, scale)
    # The reference is the quantizer's own matrix: x @ dequantize_int8(q, scale)^T.
    torch.testing.assert_close(want.float(), (x.float() @ dequantize_int8(q, scale).t()).to(dtype).float())
    check(int8_matmul(x, q, scale), want, f"int8_matmul M={m} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("m, n, k, group", CASES)
def test_int4_matmul_matches_reference(m, n, k, group, dtype):
    x, w = draw(m, n, k, dtype, seed=m * 1000 + n + k + 1)
    packed, scale, zero = int4_layout(w, group)
    scale, zero = scale.to(torch.bfloat16), zero.to(torch.bfloat16)  # as QuantizedLinear stores them
    x, packed, scale, zero = on_device(x, packed, scale, zero)
    want = int4_matmul_reference(x, packed, scale, zero, group)
    w_plain = dequantize_int4(unpack_int4(packed), scale, zero, dtype)[:, :k]
    torch.testing.assert_close(want.float(), (x.float() @ w_plain.float().t()).to(dtype).float())
    check(int4_matmul(x, packed, scale, zero, group), want, f"int4_matmul M={m} g={group} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("m, n, k, group", CASES)
def test_fp8_matmul_matches_reference(m, n, k, group, dtype):
    x, w = draw(m, n, k, dtype, seed=m * 1000 + n + k + 2)
    q, scale = quantize_fp8(w)
    x, q, scale = on_device(x, q, scale)
    want = fp8_matmul_reference(x, q, scale)
    torch.testing.assert_close(want.float(), (x.float() @ dequantize_fp8(q, scale).t()).to(dtype).float())
    check(fp8_matmul(x, q, scale), want, f"fp8_matmul M={m} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("m, n, k", [(3, 131, 200), (37, 80, 96)])
def test_fp8_activations_dot_matches_reference(m, n, k, dtype):
    """W8A8: x quantized per row to e4m3 and multiplied fp8 x fp8 (the GEMM for every M)."""
    x, w = draw(m, n, k, dtype, seed=m + n + k)
    x[1] *= 50.0  # rows of very different ranges: each gets its own scale
    q, scale = quantize_fp8(w)
    x, q, scale = on_device(x, q, scale)
    want = fp8_matmul_reference(x, q, scale, fp8_activations=True)
    check(fp8_matmul(x, q, scale, fp8_activations=True), want, f"fp8 x fp8 M={m} {dtype}")
    # It is W8A8, not weight-only: it differs from the weight-only result by e4m3's rounding of x
    # (<= 1/16 of each |x|), well above the summation error it is compared with above.
    weight_only = fp8_matmul_reference(x, q, scale).float()
    assert 0 < (want.float() - weight_only).abs().max() <= weight_only.abs().max() / 4


@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_gemv_split_k_slices_add_up(kind, split_k):
    # BLOCK_M 2: BLOCK_K 128 -> 5 steps (int4: Kp 640, 5 steps). One slice writes bf16 itself; more
    # write fp32 partial sums that split_k_reduce_kernel adds up into `out`.
    m, n, k, group = 2, 80, 600, 64
    x, w = draw(m, n, k, torch.bfloat16, seed=split_k)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEVICE)  # every element must be written
    if kind == "int4":
        packed, scale, zero = on_device(*int4_layout(w, group))
        x = x.to(DEVICE)
        got = int4_gemv(x, packed, scale, zero, group, split_k=split_k, out=out)
        want = int4_matmul_reference(x, packed, scale, zero, group)
    else:
        q, scale = (quantize_int8 if kind == "int8" else quantize_fp8)(w)
        x, q, scale = on_device(x, q, scale)
        got = channel_gemv(x, q, scale, split_k=split_k, out=out)
        want = (int8_matmul_reference if kind == "int8" else fp8_matmul_reference)(x, q, scale)
    assert got.data_ptr() == out.data_ptr()
    check(got, want, f"{kind} GEMV split_k={split_k}")


def test_split_k_heuristic_fills_the_gpu_and_never_splits_finer_than_a_step():
    # Llama-3-8B o_proj at batch 1: 4096 / 32 = 128 column tiles, 16 K steps -> 4 slices, 512 programs.
    split, per = choose_split_k(4096, 4096, 32, 256, 132)
    assert (split, per) == (4, 1024) and 128 * split >= PROGRAMS_PER_SM * 132 * 0.9
    assert choose_split_k(128256, 4096, 32, 256, 132) == (1, 4096)  # the head: enough tiles already
    assert choose_split_k(80, 200, 32, 256, 132) == (1, 256)       # one step: nothing to split
    split, per = choose_split_k(80, 600, 16, 64, 132)
    assert per % 64 == 0 and split * per >= 600 and (split - 1) * per < 600


def test_gemm_writes_every_output_element():
    x, w = draw(37, 131, 200, torch.float16, seed=9)
    q, scale = quantize_int8(w)
    packed, s4, z4 = int4_layout(w, 64)
    x, q, scale, packed, s4, z4 = on_device(x, q, scale, packed, s4, z4)
    out = torch.full((37, 131), float("nan"), dtype=torch.float16, device=DEVICE)
    assert channel_gemm(x, q, scale, out=out).data_ptr() == out.data_ptr()
    check(out, int8_matmul_reference(x, q, scale), "int8 GEMM into out")
    out.fill_(float("nan"))
    int4_gemm(x, packed, s4, z4, 64, out=out)
    check(out, int4_matmul_reference(x, packed, s4, z4, 64), "int4 GEMM into out")


@pytest.mark.parametrize("m", [3, 37], ids=["gemv", "gemm"])
def test_row_strided_activations(m):
    """x a column slice of a wider tensor (row stride K + 5), as a view of a fused projection is."""
    wide, w = draw(m, 80, 205, torch.float16, seed=m)
    x = wide.to(DEVICE)[:, :200]
    assert x.stride(0) == 205
    q, scale = on_device(*quantize_int8(w[:, :200]))
    packed, s4, z4 = on_device(*int4_layout(w[:, :200], 64))
    check(int8_matmul(x, q, scale), int8_matmul_reference(x.contiguous(), q, scale), "int8, strided x")
    check(int4_matmul(x, packed, s4, z4, 64), int4_matmul_reference(x.contiguous(), packed, s4, z4, 64),
          "int4, strided x")


def test_bad_inputs_are_refused_with_the_value_and_the_allowed_range():
    x, w = draw(2, 32, 64, torch.float32, seed=1)
    q, scale = quantize_int8(w)
    packed, s4, z4 = int4_layout(w, 32)
    with pytest.raises(ValueError, match=r"x has K=63 columns but the weight expects K=64"):
        int8_matmul(x[:, :63].contiguous(), q, scale)
    with pytest.raises(ValueError, match=r"x dtype torch.float64 is not one of fp32 / bf16 / fp16"):
        int8_matmul(x.double(), q, scale)
    with pytest.raises(ValueError, match=r"q must be \[N, K\] torch.int8"):
        int8_matmul(x, q.float(), scale)
    with pytest.raises(ValueError, match=r"scale must have shape \(32,\), got \(31,\)"):
        int8_matmul(x, q, scale[:31])
    with pytest.raises(ValueError, match=r"group_size=48 must be a power of two >= 32"):
        int4_matmul(x, packed, s4, z4, 48)
    with pytest.raises(ValueError, match=r"Kp - group_size < K <= Kp = 64"):
        int4_matmul(torch.randn(2, 20), packed, s4, z4, 32)
    with pytest.raises(ValueError, match=r"split_k=0 must be an integer >= 1"):
        channel_gemv(x, q, scale, split_k=0)
    with pytest.raises(ValueError, match=r"x has M=17 rows; the GEMV takes 1..16"):
        channel_gemv(torch.randn(17, 64), q, scale)
    with pytest.raises(ValueError, match=r"fp8_activations=True needs float8_e4m3fn weights, got int8"):
        channel_gemm(x, q, scale, fp8_activations=True)


# ------------------------------------------------------------------ QuantizedLinear's "triton" path
@pytest.mark.parametrize("kind", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantized_linear_triton_path_matches_its_dequantized_weight(kind, dtype):
    g = torch.Generator().manual_seed(21)
    w = (torch.randn(131, 200, generator=g) * 0.05).to(dtype)
    bias = torch.randn(131, generator=g).to(dtype)
    layer = QuantizedLinear.from_float(w.to(DEVICE), bias.to(DEVICE), kind, 64, fast=False)
    layer.path = "triton"  # what a CUDA GPU picks; "dequant" stores the same buffers
    for m in (1, 20):
        x = torch.randn(1, m, 200, generator=g).to(dtype).to(DEVICE)
        want = F.linear(x.float(), layer.dequantized_weight(torch.float32), bias.float().to(DEVICE)).to(dtype)
        got = layer(x)
        assert got.shape == (1, m, 131)
        check(got, want, f"QuantizedLinear[{kind}, triton] M={m} {dtype}")


def test_a_lab_style_int4_kernel_hook_keeps_the_engine_s_greedy_tokens():
    """The plug-in the lab uses: the Triton int4 kernel on each layer's plain layout."""
    from minillm import LLM, SamplingParams

    llm = LLM("random:tiny-llama", weight_dtype="int4", weight_group_size=32)
    prompts = [{"prompt_token_ids": [1, 5, 9, 13]}, {"prompt_token_ids": list(range(3, 400, 21))}]  # 4 + 19 tokens
    params = SamplingParams(max_tokens=3, temperature=0.0)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    launches = []

    def kernel(x2d, layer):
        launches.append(x2d.shape[0])
        packed, scale, zero = layer.int4_parts()
        return int4_matmul(x2d, packed, scale, zero, layer.group_size)

    got = [o.outputs[0].token_ids for o in llm.with_levers(quantized_matmul=kernel).generate(prompts, params)]
    assert len(set(launches)) > 1 and got == ref
    assert max(launches) > GEMV_MAX_M >= min(launches)  # prefill ran the GEMM, decode the GEMV

"""Lab 05 helpers — quantization: the weight-bytes printout, the int8 / int4 quantizer checks (against
minillm.quant), fake_quantize and the error printout, the int4 dequantizing matmul kernel's checks, its
engine hook and timing, the setting sweep widget (minillm.bench.quality), the salient-channel checks and
the ablation's protected weights (AWQ's observation), and the KV-cache size checks (GQA, int8 KV).
The experiments themselves (weight_table, error_sweep, run_with_kernel, collect_linear_inputs,
layer_ablation, ablation_perplexity, kv_table, kv_int8_run) are written in the notebook, next to the
cells that call them.

The learner writes, with fixed signatures:

    quantize_int8(w [N, K]) -> (q int8 [N, K], scale fp32 [N])          per output channel, symmetric
    dequantize_int8(q, scale) -> w [N, K] fp32
    quantize_int4(w [N, K], group_size) -> (q uint8 [N, K] in 0..15, scale [N, K/g], zero [N, K/g])
    dequantize_int4(q, scale, zero) -> w [N, K] fp32
    pack_int4(q [N, K]) -> [N, K/2] uint8 (low nibble = even column);   unpack_int4(packed) -> q
    int4_matmul(x [M, K], packed [N, K/2], scale [N, K/g], zero [N, K/g], group_size) -> y [M, N]  # Triton
    salient_channels(x [T, K], fraction) -> LongTensor of input-channel indices
    kv_bytes_per_token(num_layers, num_kv_heads, head_dim, bytes_per_value) -> int
    sequences_that_fit(budget_bytes, seq_len, bytes_per_token) -> int

Nothing here imports triton at module level: the notebook picks the interpreter first.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..quant import int4 as ref_int4
from ..quant import int8 as ref_int8
from . import common
from .common import (CheckFailed, Stopwatch, call_learner, control_panel, echo_prediction, new_figure, passed,  # noqa: F401
                     is_close, require_kernel)

MB = 1e6
GiB = 1 << 30

# ------------------------------------------------------------------ A. bytes per weight
def print_weight_table(rows: Sequence[dict], device: str) -> None:
    print(f"{'setting':<11}{'stored MB':>11}{'read/token MB':>15}{'vs fp32':>9}{'bound tok/s here':>18}{'on an H100':>12}")
    for r in rows:
        print(f"{r['label']:<11}{r['weight_bytes'] / MB:>11.1f}{r['decode_bytes'] / MB:>15.1f}{r['vs_first']:>9.2f}"
              f"{r['bound_tok_s']:>18.0f}{r['h100_tok_s']:>12.0f}")
    print(f"bound = memory bandwidth / bytes read per token (batch 1), measured on {device}; H100: 3.35 TB/s")


def weight_figure(rows: Sequence[dict], device: str):
    fig = new_figure("Bytes read per decode step and the batch-1 speed they allow", "setting",
                     "MB read per token", device=device)
    labels = [r["label"] for r in rows]
    fig.add_bar(x=labels, y=[r["decode_bytes"] / MB for r in rows], name="MB per token",
                text=[f"{r['bound_tok_s']:.0f} tok/s" for r in rows], textposition="outside")
    fig.update_layout(showlegend=False)
    return fig


# ------------------------------------------------------------------ shared check plumbing
def _random_weight(n: int, k: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Gaussian rows of different sizes, a few outlier entries (what real layers look like)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * (0.02 + torch.rand(n, 1, generator=gen))
    outliers = torch.randint(0, n * k, (max(1, n * k // 200),), generator=gen)
    w.view(-1)[outliers] *= 8
    return w.to(dtype)


_call = call_learner   # lab/common.py


def _expect_tensor(value, shape: tuple, call: str, what: str, dtypes: tuple = ()) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise CheckFailed(f"{call}: {what} is {type(value).__name__}; expected a torch.Tensor of shape {shape}")
    if tuple(value.shape) != tuple(shape):
        raise CheckFailed(f"{call}: {what} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    if dtypes and value.dtype not in dtypes:
        names = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise CheckFailed(f"{call}: {what} has dtype {str(value.dtype).replace('torch.', '')}, expected {names}")
    if value.is_floating_point() and not torch.isfinite(value).all():
        bad = (~torch.isfinite(value)).nonzero()[0].tolist()
        raise CheckFailed(f"{call}: {what}{bad} is {value[tuple(bad)].item()} — an all-zero row or group gives 0 / 0: "
                          "give it a positive scale (1, as minillm.quant does) so its codes are 0")
    return value


def _near_tie(ratio: torch.Tensor) -> torch.Tensor:
    """Where w / scale sits within 1e-4 of a half-way point, a code may round either way."""
    frac = ratio - ratio.floor()
    return (frac - 0.5).abs() < 1e-4


# ------------------------------------------------------------------ B. int8 per channel
INT8_CASES = ((64, 128), (37, 100), (1, 7))
HIDDEN_INT8_CASES = ((3, 5), (128, 1), (257, 64))


def check_int8(quantize_int8: Callable, dequantize_int8: Callable, cases=INT8_CASES, seed: int = 0,
               zero_rows: bool = False, dtype=torch.float32) -> None:
    """Codes and scales equal minillm.quant.int8's on fresh random matrices; the error is at most scale / 2.
    zero_rows=True sets some rows to 0 (their scale must stay finite and their codes 0)."""
    for i, (n, k) in enumerate(cases):
        w = _random_weight(n, k, seed + i, dtype)
        if zero_rows:
            w[:: max(1, n // 3)] = 0
        call = f"quantize_int8(w of shape ({n}, {k}){', ' + str(dtype).replace('torch.', '') if dtype != torch.float32 else ''})"
        out = _call(quantize_int8, (w.clone(),), call)
        if not isinstance(out, tuple) or len(out) != 2:
            raise CheckFailed(f"{call} returned {type(out).__name__}; expected a tuple (q, scale)")
        q, scale = out
        _expect_tensor(q, (n, k), call, "q", (torch.int8,))
        if isinstance(scale, torch.Tensor) and scale.dim() == 2 and scale.shape[0] == n and scale.shape[1] == 1:
            scale = scale[:, 0]
        if isinstance(scale, torch.Tensor) and scale.numel() == 1 and n > 1:
            raise CheckFailed(f"{call}: scale is one number for the whole matrix — int8 here is per output channel: "
                              f"one scale per row of W, scale = w.abs().amax(dim=1) / 127, shape [{n}]")
        if isinstance(scale, torch.Tensor) and tuple(scale.shape) == (k,) and k != n:
            raise CheckFailed(f"{call}: scale has shape ({k},), one per column — an output channel is a row of "
                              f"W [out_features, in_features]: reduce over dim=1, scale shape [{n}]")
        _expect_tensor(scale, (n,), call, "scale", (torch.float32, torch.float64))
        want_q, want_scale = ref_int8.quantize_int8(w)
        zero = w.float().abs().amax(dim=1) == 0
        if (q[zero] != 0).any():
            raise CheckFailed(f"{call}: an all-zero row got nonzero codes; its codes must be 0")
        if zero.any() and not (scale[zero] > 0).all():
            r = int(zero.nonzero()[0])
            raise CheckFailed(f"{call}: row {r} is all zeros and got scale {float(scale[r])} — max|w| / 127 is 0 there and "
                              "w / 0 is 0 / 0 = NaN: give such a row a positive scale (1, as minillm.quant does)")
        live = ~zero
        if not torch.allclose(scale[live].float(), want_scale[live], rtol=1e-5, atol=0):
            r = int((~torch.isclose(scale.float(), want_scale, rtol=1e-5, atol=0) & live).nonzero()[0])
            got, want = float(scale[r]), float(want_scale[r])
            hint = ""
            if math.isclose(got * 127 / 128, want, rel_tol=1e-4) is False and math.isclose(got, want * 127 / 128, rel_tol=1e-4):
                hint = " — you divided by 128: symmetric int8 uses -127..127 so that +max and -max both fit"
            elif math.isclose(got, want * 127 / 255, rel_tol=1e-4) or math.isclose(got, want * 127 / 255 * 2, rel_tol=1e-4):
                hint = " — that is an unsigned / asymmetric scale; symmetric int8 maps max|w| of the row to 127"
            elif math.isclose(got, want * 127, rel_tol=1e-4):
                hint = " — scale is max|w| / 127 (the size of one step), not max|w|"
            elif math.isclose(got, float(w.float().abs().max()) / 127, rel_tol=1e-4):
                hint = " — that is the whole matrix's max: take each row's own max (amax(dim=1))"
            raise CheckFailed(f"{call}: scale[{r}] is {got:.6g}, expected max|w[{r}, :]| / 127 = {want:.6g}{hint}")
        ratio = w.float() / want_scale[:, None]
        wrong = (q.to(torch.int32) != want_q.to(torch.int32)) & ~_near_tie(ratio) & live[:, None]
        if wrong.any():
            r, c = (int(v) for v in wrong.nonzero()[0])
            got, want = int(q[r, c]), int(want_q[r, c])
            hint = ""
            if got == int(ratio[r, c].trunc()):
                hint = " — .to(torch.int8) truncates toward zero: round first (torch.round)"
            elif abs(got - want) > 100:
                hint = " — the code wrapped around: clamp to [-127, 127] before casting to int8"
            raise CheckFailed(f"{call}: q[{r}, {c}] is {got}, expected round({float(w[r, c]):.5g} / {float(want_scale[r]):.5g}) "
                              f"= {want}{hint}")
        deq = _call(dequantize_int8, (q, scale), f"dequantize_int8(q, scale) after {call}")
        _expect_tensor(deq, (n, k), f"dequantize_int8(q, scale) after {call}", "the result")
        err = (deq.float() - w.float()).abs()
        bound = want_scale[:, None] / 2 * (1 + 1e-4) + 1e-12
        if (err > bound).any():
            r, c = (int(v) for v in (err > bound).nonzero()[0])
            hint = " — multiply each row's codes by its own scale: q * scale[:, None]"
            raise CheckFailed(f"dequantize_int8: w[{r}, {c}] = {float(w[r, c]):.5g} came back as {float(deq[r, c]):.5g}, an "
                              f"error of {float(err[r, c]):.3g} > scale / 2 = {float(want_scale[r]) / 2:.3g}{hint}")
    passed("int8 per-channel quantize / dequantize", len(cases))


# ------------------------------------------------------------------ C. int4 group-wise
INT4_CASES = ((16, 128, 32), (37, 256, 64), (5, 384, 128))
HIDDEN_INT4_CASES = ((1, 32, 32), (129, 192, 64), (3, 640, 128))


def check_int4(quantize_int4: Callable, dequantize_int4: Callable, cases=INT4_CASES, seed: int = 0,
               constant_groups: bool = False) -> None:
    """Codes, scales and zeros equal minillm.quant.int4's (unpacked); the error is at most scale / 2 per group.
    constant_groups=True makes some groups constant (scale 0 -> must stay finite, codes 0)."""
    for i, (n, k, g) in enumerate(cases):
        w = _random_weight(n, k, seed + 10 + i)
        if constant_groups:
            w[0, :g] = 0.25
            w[-1, -g:] = 0.0
        call = f"quantize_int4(w of shape ({n}, {k}), group_size={g})"
        out = _call(quantize_int4, (w.clone(), g), call)
        if not isinstance(out, tuple) or len(out) != 3:
            raise CheckFailed(f"{call} returned {type(out).__name__}; expected a tuple (q, scale, zero)")
        q, scale, zero = out
        if isinstance(q, torch.Tensor) and tuple(q.shape) == (n, k // 2):
            raise CheckFailed(f"{call}: q has shape {tuple(q.shape)} — return the codes unpacked, one per weight "
                              f"[{n}, {k}]; pack_int4 packs them (next exercise)")
        _expect_tensor(q, (n, k), call, "q", (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64))
        if isinstance(scale, torch.Tensor) and tuple(scale.shape) == (k // g, n) and n != k // g:
            raise CheckFailed(f"{call}: scale has shape {tuple(scale.shape)}; expected [N, K / group_size] = [{n}, {k // g}]: "
                              "groups are consecutive input channels of one row")
        _expect_tensor(scale, (n, k // g), call, "scale", (torch.float32, torch.float64))
        _expect_tensor(zero, (n, k // g), call, "zero", (torch.float32, torch.float64))
        want_q, want_scale, want_zero = ref_int4.quantize_int4(w, g)
        groups = w.reshape(n, k // g, g)
        if int(q.min()) < 0 or int(q.max()) > 15:
            bad = int(q.max()) if int(q.max()) > 15 else int(q.min())
            raise CheckFailed(f"{call}: a code is {bad}; 4-bit codes are 0..15 (clamp after rounding)")
        if not torch.allclose(zero.float(), want_zero, rtol=1e-5, atol=1e-7):
            r, c = (int(v) for v in (~torch.isclose(zero.float(), want_zero, rtol=1e-5, atol=1e-7)).nonzero()[0])
            got = float(zero[r, c])
            hint = ""
            lo = float(want_zero[r, c])
            s = float(want_scale[r, c])
            if s > 0 and abs(got - round(-lo / s)) < 1e-3:
                hint = (" — that is an integer zero point round(-min / scale); this lab stores zero as the group's "
                        "minimum in floating point (as GGUF's Q4_1 'min' and torch's int4 kernel do): w ~= q * scale + zero")
            elif math.isclose(got, float(w[r].min()), rel_tol=1e-5):
                hint = " — that is the whole row's minimum: each group of group_size consecutive columns has its own"
            raise CheckFailed(f"{call}: zero[{r}, {c}] is {got:.6g}, expected the minimum of w[{r}, {c * g}:{(c + 1) * g}] "
                              f"= {lo:.6g}{hint}")
        nonconstant = (groups.amax(2) > groups.amin(2))
        if not torch.allclose(scale.float()[nonconstant], want_scale[nonconstant], rtol=1e-5, atol=0):
            bad = ~torch.isclose(scale.float(), want_scale, rtol=1e-5, atol=0) & nonconstant
            r, c = (int(v) for v in bad.nonzero()[0])
            got, want = float(scale[r, c]), float(want_scale[r, c])
            hint = ""
            if math.isclose(got, want * 15 / 16, rel_tol=1e-4):
                hint = " — you divided by 16: 4 bits give 16 levels, 0..15, so 15 steps between min and max"
            elif math.isclose(got, want * 15 / 7, rel_tol=1e-4) or math.isclose(got, want * 15 / 8, rel_tol=1e-4):
                hint = " — that looks symmetric; this format is asymmetric: scale = (max - min) / 15"
            raise CheckFailed(f"{call}: scale[{r}, {c}] is {got:.6g}, expected (max - min) / 15 of w[{r}, {c * g}:{(c + 1) * g}] "
                              f"= {want:.6g}{hint}")
        if not torch.isfinite(scale).all() or (scale[~nonconstant] <= 0).any():
            raise CheckFailed(f"{call}: a constant group (max == min) got scale {scale[~nonconstant].tolist()[:3]} — give it a "
                              "positive scale (1, as minillm.quant does) so (w - zero) / scale is 0, not 0 / 0")
        ratio = (groups - want_zero[..., None]) / want_scale[..., None]
        wrong = (q.to(torch.int32) != want_q.to(torch.int32)) & ~_near_tie(ratio).reshape(n, k)
        if wrong.any():
            r, c = (int(v) for v in wrong.nonzero()[0])
            got, want = int(q[r, c]), int(want_q[r, c])
            hint = " — .to(torch.uint8) truncates: round first" if got == int(ratio.reshape(n, k)[r, c].floor()) else ""
            raise CheckFailed(f"{call}: q[{r}, {c}] is {got}, expected round((w - zero) / scale) = {want}{hint}")
        dcall = f"dequantize_int4(q, scale, zero) after {call}"
        deq = _expect_tensor(_call(dequantize_int4, (q, scale, zero), dcall), (n, k), dcall, "the result")
        err = (deq.float() - w).abs()
        bound = want_scale.repeat_interleave(g, dim=1) / 2 * (1 + 1e-4) + 1e-6 * w.abs()
        bound[~nonconstant.repeat_interleave(g, dim=1)] = 1e-6
        if (err > bound).any():
            r, c = (int(v) for v in (err > bound).nonzero()[0])
            raise CheckFailed(f"{dcall}: w[{r}, {c}] = {float(w[r, c]):.5g} came back as {float(deq[r, c]):.5g} "
                              f"(error {float(err[r, c]):.3g} > scale / 2 = {float(want_scale[r, c // g]) / 2:.3g}) — "
                              f"w = q * scale + zero with the scale and zero of group {c // g} (column {c} // {g})")
    passed("int4 group-wise quantize / dequantize", len(cases))


PACK_CASES = ((4, 8), (7, 32), (1, 2))
HIDDEN_PACK_CASES = ((33, 130), (2, 576))


def check_pack(pack_int4: Callable, unpack_int4: Callable, cases=PACK_CASES, seed: int = 0) -> None:
    """pack_int4 gives minillm.quant.int4.pack_int4's bytes (low nibble = even column); unpack inverts it."""
    for i, (n, k) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed + 20 + i)
        q = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
        q[0, :2] = torch.tensor([1, 15], dtype=torch.uint8)  # byte 0 of row 0: 0xF1 in this layout
        call = f"pack_int4(q of shape ({n}, {k}))"
        packed = _expect_tensor(_call(pack_int4, (q.clone(),), call), (n, k // 2), call, "the result", (torch.uint8,))
        want = ref_int4.pack_int4(q)
        if not torch.equal(packed, want):
            r, c = (int(v) for v in (packed != want).nonzero()[0])
            got, exp = int(packed[r, c]), int(want[r, c])
            lo, hi = int(q[r, 2 * c]), int(q[r, 2 * c + 1])
            hint = ""
            if got == (lo << 4 | hi):
                hint = " — nibbles swapped: the even column goes in the LOW nibble, the odd column in the high one"
            elif got == (lo | (hi << 4)) & 0x7F or got == lo + hi:
                hint = " — shift the odd column by 4 bits and OR (or add) it: q[:, 0::2] | (q[:, 1::2] << 4)"
            raise CheckFailed(f"{call}: byte [{r}, {c}] is 0x{got:02X}, expected 0x{exp:02X}: q[{r}, {2 * c}] = {lo} in the low "
                              f"nibble and q[{r}, {2 * c + 1}] = {hi} in the high one{hint}")
        ucall = f"unpack_int4(packed of shape ({n}, {k // 2}))"
        back = _expect_tensor(_call(unpack_int4, (want.clone(),), ucall), (n, k), ucall, "the result")
        if not torch.equal(back.to(torch.int32), q.to(torch.int32)):
            r, c = (int(v) for v in (back.to(torch.int32) != q.to(torch.int32)).nonzero()[0])
            hint = ""
            if torch.equal(back[:, : k // 2].to(torch.int32), q[:, 0::2].to(torch.int32)):
                hint = (" — the low nibbles came first, then the high ones: interleave them back "
                        "(torch.stack([low, high], dim=-1).reshape(N, K))")
            raise CheckFailed(f"{ucall}: element [{r}, {c}] is {int(back[r, c])}, expected {int(q[r, c])}{hint}")
    passed("pack_int4 / unpack_int4 in minillm's layout", len(cases))


# ------------------------------------------------------------------ D. error vs bits and group size
def fake_quantize(w: torch.Tensor, bits: int, group_size: int | None = None, offset: int = 0) -> torch.Tensor:
    """dequantize(quantize(w)) in fp32: `bits`-bit round-to-nearest, asymmetric per group of `group_size`
    consecutive columns (None: symmetric per row, as int8). `offset` shifts the group boundaries by that
    many columns (the first group is shorter), to show what misaligned blocks cost."""
    w = w.float()
    if group_size is None:
        qmax = 2 ** (bits - 1) - 1
        scale = (w.abs().amax(dim=1, keepdim=True) / qmax).clamp_min(1e-12)
        return torch.round(w / scale).clamp(-qmax, qmax) * scale
    n, k = w.shape
    front = (group_size - offset) % group_size
    pad_back = (-(k + front)) % group_size
    padded = F.pad(w, (front, pad_back), mode="replicate")
    g = padded.reshape(n, -1, group_size)
    lo, hi = g.amin(dim=2, keepdim=True), g.amax(dim=2, keepdim=True)
    qmax = 2 ** bits - 1
    scale = ((hi - lo) / qmax).clamp_min(1e-12)
    out = (torch.round((g - lo) / scale).clamp(0, qmax) * scale + lo).reshape(n, -1)
    return out[:, front:front + k]


def layer_weight(llm, name: str = "layers.3.gate_up_proj") -> torch.Tensor:
    """A float weight matrix of the loaded model, by module name (fp32 copy)."""
    module = llm.engine.model.get_submodule(name)
    if not hasattr(module, "weight"):
        raise ValueError(f"{name} has no float weight (is the model quantized?); use an LLM() without weight_dtype")
    return module.weight.detach().float().cpu().clone()


def print_error_sweep(rows: Sequence[dict], name: str) -> None:
    print(f"{'setting':<22}{name + ' (from Q4_1)':>32}{'random matrix':>16}")
    for r in rows:
        print(f"{r['label']:<22}{r['real']:>32.2e}{r['random']:>16.2e}")


def error_figure(rows: Sequence[dict], name: str):
    fig = new_figure(f"Relative weight error ‖W − Q(W)‖ / ‖W‖ — {name} vs a random matrix", "setting",
                     "relative error (log)", log_y=True)
    labels = [r["label"] for r in rows]
    fig.add_bar(x=labels, y=[max(r["real"], 1e-9) for r in rows], name=f"{name} (weights came from Q4_1)")
    fig.add_bar(x=labels, y=[r["random"] for r in rows], name="random Gaussian (never quantized)")
    fig.update_layout(barmode="group")
    return fig


MEASURED_SETTINGS = ("int8", "int4 g32", "int4 g64")   # the keys of the learner's layer_errors


def _as_number(value):
    """A float from a Python number or a one-element tensor; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return float(value) if isinstance(value, (int, float)) else None


def check_measure_layer_errors(layer_errors, int4_g64_over_int8, weight: torch.Tensor, quantize_int8: Callable,
                               dequantize_int8: Callable, quantize_int4: Callable, dequantize_int4: Callable) -> None:
    """The learner's measurement on `weight`: layer_errors[label] = ||W - Q(W)|| / ||W|| (Frobenius norms) with
    THEIR quantizers, for int8 per channel and int4 in groups of 32 and 64; and int4_g64_over_int8 = the g64
    error divided by the int8 one. Recomputed here from the learner's own functions, so only the measurement
    (its definition, its arithmetic, its direction) is graded."""
    if not isinstance(layer_errors, dict):
        raise CheckFailed(f"layer_errors is {type(layer_errors).__name__}; expected a dict {{label: relative error}} "
                          f"with the keys {list(MEASURED_SETTINGS)}")
    missing = [label for label in MEASURED_SETTINGS if label not in layer_errors]
    if missing:
        raise CheckFailed(f"layer_errors has no {missing}: measure every one of {list(MEASURED_SETTINGS)} "
                          f"(it has {list(layer_errors)})")
    w = weight.float()
    rebuilt = {}
    for label in MEASURED_SETTINGS:
        if label == "int8":
            call = f"dequantize_int8(*quantize_int8(weight)) for layer_errors[{label!r}]"
            w_hat = _call(lambda: dequantize_int8(*quantize_int8(weight.clone())), (), call)
        else:
            g = int(label.split("g")[-1])
            call = f"dequantize_int4(*quantize_int4(weight, {g})) for layer_errors[{label!r}]"
            w_hat = _call(lambda g=g: dequantize_int4(*quantize_int4(weight.clone(), g)), (), call)
        rebuilt[label] = _expect_tensor(w_hat, tuple(w.shape), call, "the reconstruction").float()
    want = {label: float((rebuilt[label] - w).norm() / w.norm()) for label in MEASURED_SETTINGS}
    for label in MEASURED_SETTINGS:
        got = _as_number(layer_errors[label])
        case = f"layer_errors[{label!r}]"
        if got is None:
            raise CheckFailed(f"{case} is {layer_errors[label]!r}; expected a number, ||W - Q(W)|| / ||W|| = "
                              f"{want[label]:.4g}")
        if common.is_close(got, want[label], rel=1e-3, abs_tol=1e-9):
            continue
        diff = rebuilt[label] - w
        hint = ""
        if common.is_close(got, float(diff.norm()), rel=1e-3):
            hint = " — that is ||W - Q(W)|| alone: divide by ||W|| to make it relative"
        elif want[label] > 0 and common.is_close(got, 1 / want[label], rel=1e-3):
            hint = " — upside down: the error goes on top, ||W - Q(W)|| / ||W||"
        elif common.is_close(got, want[label] ** 2, rel=1e-3):
            hint = " — that is the ratio of squared norms (sums of squares): take the square root, or use .norm()"
        elif common.is_close(got, float(diff.abs().mean() / w.abs().mean()), rel=1e-3):
            hint = (" — that is mean |W - Q(W)| / mean |W|: the lab's relative error uses Frobenius norms, "
                    "(w_hat - w).norm() / w.norm()")
        else:
            other = next((o for o in MEASURED_SETTINGS if o != label and common.is_close(got, want[o], rel=1e-3)), None)
            if other is not None:
                hint = f" — that is the error of {other}: the label and the setting you quantized with do not match"
        raise CheckFailed(f"{case} is {got:.6g}, but your own quantizers give ||W - Q(W)|| / ||W|| = "
                          f"{want[label]:.6g} on this weight{hint}")
    ratio = _as_number(int4_g64_over_int8)
    g64, i8 = float(layer_errors["int4 g64"]), float(layer_errors["int8"])
    if ratio is None:
        raise CheckFailed(f"int4_g64_over_int8 is {int4_g64_over_int8!r}; expected a number, "
                          f"layer_errors['int4 g64'] / layer_errors['int8'] = {g64 / i8:.4g}")
    if not common.is_close(ratio, g64 / i8, rel=1e-3):
        upside_down = common.is_close(ratio, i8 / g64, rel=1e-3)
        hint = " — divided the wrong way: g64's error over int8's" if upside_down else ""
        raise CheckFailed(f"int4_g64_over_int8 is {ratio:.6g}, expected layer_errors['int4 g64'] / layer_errors['int8'] "
                          f"= {g64:.4g} / {i8:.4g} = {g64 / i8:.4g}{hint}")
    passed("your measurement of the layer's quantization error", len(MEASURED_SETTINGS) + 1)


# ------------------------------------------------------------------ E. the int4 matmul kernel
def make_int4_inputs(m: int, n: int, k: int, group_size: int, seed: int = 0, device: str = "cpu"):
    """x [M, K] fp32 and a random W [N, K] quantized by minillm.quant.int4: (x, packed, scale, zero)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * (0.02 + torch.rand(n, 1, generator=gen))
    q, scale, zero = ref_int4.quantize_int4(w, group_size)
    x = torch.randn(m, k, generator=gen)
    return [t.to(device) for t in (x, ref_int4.pack_int4(q), scale, zero)]


def int4_matmul_reference(x, packed, scale, zero, group_size, high_first: bool = False, no_zero: bool = False,
                          scale_by_row: bool = False) -> torch.Tensor:
    """x @ dequantize_int4(unpack_int4(packed), scale, zero).T in fp32 (the flags build the usual mistakes)."""
    packed, scale, zero = packed.cpu(), scale.float().cpu(), zero.float().cpu()
    q = ref_int4.unpack_int4(packed)
    if high_first:
        q = torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(q.shape)
    if no_zero:
        zero = torch.zeros_like(zero)
    if scale_by_row:  # group index taken as if every row had one group: scale[n, 0]
        scale, zero = scale[:, :1].expand_as(scale), zero[:, :1].expand_as(zero)
    w = ref_int4.dequantize_int4(q, scale, zero)
    return x.float().cpu() @ w.t()


KERNEL_CASES = (  # (M, N, K, group_size, what it shows)
    (1, 64, 64, 32, "one row, two groups"),
    (1, 37, 128, 64, "N not a multiple of BLOCK_N: mask the last columns"),
    (3, 100, 384, 128, "three rows, three groups of 128"),
)
HIDDEN_KERNEL_CASES = (
    (16, 96, 576, 32, "16 rows (a batch of decode steps), 18 groups"),
    (2, 577, 256, 128, "577 outputs"),
    (5, 3, 64, 64, "3 outputs, 5 rows"),
)


def check_int4_matmul(int4_matmul: Callable, cases=KERNEL_CASES, seed: int = 0, device: str | None = None) -> None:
    """Your kernel vs x @ dequantize(W).T on fresh random matrices (fp32, tolerance 1e-3 relative)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    for i, (m, n, k, g, why) in enumerate(cases):
        x, packed, scale, zero = make_int4_inputs(m, n, k, g, seed=seed + i, device=device)
        call = f"int4_matmul(x [{m}, {k}], packed [{n}, {k // 2}], scale/zero [{n}, {k // g}], group_size={g})"
        out = _call(int4_matmul, (x, packed, scale, zero, g), call)
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != (m, n):
            raise CheckFailed(f"{call} returned {getattr(out, 'shape', type(out).__name__)}; expected [{m}, {n}] ([M, N])")
        want = int4_matmul_reference(x, packed, scale, zero, g)
        got = out.float().cpu()
        tol = 1e-3 * float(want.abs().max()) + 1e-4
        close = (got - want).abs() <= tol
        if bool(close.all()) and not got.isnan().any():
            continue
        r, c = (int(v) for v in (~close | got.isnan()).nonzero()[0])
        where = f"{call} ({why}): y[{r}, {c}] is {float(got[r, c]):.5g}, expected {float(want[r, c]):.5g}"
        if got.isnan().any():
            raise CheckFailed(where + " — NaN: the launcher fills y with NaN, so this output was never stored "
                              "(a grid too small, or a store mask that drops valid columns)")

        def agrees(**flags) -> bool:
            alt = int4_matmul_reference(x, packed, scale, zero, g, **flags)
            return bool(((got - alt).abs() <= tol).all())

        if agrees(high_first=True):
            raise CheckFailed(where + " — nibbles swapped: the LOW nibble (byte & 0xF) is the even column, the high "
                              "nibble (byte >> 4) the odd one")
        if agrees(no_zero=True):
            raise CheckFailed(where + " — the zero term is missing: w = q * scale + zero, so add zero * sum(x over the group)")
        if agrees(scale_by_row=True):
            raise CheckFailed(where + " — every group used group 0's scale and zero: index them [n, g] "
                              "(n * num_groups + g)")
        if (close[:, : (n // 2)].all() and not close[:, n // 2:].all()) or (m > 1 and close[0].all()):
            raise CheckFailed(where + " — some rows or column blocks are right, others wrong: check the offsets that use "
                              "program_id (row * K for x, row * N for y, cols * (K // 2) for packed)")
        raise CheckFailed(where + " — compare your loop with int4_matmul_spec above, one group at a time")
    passed("int4_matmul", len(cases))


def kernel_matmul(int4_matmul: Callable, counter: dict | None = None, layers: Sequence | None = None) -> Callable:
    """The engine part quantized_matmul=fn(x2d, layer) -> y running `int4_matmul` on the layer's plain int4 parts
    (x padded with zero columns to the padded width, which a group size that does not divide in_features needs).
    layers: only those QuantizedLinear modules (the others keep their own path); None: every int4 layer."""
    chosen = None if layers is None else {id(m) for m in layers}

    def fn(x2d: torch.Tensor, layer) -> torch.Tensor:
        if chosen is not None and id(layer) not in chosen:
            return layer.own_matmul(x2d)
        packed, scale, zero = layer.int4_parts()
        width = packed.shape[1] * 2
        x = x2d.float()
        if x.shape[1] < width:
            x = F.pad(x, (0, width - x.shape[1]))
        with Stopwatch() as sw:
            y = int4_matmul(x.contiguous(), packed, scale, zero, layer.group_size)
        if counter is not None:
            counter["calls"] = counter.get("calls", 0) + 1
            counter["kernel_s"] = counter.get("kernel_s", 0.0) + sw.seconds
        return y
    return fn


def quantized_layers(int4_llm, num_layers: int | None = None) -> list:
    """The int4 QuantizedLinear modules (with num_layers: those of the first num_layers decoder layers)."""
    from ..quant import QuantizedLinear

    model = int4_llm.engine.model
    scope = model if num_layers is None else model.layers[:num_layers]
    return [m for m in scope.modules() if isinstance(m, QuantizedLinear) and m.weight_dtype == "int4"]


def int4_matmul_reference_launcher(x, packed, scale, zero, group_size):
    """The fp32 torch reference with int4_matmul's signature."""
    return int4_matmul_reference(x, packed, scale, zero, group_size).to(x.device)


def compile_kernel(kernel, targets: Sequence[int] = (80, 90), timeout_s: int = 600) -> str:
    """Compile the learner's int4_matmul_kernel ahead of time for each CUDA compute capability (no GPU
    needed) in a fresh process without the interpreter; CheckFailed with the compiler's message if not."""
    import inspect
    import os
    import subprocess
    import sys
    import tempfile
    import textwrap

    require_kernel(kernel)
    source = textwrap.dedent(inspect.getsource(getattr(kernel, "fn", kernel)))
    signature = {"y_ptr": "*fp32", "x_ptr": "*fp32", "packed_ptr": "*u8", "scale_ptr": "*fp32", "zero_ptr": "*fp32",
                 "N": "i32", "K": "i32", "GROUP": "constexpr", "BLOCK_N": "constexpr"}
    with tempfile.TemporaryDirectory(prefix="lab05-aot-") as tmp:
        path = os.path.join(tmp, "lab05_kernel.py")
        with open(path, "w") as f:
            f.write("import triton\nimport triton.language as tl\n\n\n" + source)
        script = textwrap.dedent(f"""
            import importlib.util
            import triton
            from triton.backends.compiler import GPUTarget
            from triton.compiler import ASTSource
            spec = importlib.util.spec_from_file_location("lab05_kernel", {path!r})
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            kernel = module.{kernel.__name__ if hasattr(kernel, "__name__") else "int4_matmul_kernel"}
            for cc in {tuple(targets)!r}:
                for group in (32, 128):
                    triton.compile(ASTSource(fn=kernel, signature={signature!r},
                                             constexprs={{"GROUP": group, "BLOCK_N": 64}}),
                                   target=GPUTarget("cuda", cc, 32))
                print("sm_%d ok" % cc, flush=True)
        """)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout_s)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise CheckFailed("the kernel does not compile for the GPU (the interpreter forgave it):\n" + "\n".join(lines[-12:]))
    ok = [line for line in done.stdout.split("\n") if line.endswith(" ok")]
    return "✓ int4_matmul_kernel compiles for " + " and ".join(line.split()[0] for line in ok) + " (GROUP 32 and 128)"


def print_kernel_run(result: dict) -> None:
    """Your kernel's tokens against the fp32 reference matmul's (must be equal) and the engine's int4 path's."""
    common.print_kernel_run(result, [
        ("the fp32 reference matmul's", result["reference"], ""),
        ("the engine's own int4 path's", result["engine"], "its CPU path rounds activations to bf16: a near tie can flip"),
    ], result["calls"], f"your kernel in {result['hooked']} of the {result['num_quantized']} int4 matmuls")


def time_kernel(int4_matmul: Callable, n: int = 4096, k: int = 4096, group_size: int = 128, m: int = 1) -> dict:
    """On a GPU: your kernel on an 8B-shaped layer vs dequantize-then-matmul and vs an fp16 matmul."""
    if not torch.cuda.is_available():
        return {"device": "cpu"}
    from ..hardware import measure_memory_bandwidth

    x, packed, scale, zero = make_int4_inputs(m, n, k, group_size, device="cuda")
    w16 = ref_int4.dequantize_int4(ref_int4.unpack_int4(packed), scale, zero).half()
    x16 = x.half()
    int4_bytes = packed.numel() + 2 * 4 * scale.numel()
    yours_s = common.gpu_seconds(lambda: int4_matmul(x, packed, scale, zero, group_size))
    fp16_s = common.gpu_seconds(lambda: x16 @ w16.t())
    return {"device": torch.cuda.get_device_name(), "shape": f"x [{m}, {k}] @ W [{n}, {k}] int4 g{group_size}",
            "bandwidth": measure_memory_bandwidth("cuda"), "int4_bytes": int4_bytes, "fp16_bytes": w16.numel() * 2,
            "yours_s": yours_s, "fp16_s": fp16_s}


def print_kernel_timing(result: dict) -> None:
    """Your kernel, reading int4 weights, against an fp16 matmul reading about four times the bytes."""
    common.print_kernel_timing(result, (("yours", "int4_bytes"), ("fp16", "fp16_bytes")),
                               no_gpu="on an 8B-shaped layer against an fp16 matmul")


# ------------------------------------------------------------------ F. the setting sweep
SWEEP_SETTINGS: dict[str, dict] = {
    "fp32": {},
    "int8": {"weight_dtype": "int8"},
    "int4 g32": {"weight_dtype": "int4", "weight_group_size": 32},
    "int4 g64": {"weight_dtype": "int4", "weight_group_size": 64},
    "int4 g128": {"weight_dtype": "int4", "weight_group_size": 128},
    "int4 g32 AWQ": {"weight_dtype": "int4", "weight_group_size": 32, "weight_calibration": "awq"},
    "int4 g64 AWQ": {"weight_dtype": "int4", "weight_group_size": 64, "weight_calibration": "awq"},
    "int4 g128 AWQ": {"weight_dtype": "int4", "weight_group_size": 128, "weight_calibration": "awq"},
    "int4 g128 AutoRound": {"weight_dtype": "int4", "weight_group_size": 128, "weight_calibration": "autoround"},
}
FULL_SWEEP = ("fp32", "int8", "int4 g32", "int4 g64", "int4 g128", "int4 g32 AWQ", "int4 g64 AWQ", "int4 g128 AWQ")
QUICK_SWEEP = ("fp32", "int8", "int4 g32", "int4 g128")
ROUNDING_SWEEP = ("fp32", "int4 g128", "int4 g128 AWQ", "int4 g128 AutoRound")   # section 7's last table


def sweep(llm, labels: Sequence[str] | None = None, quick: bool = False, **overrides) -> dict:
    """minillm.bench.quality.evaluate over the chosen settings (the first is the reference)."""
    from ..bench import quality

    labels = list(labels or (QUICK_SWEEP if quick else FULL_SWEEP))
    kwargs = (dict(window=256, stride=256, max_windows=1, num_prompts=4, decode_tokens=4, decode_repeats=1,
                   num_generations=1, generation_tokens=6) if quick else
              dict(window=512, stride=256, max_windows=8, num_prompts=24, decode_tokens=32, decode_repeats=3,
                   num_generations=2, generation_tokens=24))
    kwargs.update(overrides)
    return quality.evaluate({label: SWEEP_SETTINGS[label] for label in labels}, base=llm, **kwargs)


def learned_rounding(llm, run: bool = False, quick: bool = False) -> dict | None:
    """Section 7's last table: int4 g128 rounded to nearest, with AWQ, and with AutoRound's learned
    rounding (then its grids tuned end to end), against fp32 (sweep over ROUNDING_SWEEP). That
    calibration takes about 60 min on 2 CPU cores the first time, then is read from minillm's cache:
    without the cache this runs only when run=True, and never in quick mode. Returns None (with the
    reason printed) when skipped."""
    from ..models.quantize import autoround_is_cached, calibration_cache_dir

    if quick:
        print("Quick mode: learned rounding skipped (its calibration alone takes minutes).")
        return None
    if not (run or autoround_is_cached(llm.engine.model, llm.tokenizer, 128)):
        print(f"AutoRound's calibration is not in {calibration_cache_dir()} yet. Set RUN_AUTOROUND = True and run "
              "this cell again (about 60 min on 2 CPU cores, once), or run in a terminal:\n"
              "    .venv/bin/minillm quality --settings baseline int4-awq int4-autoround --decode-tokens 0")
        return None
    return sweep(llm, ROUNDING_SWEEP, decode_tokens=0, num_generations=0)


class SettingExplorer:
    """Pick a setting: four panels (perplexity, top-1 agreement, MB read per token, decode tok/s) with the
    chosen setting highlighted, and its numbers against the reference in words."""

    PANELS = (("perplexity", "perplexity (lower is better)"), ("top1", "top-1 agreement with fp32 (%)"),
              ("mb", "weights MB (as stored)"), ("tok_s", "decode tok/s, batch 1"))

    def __init__(self, result: dict):
        import ipywidgets as widgets
        from plotly.subplots import make_subplots

        self.result = result
        self.rows = [r for r in result["rows"] if r.ok]
        self.labels = [r.label for r in self.rows]
        self.values = {
            "perplexity": [r.perplexity for r in self.rows],
            "top1": [100 * r.corpus_top1 for r in self.rows],
            "mb": [r.weight_bytes / MB for r in self.rows],
            "tok_s": [r.decode_tok_per_s for r in self.rows],
        }
        fig = make_subplots(rows=2, cols=2, subplot_titles=[title for _, title in self.PANELS],
                            vertical_spacing=0.18)
        for i, (key, _) in enumerate(self.PANELS):
            fig.add_bar(x=self.labels, y=self.values[key], row=i // 2 + 1, col=i % 2 + 1, showlegend=False,
                        marker_color=["#636efa"] * len(self.labels))
        fig.update_layout(height=620, template="plotly_white",
                          title={"text": "Quality vs memory vs speed", "subtitle": {"text": f"measured on {result['device']}"}},
                          margin=dict(t=100, l=60, r=30, b=60))
        self.buttons = widgets.ToggleButtons(options=self.labels, value=self.labels[-1], description="setting")
        control_panel(self, [self.buttons], fig)

    def update(self) -> None:
        chosen = self.buttons.value
        i = self.labels.index(chosen)
        colors = ["#ef553b" if label == chosen else "#636efa" for label in self.labels]
        with self.figure.batch_update():
            for trace in self.figure.data:
                trace.marker.color = colors
        ref, row = self.rows[0], self.rows[i]
        self.current = {"label": chosen, "perplexity": row.perplexity, "top1_agree": row.top1_agree,
                        "weight_bytes": row.weight_bytes, "decode_tok_per_s": row.decode_tok_per_s}
        speed = (f"{row.decode_tok_per_s:.1f} tok/s ({row.decode_tok_per_s / ref.decode_tok_per_s:.2f}x)"
                 if not math.isnan(row.decode_tok_per_s) else "speed not measured")
        self.label.value = (f"<b>{chosen}</b>: perplexity {row.perplexity:.3f} "
                            f"({100 * (row.perplexity / ref.perplexity - 1):+.2f}% vs {ref.label}), next token equal on "
                            f"{row.top1_agree}/{row.top1_of} prompts and {100 * row.corpus_top1:.1f}% of corpus positions, "
                            f"weights {row.weight_bytes / MB:.0f} MB ({row.weight_bytes / ref.weight_bytes:.2f}x), {speed}")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


# ------------------------------------------------------------------ G. salient channels (AWQ's observation)
def salient_reference(x: torch.Tensor, fraction: float) -> torch.Tensor:
    """The round(fraction * K) (at least 1) input channels with the largest mean |x| over tokens."""
    x = x.float().reshape(-1, x.shape[-1])
    k = max(1, round(fraction * x.shape[1]))
    return x.abs().mean(dim=0).topk(k).indices


def _planted_activations(t: int, k: int, seed: int) -> tuple[torch.Tensor, list[int], int]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen)
    chans = torch.randperm(k, generator=gen)[: max(2, k // 50)].tolist()
    for j, c in enumerate(chans):
        x[:, c] = (12 + j) * (1 if j % 2 else -1) + torch.randn(t, generator=gen)   # big mean |x|, half negative
    spike = next(c for c in torch.randperm(k, generator=gen).tolist() if c not in chans)
    x[0, spike] = 60.0 * t       # one token, one huge value: not a salient channel on average
    x[1:, spike] = 0.0
    return x, chans, spike


SALIENT_CASES = ((64, 300, 0.01), (16, 576, 0.01), (8, 1000, 0.05))
HIDDEN_SALIENT_CASES = ((5, 40, 0.01), (32, 1536, 0.02))


def check_salient_channels(salient_channels: Callable, cases=SALIENT_CASES, seed: int = 0) -> None:
    """The same set of channels as mean-|x| top-k, on activations with planted outlier channels."""
    for i, (t, k, fraction) in enumerate(cases):
        x, planted, spike = _planted_activations(t, k, seed + i)
        call = f"salient_channels(x of shape ({t}, {k}), fraction={fraction})"
        out = _call(salient_channels, (x.clone(), fraction), call)
        if isinstance(out, (list, tuple)):
            out = torch.tensor(list(out))
        if not isinstance(out, torch.Tensor) or out.dim() != 1 or out.is_floating_point():
            raise CheckFailed(f"{call} returned {getattr(out, 'shape', type(out).__name__)} "
                              f"{getattr(out, 'dtype', '')}; expected a 1-D tensor of channel indices (topk(...).indices)")
        want = salient_reference(x, fraction)
        count = len(want)
        if len(out) != count:
            hint = ""
            if len(out) == round(fraction * 100 * k) or len(out) == min(k, round(fraction * 100)):
                hint = " — fraction is already a share (0.01 = 1%), not a percentage"
            elif len(out) == 0 or len(out) == int(fraction * k) and count == 1:
                hint = " — keep at least one channel: max(1, round(fraction * K))"
            elif len(out) == t:
                hint = " — you ranked tokens, not channels: average over the tokens (dim 0)"
            raise CheckFailed(f"{call} returned {len(out)} indices, expected max(1, round({fraction} * {k})) = {count}{hint}")
        if int(out.max()) >= k or int(out.min()) < 0:
            raise CheckFailed(f"{call} returned index {int(out.max())}; channels run 0..{k - 1}")
        got = set(out.tolist())
        if got != set(want.tolist()):
            hint = ""
            if got == set(x.mean(dim=0).topk(count).indices.tolist()):
                hint = " — half the outlier channels are negative: rank by |x| (magnitude), not x"
            elif spike in got:
                hint = (f" — channel {spike} has one huge value in one token and 0 elsewhere: rank by the MEAN |x| "
                        "over tokens, not the max")
            missing = sorted(set(want.tolist()) - got)[:3]
            raise CheckFailed(f"{call}: channels {missing} have the largest mean |x| but are not in your answer{hint}")
    passed("salient_channels", len(cases))


def protected_weight(w: torch.Tensor, x: torch.Tensor, mode: str, channels: torch.Tensor | None, bits: int,
                     group_size: int, scale_up: float = 2.0) -> torch.Tensor:
    """The weight the model multiplies by after quantizing `w` with `channels` protected:
    'none' round-to-nearest everywhere; 'keep' those columns stay in fp32 (mixed precision, as in the
    AWQ paper's first experiment); 'scale' those columns are multiplied by `scale_up` before quantizing and x
    divided by it (AWQ's trick: no mixed precision)."""
    if mode == "none" or channels is None:
        return fake_quantize(w, bits, group_size)
    channels = channels.to(w.device)
    if mode == "keep":
        out = fake_quantize(w, bits, group_size)
        out[:, channels] = w.float()[:, channels]
        return out
    if mode == "scale":
        s = torch.ones(w.shape[1], device=w.device)
        s[channels] = scale_up
        return fake_quantize(w.float() * s, bits, group_size) / s
    raise ValueError(f"mode={mode!r} must be 'none', 'keep' or 'scale'")


ABLATION_VARIANTS = (  # (label, mode, which channels)
    ("round-to-nearest", "none", None),
    ("1% random kept fp32", "keep", "random"),
    ("1% salient kept fp32", "keep", "salient"),
    ("1% salient scaled x2", "scale", "salient"),
)


def ablation_channels(which, x: torch.Tensor, w: torch.Tensor, fraction: float, salient_channels: Callable,
                      gen: torch.Generator) -> torch.Tensor | None:
    """The input channels an ABLATION_VARIANTS entry protects: None for `which=None`, `fraction` of w's columns
    drawn at random (from `gen`) for "random", the learner's salient_channels(x, fraction) for "salient"."""
    if which is None:
        return None
    if which == "random":
        return torch.randperm(w.shape[1], generator=gen)[: max(1, round(fraction * w.shape[1]))]
    return torch.as_tensor(salient_channels(x, fraction)).long()


def ablation_figure(layer_rows: Sequence[dict], ppl_rows: Sequence[dict], layer_name: str, bits: int, group_size: int,
                    device: str):
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=[f"{layer_name}: relative output error",
                                                        "perplexity, every decoder Linear quantized"])
    fig.add_bar(x=[r["label"] for r in layer_rows], y=[r["output_error"] for r in layer_rows], row=1, col=1,
                showlegend=False)
    fig.add_bar(x=[r["label"] for r in ppl_rows], y=[r["perplexity"] for r in ppl_rows], row=1, col=2,
                showlegend=False, marker_color="#00cc96")
    fig.update_layout(height=460, template="plotly_white", margin=dict(t=100, l=60, r=30, b=120),
                      title={"text": f"Protecting 1% of input channels (int{bits}, groups of {group_size})",
                             "subtitle": {"text": f"measured on {device}"}})
    return fig


# ------------------------------------------------------------------ H. the KV cache: GQA and int8
def kv_reference(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_value: float) -> float:
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_value


def check_kv_bytes_per_token(kv_bytes_per_token: Callable, llm=None) -> None:
    """Against the arithmetic on several shapes, and against the engine's own `llm.kv_bytes_per_token`."""
    cases = [(30, 3, 64, 4), (30, 3, 64, 2), (32, 8, 128, 2), (32, 32, 128, 2), (1, 1, 80, 1), (80, 8, 128, 0.5)]
    for args in cases:
        got = _call(kv_bytes_per_token, args, f"kv_bytes_per_token{args}")
        want = kv_reference(*args)
        if not isinstance(got, (int, float)) or isinstance(got, bool) or not math.isclose(got, want, rel_tol=1e-9):
            hint = ""
            if isinstance(got, (int, float)) and math.isclose(got, want / 2, rel_tol=1e-9):
                hint = " — K and V: both are cached, so 2 x"
            elif isinstance(got, (int, float)) and math.isclose(got, want * 3, rel_tol=1e-9) or \
                    isinstance(got, (int, float)) and math.isclose(got, want * 4, rel_tol=1e-9):
                hint = " — the cache holds KV heads only: with GQA several query heads share one KV head"
            raise CheckFailed(f"kv_bytes_per_token{args} returned {got!r}, expected 2 * {args[0]} * {args[1]} * {args[2]} * "
                              f"{args[3]} = {want:g}{hint}")
    if llm is not None:
        cfg = llm.model_config
        bytes_per_value = torch.finfo(llm.dtype).bits // 8
        args = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, bytes_per_value)
        got = _call(kv_bytes_per_token, args, f"kv_bytes_per_token{args} (the loaded model)")
        if got != llm.kv_bytes_per_token:
            raise CheckFailed(f"for the loaded model your kv_bytes_per_token gives {got}, the engine allocates "
                              f"{llm.kv_bytes_per_token} bytes per token")
    passed("kv_bytes_per_token", len(cases) + (llm is not None))


def check_sequences_that_fit(sequences_that_fit: Callable) -> None:
    cases = [(80 * GiB, 4096, 131072), (1 << 30, 1000, 46080), (10, 1, 11), (46080 * 512 * 3, 512, 46080)]
    for budget, seq_len, per_token in cases:
        call = f"sequences_that_fit({budget}, {seq_len}, {per_token})"
        got = _call(sequences_that_fit, (budget, seq_len, per_token), call)
        want = budget // (seq_len * per_token)
        if isinstance(got, bool) or not isinstance(got, int) or got != want:
            hint = ""
            if isinstance(got, float) and math.isclose(got, budget / (seq_len * per_token)):
                hint = " — a sequence fits whole or not at all: use floor division (//) and return an int"
            elif isinstance(got, int) and got == -(-budget // (seq_len * per_token)):
                hint = " — rounded up: the last sequence would not fit"
            raise CheckFailed(f"{call} returned {got!r}, expected {budget} // ({seq_len} * {per_token}) = {want}{hint}")
    passed("sequences_that_fit", len(cases))


LLAMA_FIT = {"seq_len": 4096, "budget_bytes": 40 * GiB, "layers": 32, "heads": 32, "kv_heads": 8, "head_dim": 128}


def llama_fit_reference() -> tuple[int, int]:
    """(MHA in bf16, GQA in int8): whole sequences of 4,096 tokens of Llama-3-8B in 40 GiB of KV cache, with
    the engine's fp32 scale per token and KV head in the int8 case (as kv_table's rows)."""
    c = LLAMA_FIT
    mha_bf16 = kv_reference(c["layers"], c["heads"], c["head_dim"], 2)
    gqa_int8 = kv_reference(c["layers"], c["kv_heads"], c["head_dim"], 1) + 2 * c["layers"] * c["kv_heads"] * 4
    return tuple(int(c["budget_bytes"] // (c["seq_len"] * per_token)) for per_token in (mha_bf16, gqa_int8))


def check_answer_llama_fit(answer) -> None:
    """answer_llama_fit = (sequences with MHA in bf16, sequences with GQA in int8), Llama-3-8B at 4,096 tokens
    in 40 GiB: whole sequences, int8 with its scales (the table's rows)."""
    want = llama_fit_reference()
    c = LLAMA_FIT
    case = f"answer_llama_fit = {answer!r}"

    def whole(v) -> bool:
        return not isinstance(v, bool) and (isinstance(v, int) or isinstance(v, float) and v.is_integer())

    if not isinstance(answer, (tuple, list)) or len(answer) != 2 or not all(whole(v) for v in answer):
        raise CheckFailed(f"{case}: expected two whole numbers, (sequences with MHA in bf16, sequences with GQA in int8)")
    got = tuple(int(v) for v in answer)
    if got == want:
        passed("answer_llama_fit", 2)
        return
    per_seq = {name: c["seq_len"] * kv_reference(c["layers"], heads, c["head_dim"], nbytes)
               for name, heads, nbytes in (("mha_bf16", c["heads"], 2), ("gqa_bf16", c["kv_heads"], 2),
                                           ("gqa_int8_no_scales", c["kv_heads"], 1), ("mha_int8", c["heads"], 1),
                                           ("mha_fp32", c["heads"], 4))}
    fits = {name: int(c["budget_bytes"] // b) for name, b in per_seq.items()}
    hint = ""
    if got == want[::-1]:
        hint = " — the order is (MHA in bf16, GQA in int8): the fewer sequences first"
    elif got[1] == fits["gqa_int8_no_scales"]:
        hint = (" — int8 KV also stores an fp32 scale per token and KV head (2 x layers x kv_heads x 4 bytes per token), "
                "as the table's int8 rows do")
    elif got[1] == fits["gqa_bf16"]:
        hint = " — that is GQA in bf16: int8 stores one byte per value"
    elif got[0] in (fits["mha_int8"], fits["mha_fp32"]):
        hint = " — MHA here is in bf16: two bytes per value"
    elif got[1] == math.ceil(c["budget_bytes"] / (per_seq["gqa_int8_no_scales"]
                                                  + c["seq_len"] * 2 * c["layers"] * c["kv_heads"] * 4)):
        hint = " — rounded up: a sequence that does not fit whole does not count"
    wrong = [name for name, g, w in zip(("MHA in bf16", "GQA in int8"), got, want) if g != w]
    verb = "is" if len(wrong) == 1 else "are"
    raise CheckFailed(f"{case}: {' and '.join(wrong)} {verb} not right{hint}. Per token, MHA bf16 stores "
                      "2 x 32 layers x 32 KV heads x 128 x 2 bytes, GQA int8 2 x 32 x 8 x 128 x 1 byte plus 2 x 32 x 8 fp32 scales; a sequence is "
                      "4,096 tokens; count the whole sequences in 40 GiB (kv_table's rows do this)")


def print_kv_table(rows: Sequence[dict], seq_len: int, budget_bytes: int) -> None:
    print(f"{'model':<28}{'KV':>6}{'KiB / token':>13}{f'sequences of {seq_len} in {budget_bytes / GiB:.0f} GiB':>32}")
    for r in rows:
        print(f"{r['model']:<28}{r['dtype']:>6}{r['bytes_per_token'] / 1024:>13.1f}{r['fit']:>32}")
    print("int8 rows include the engine's fp32 scale per token and KV head (4 bytes per head_dim values)")


def kv_figure(rows: Sequence[dict], seq_len: int, budget_bytes: int):
    fig = new_figure(f"Sequences of {seq_len} tokens that fit in {budget_bytes / GiB:.0f} GiB of KV cache", "model",
                     "sequences", device="model: 2 × layers × kv_heads × head_dim × bytes per token")
    for dtype in ("bf16", "int8"):
        sel = [r for r in rows if r["dtype"] == dtype]
        fig.add_bar(x=[r["model"] for r in sel], y=[r["fit"] for r in sel], name=f"{dtype} KV",
                    text=[f"{r['bytes_per_token'] / 1024:.0f} KiB/tok" for r in sel], textposition="outside")
    fig.update_layout(barmode="group")
    return fig


def print_kv_int8_run(result: dict) -> None:
    if not result["available"]:
        print(f"kv_dtype='int8' is not available in this engine yet: {result['message']}")
        return
    print(f"engine KV bytes per token: {result['bytes_per_token']} (model dtype) -> {result['int8_bytes_per_token']} "
          f"(int8, {result['int8_bytes_per_token'] / result['bytes_per_token']:.2f}x)")
    print(f"greedy tokens equal on {result['same']} of {result['of']} prompts")




# ------------------------------------------------------------------ G. the learner's decode-speed harness
# The reference run: the notebook's measurement cell in full mode (time_decode on one chat prompt,
# SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), warmup 1, repeats 5, engines TIMED_SETTINGS) on the
# course's reference machine.
TIMED_SETTINGS = ("fp32", "int8", "int4 g128")
REFERENCE_HARDWARE = "2-core AMD EPYC (AVX2)"
# The machine was shared with other jobs at the time: the absolute tokens/s are low, the ratios are what to compare.
REFERENCE_TOKENS_PER_S = {"fp32": 2.45, "int8": 3.69, "int4 g128": 4.69}   # medians; int8 1.51x, int4 g128 1.92x


class FakeCompletion:
    """What a fake engine's output holds, reachable from the sandbox by its attributes (not a dataclass: the
    learner reads `out.outputs[0].token_ids` through the grader's handle)."""

    __sandbox_methods__ = ()
    __sandbox_attributes__ = ("token_ids", "text")

    def __init__(self, num_tokens: int):
        self.token_ids, self.text = list(range(num_tokens)), ""


class FakeRequestOutput:
    __sandbox_methods__ = ()
    __sandbox_attributes__ = ("outputs",)

    def __init__(self, num_tokens: int):
        self.outputs = [FakeCompletion(num_tokens)]


class FakeDecodeEngine:
    """A stand-in for an engine in the harness check: each generate() call moves the shared FakeClock by the next
    scripted cost and returns `tokens` output tokens per prompt."""

    __sandbox_methods__ = ("generate",)
    __sandbox_attributes__ = ()

    def __init__(self, clock, costs, tokens: int):
        self.clock, self.costs, self.tokens, self.calls = clock, list(costs), tokens, 0

    def generate(self, prompts, params=None, use_tqdm=True):
        if self.calls >= len(self.costs):
            raise RuntimeError(f"generate() called {self.calls + 1} times; warmup + repeats is {len(self.costs)}")
        self.clock.advance(self.costs[self.calls])
        self.calls += 1
        batch = prompts if isinstance(prompts, list) else [prompts]
        return [FakeRequestOutput(self.tokens) for _ in range(len(batch))]


def check_time_decode(time_decode: Callable, warmup: int = 2, repeats: int = 5, seed: int = 0) -> None:
    """Your harness with a FakeClock and three fake engines whose calls cost scripted seconds: warm-up dropped, the
    median (min, max) seconds per call, tokens per second, and each engine's speed-up over fp32."""
    import statistics

    from .common import FakeClock, scripted_costs, timing_mistake

    clock = FakeClock()
    bases = {"fp32": 1.0, "int8": 0.6, "int4 g128": 0.7}
    costs = {name: scripted_costs(base, warmup, repeats, seed + i) for i, (name, base) in enumerate(bases.items())}
    engines = {name: FakeDecodeEngine(clock, costs[name], tokens=16) for name in bases}
    call = f"time_decode(engines, prompt, params, warmup={warmup}, repeats={repeats}, clock=FakeClock)"
    params = {"max_tokens": 16, "ignore_eos": True}   # the fake engines ignore it; plain data crosses to the sandbox
    got = call_learner(lambda: time_decode(engines, {"prompt_token_ids": [1, 2, 3]}, params, warmup=warmup,
                                           repeats=repeats, clock=clock), (), call)
    if clock.reads == 0:
        raise CheckFailed(f"{call}: the clock it was given was never read: time each call with clock(), not "
                          "time.perf_counter() (the injected clock is what the check and your plot see)")
    for name, engine in engines.items():
        if engine.calls != warmup + repeats:
            raise CheckFailed(f"{call}: engine {name!r}'s generate() ran {engine.calls} times; expected warmup + "
                              f"repeats = {warmup + repeats}")
    if not isinstance(got, dict) or not all(isinstance(got.get(n), dict) for n in bases):
        raise CheckFailed(f"{call} returned {type(got).__name__}; expected a dict with one dict per engine name "
                          f"({', '.join(bases)})")
    base_tps = 16 / statistics.median(costs["fp32"][warmup:])
    for name in bases:
        timed = costs[name][warmup:]
        median = statistics.median(timed)
        want = {"median_s": median, "min_s": min(timed), "max_s": max(timed), "tokens": 16, "tokens_per_s": 16 / median,
                "speedup": 16 / median / base_tps}
        for key, value in want.items():
            have = got[name].get(key)
            if not isinstance(have, (int, float)) or not is_close(float(have), value, rel=1e-6):
                why = ""
                if isinstance(have, (int, float)):
                    if key == "median_s":
                        why = timing_mistake(float(have), costs[name], warmup)
                    elif key == "speedup" and have and is_close(1 / float(have), value, rel=1e-6):
                        why = "inverted: the speed-up is this engine's tokens/s over fp32's (above 1: faster than fp32)"
                raise CheckFailed(f"{call}: [{name!r}][{key!r}] is {have!r}, expected {value:.6g}"
                                  + (f": {why}" if why else ""))
    passed("time_decode", 1)


def decode_speed_figure(timing: dict, device: str):
    """Decode tokens/s per weight format: the median, the min-max spread, and the reference run."""
    names = list(timing)
    fig = new_figure("Decode speed at batch 1 by weight format (your harness)", "", "output tokens / s", device=device)
    med = [timing[n]["tokens_per_s"] for n in names]
    fig.add_bar(x=names, y=med, name="yours (median, min-max)",
                error_y={"type": "data", "symmetric": False,
                         "array": [timing[n]["tokens"] / timing[n]["min_s"] - m for n, m in zip(names, med)],
                         "arrayminus": [m - timing[n]["tokens"] / timing[n]["max_s"] for n, m in zip(names, med)]})
    fig.add_bar(x=names, y=[REFERENCE_TOKENS_PER_S.get(n) for n in names], name=f"reference ({REFERENCE_HARDWARE})")
    fig.update_layout(barmode="group")
    return fig


def print_decode_speed(timing: dict) -> None:
    for name, t in timing.items():
        print(f"{name:>10}: {t['tokens_per_s']:6.1f} tokens/s ({t['speedup']:.2f}x fp32; median {t['median_s']:.3f} s "
              f"per call of {t['tokens']} tokens, spread {t['min_s']:.3f} - {t['max_s']:.3f} s)")
    for name in timing:
        if name in REFERENCE_TOKENS_PER_S and name != "fp32":
            common.print_beside_reference(f"{name} speed-up over fp32", timing[name]["speedup"],
                                          REFERENCE_TOKENS_PER_S[name] / REFERENCE_TOKENS_PER_S["fp32"],
                                          REFERENCE_HARDWARE, unit="x")


def print_explain_questions(timing: dict | None) -> None:
    """Section 9's questions, the first two quoting the learner's timed speed-ups."""
    t = timing or {}
    fmt = lambda name: f"{t[name]['speedup']:.2f}x" if name in t else "(not measured)"  # noqa: E731
    print(f"1. Your harness timed int8 at {fmt('int8')} and int4 g128 at {fmt('int4 g128')} the decode speed of fp32. "
          "Section 1's int4 model reads more than 1/8 of fp32's bytes per token: name the two things that add up, "
          "and say why your int4 speed-up is not 8x either (what does this CPU's int4 path do per weight?).")
    print("2. Why is int4 with groups of 32 almost lossless on this model, and why would that not carry over to a "
          "bf16 checkpoint of the same architecture?")
    print("3. Your kernel computes scale * (q . x) + zero * sum(x) per group. What does that save compared with "
          "dequantizing q * scale + zero first, and what would a prefill (M = 512) kernel do differently?")
    print("4. In section 7, why do random 1 % columns barely help while salient ones do? Why does AWQ scale channels "
          "instead of keeping them in fp16?")
    print("5. Your answer_llama_fit has GQA in int8 fit about 8x more Llama-3-8B sequences than MHA in bf16. What does "
          "int8 KV cost that int8 weights do not (hint: who computes the scales, and when)?")
    print("6. AutoRound (section 7) changes no byte of the int4 format and no line of your kernel. Where does its gain "
          "come from, and what could it not fix?")


class TimedEngine:
    """A real engine handed to the learner's harness from the grader's kernel (the engine's own parts are references
    the sandbox does not have): generate() runs it with the SamplingParams it was made with (the harness's `params`
    argument, None here, is ignored) and returns outputs whose `outputs[0].token_ids` the harness counts."""

    __sandbox_methods__ = ("generate",)
    __sandbox_attributes__ = ()

    def __init__(self, engine, params):
        self.engine, self.params = engine, params

    def generate(self, prompts, params=None, use_tqdm=True):
        outs = self.engine.generate(prompts, self.params, use_tqdm=False)
        return [FakeRequestOutput(len(o.outputs[0].token_ids)) for o in outs]

"""minillm's CPU kernels (the cpu_*.c files), compiled on first use and called through ctypes.

Why: at batch 1 a decode step reads every weight once, so on a CPU it should run near the memory
bandwidth. torch's own paths fall short in two ways on small batches: its fp32 GEMM (MKL) streams
the weights at about half the bandwidth on AMD CPUs, and its int8 / int4 CPU kernels round the
activations to bf16; and a Llama layer is ~50 small torch ops whose dispatch costs more than their
arithmetic (17 ms of a 75 ms step on SmolLM2-135M). These kernels stream each weight row once
(fp32, int8 and int4 weights, fp32 activations) and fuse the small ops (RMSNorm with its residual
add, rotary, SiLU-and-mul, the KV store and one-query paged attention); `decode_layers` runs a decode
step's decoder layers, each of those kernels in turn, in one call (models/cpu_decode.py).

    from minillm.kernels import cpu
    cpu.available()          # False (with cpu.unavailable_reason()) when no C compiler built the library
    y = cpu.mm_f32(x, w)     # x [M, K] fp32, w [N, K] fp32 -> [M, N]

The library is built once per source, compiler and CPU with `cc -O3 -march=native -fopenmp` (SOURCES in
one call) into `<cache>/cpu_kernels/` (`$MINILLM_CACHE`, else ~/.cache/minillm); MINILLM_CPU_KERNELS=0 turns
it off (the engine then keeps its torch paths). OpenMP comes from the libgomp torch already loaded, so the
kernels share torch's threads; each call names its thread count (`threads`, default torch's).

Every wrapper checks dtypes, devices, contiguity and shapes before handing raw pointers to C:
a mistake there is a ValueError naming the tensor, not a crash.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

from ..config import cache_root

# Compiled together into one library, sharing HEADER (cpu_kernels.h names each file's kernels); the
# cache key hashes every one of them.
SOURCES = tuple(Path(__file__).with_name(f"cpu_{name}.c")
                for name in ("matmul", "matmul_int4", "small_ops", "attention", "decode_layers"))
HEADER = Path(__file__).with_name("cpu_kernels.h")
# Tried in order: the first that compiles is kept (Apple's clang has no -fopenmp: one thread then).
FLAG_SETS = (
    ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"],
    ["-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"],
    ["-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11"],
    ["-O3", "-fPIC", "-shared", "-std=gnu11"],
)
INT4_BLOCK = 32    # levels per packed block (16 bytes): mm_i4's layout
# Up to this many activation rows (decode of a small batch) mm_f32 beats torch's fp32 GEMM; callers
# send more rows (prefill) to F.linear.
KERNEL_ROWS = 16
# mm_i8 / mm_i4 up to this many rows: a short prefill too, which would otherwise dequantize every matrix.
QUANT_KERNEL_ROWS = 64

_state: dict = {}  # "lib": the loaded library, or "reason": why there is none


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC", "cc")
    source = b"".join(path.name.encode() + b"\0" + path.read_bytes() for path in (*SOURCES, HEADER))
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"no C compiler ({compiler!r}: {exc}); set CC or install gcc / clang") from exc
    key = hashlib.sha256(source + version.encode() + _cpu_key().encode()).hexdigest()[:16]
    out_dir = cache_root() / "cpu_kernels"
    lib_path = out_dir / f"minillm_cpu_{key}.so"
    if not lib_path.exists():
        out_dir.mkdir(parents=True, exist_ok=True)
        errors = []
        for flags in FLAG_SETS:
            with tempfile.NamedTemporaryFile(dir=out_dir, suffix=".so", delete=False) as tmp:
                tmp_path = Path(tmp.name)
            done = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(tmp_path), "-lm"],
                                  capture_output=True, text=True, timeout=300)
            if done.returncode == 0:
                os.replace(tmp_path, lib_path)   # atomic: a concurrent build never sees half a file
                break
            tmp_path.unlink(missing_ok=True)
            errors.append(f"{' '.join(flags)}: {done.stderr.strip()[-400:]}")
        else:
            raise RuntimeError(f"{compiler} could not build the CPU kernels (cpu_*.c):\n" + "\n".join(errors))
    lib = ctypes.CDLL(str(lib_path))
    p, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    signatures = {
        "minillm_mm_f32": [p, i64, i64, p, i64, p, p, i32],
        "minillm_mm_i8": [p, i64, i64, p, p, i64, p, p, i32],
        "minillm_mm_i4": [p, i64, i64, i64, p, p, p, i64, i64, p, p, p, p, p, i32],
        "minillm_quantize_x": [p, i64, i64, p, p],
        "minillm_rmsnorm": [p, p, p, f32, i64, i64, p],
        "minillm_rotary": [p, i64, i64, p, i64, i64, i64, i64, p, p, p],
        "minillm_silu_mul": [p, i64, i64, p],
        "minillm_store_kv": [p, p, i64, i64, i64, i64, p, p, p, i64],
        "minillm_decode_attn": [p, i64, i64, i64, i64, i64, p, p, i64, p, i64, p, i64, f32, p, p, i64, i32],
        "minillm_decode_layers": [p, i64, p, p, p, i32, i32],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.minillm_avx2.restype = ctypes.c_int
    lib.minillm_decode_layers.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded library (built on the first call), or None: see unavailable_reason()."""
    if "lib" not in _state and "reason" not in _state:
        if os.environ.get("MINILLM_CPU_KERNELS", "1") == "0":
            _state["reason"] = "turned off by MINILLM_CPU_KERNELS=0"
        else:
            try:
                _state["lib"] = _build()
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                _state["reason"] = str(exc)
    return _state.get("lib")


def available() -> bool:
    return library() is not None


def unavailable_reason() -> str | None:
    """Why the kernels are not in use (None when they are)."""
    return None if available() else _state["reason"]


def describe() -> str:
    """One line for `minillm doctor`."""
    lib = library()
    if lib is None:
        return f"off ({_state['reason'].splitlines()[0]})"
    return f"on ({'AVX2 + FMA' if lib.minillm_avx2() else 'plain C'}, built in {cache_root() / 'cpu_kernels'})"


# ------------------------------------------------------------------ checks
def _check(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple | None = None) -> None:
    # On every call of every kernel: the cheapest tensor queries (is_cpu, not device.type; Size != tuple).
    if not (t.is_cpu and t.dtype is dtype and t.is_contiguous()):
        raise ValueError(f"{name}: the CPU kernels need a contiguous {dtype} CPU tensor, got {t.dtype} on "
                         f"{t.device} (contiguous={t.is_contiguous()})")
    if shape is not None and t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def _threads(threads: int | None) -> int:
    return threads or torch.get_num_threads()


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# ------------------------------------------------------------------ matmuls with few rows
def mm_f32(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ w [N, K]^T (+ bias [N]) -> [M, N] fp32."""
    m, k = x.shape
    n = w.shape[0]
    _check(x, "x", torch.float32)
    _check(w, "weight", torch.float32, (n, k))
    if bias is not None:
        _check(bias, "bias", torch.float32, (n,))
    y = torch.empty(m, n)
    library().minillm_mm_f32(x.data_ptr(), m, k, w.data_ptr(), n, y.data_ptr(), _ptr(bias), _threads(threads))
    return y


def mm_i8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
          threads: int | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ (q int8 [N, K] * scale fp32 [N, 1])^T (+ bias) -> [M, N] fp32."""
    m, k = x.shape
    n = q.shape[0]
    _check(x, "x", torch.float32)
    _check(q, "q", torch.int8, (n, k))
    _check(scale, "scale", torch.float32, (n,))
    if bias is not None:
        _check(bias, "bias", torch.float32, (n,))
    y = torch.empty(m, n)
    library().minillm_mm_i8(x.data_ptr(), m, k, q.data_ptr(), scale.data_ptr(), n, y.data_ptr(), _ptr(bias),
                            _threads(threads))
    return y


def pack_i4(q: torch.Tensor) -> torch.Tensor:
    """Levels q [N, K] (0..15, K a multiple of 32) -> mm_i4's layout [N, K/2] uint8: in each block of 32
    levels, byte j holds level j (low nibble) and level 16 + j (high nibble)."""
    n, k = q.shape
    if k % INT4_BLOCK:
        raise ValueError(f"pack_i4 needs in_features a multiple of {INT4_BLOCK}, got {k}")
    b = q.to(torch.uint8).reshape(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    return (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_i4(packed: torch.Tensor) -> torch.Tensor:
    """mm_i4's layout [N, K/2] -> levels q [N, K] uint8 (inverse of pack_i4)."""
    n, half = packed.shape
    b = packed.reshape(n, half // (INT4_BLOCK // 2), 1, INT4_BLOCK // 2)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, 2 * half)


def mm_i4(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
          bias: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ W^T with W = q * scale + zero per group of group_size input channels (packed: pack_i4's
    layout [N, Kp/2]; scale, zero fp32 [N, Kp/g]) (+ bias) -> [M, N] fp32. g and K multiples of 32, K <= Kp,
    Kp a multiple of g: a row padded to whole groups (Int4Linear's) is multiplied by x without the padding
    (its columns would meet zeros), so the padded tail is never read.
    x is first rounded to int8 in blocks of 32 (quantize_x): the result is x_hat @ W^T, x_hat = xq * d."""
    m, k = x.shape
    n, kp = packed.shape[0], 2 * packed.shape[1]
    if group_size % INT4_BLOCK or k % INT4_BLOCK or kp % group_size or k > kp:
        raise ValueError(f"mm_i4 needs group_size and in_features multiples of {INT4_BLOCK}, the packed rows "
                         f"({kp} levels) a multiple of group_size and at least in_features, got "
                         f"group_size={group_size}, in_features={k}")
    _check(x, "x", torch.float32)
    _check(packed, "packed", torch.uint8)
    _check(scale, "scale", torch.float32, (n, kp // group_size))
    _check(zero, "zero", torch.float32, (n, kp // group_size))
    if bias is not None:
        _check(bias, "bias", torch.float32, (n,))
    y = torch.empty(m, n)
    xq = torch.empty(m, k, dtype=torch.int8)
    xd = torch.empty(m, k // INT4_BLOCK)
    xsum = torch.empty(m, kp // group_size)
    library().minillm_mm_i4(x.data_ptr(), m, k, kp, packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), group_size,
                            n, y.data_ptr(), _ptr(bias), xq.data_ptr(), xd.data_ptr(), xsum.data_ptr(),
                            _threads(threads))
    return y


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """How mm_i4 rounds its activations: x [M, K] fp32 (K a multiple of 32) -> (xq int8 [M, K], d fp32 [M, K/32]),
    x ~= xq * d per block of 32 (d = max|x| / 127, round to nearest even)."""
    m, k = x.shape
    if k % INT4_BLOCK:
        raise ValueError(f"quantize_x needs K a multiple of {INT4_BLOCK}, got {k}")
    _check(x, "x", torch.float32)
    xq = torch.empty(m, k, dtype=torch.int8)
    xd = torch.empty(m, k // INT4_BLOCK)
    library().minillm_quantize_x(x.data_ptr(), m, k, xq.data_ptr(), xd.data_ptr())
    return xq, xd


def quantize_x_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_x in torch (the same fp32 operations, so the same bits)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // INT4_BLOCK, INT4_BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    return torch.round(blocks * inv[..., None]).to(torch.int8).reshape(m, k), d


# ------------------------------------------------------------------ the small ops
def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H] -> weight * r / sqrt(mean(r^2) + eps), r = x, or r = residual + x written into residual (in place)."""
    t, h = x.shape
    _check(x, "x", torch.float32)
    _check(weight, "weight", torch.float32, (h,))
    if residual is not None:
        _check(residual, "residual", torch.float32, (t, h))
    y = torch.empty(t, h)
    library().minillm_rmsnorm(x.data_ptr(), _ptr(residual), weight.data_ptr(), eps, t, h, y.data_ptr())
    return y


def _rows_of_heads(t: torch.Tensor, name: str) -> int:
    """[T, heads, D] whose heads and dims are contiguous (a view into a fused qkv row is fine): the token stride."""
    if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        raise ValueError(f"{name}: the CPU kernels need fp32 [T, heads, head_dim] with contiguous heads, got "
                         f"{t.dtype} with strides {t.stride()}")
    return t.stride(0)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           check_ranges: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] rotated in place (rotate-half) at positions [T] int64 by cos, sin [P, D].
    check_ranges=False skips reading the positions (the engine built them and checks once per step)."""
    t, hq, d = q.shape
    hk = k.shape[1]
    q_ld, k_ld = _rows_of_heads(q, "q"), _rows_of_heads(k, "k")
    _check(positions, "positions", torch.int64, (t,))
    _check(cos, "cos", torch.float32)
    _check(sin, "sin", torch.float32, tuple(cos.shape))
    if check_ranges and t and (int(positions.max()) >= cos.shape[0] or int(positions.min()) < 0):
        raise ValueError(f"positions reach {int(positions.max())}, the rotary table has {cos.shape[0]} rows")
    library().minillm_rotary(q.data_ptr(), q_ld, hq, k.data_ptr(), k_ld, hk, t, d, positions.data_ptr(),
                             cos.data_ptr(), sin.data_ptr())
    return q, k


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> silu(gate) * up [T, I]."""
    t, two_i = gate_up.shape
    _check(gate_up, "gate_up", torch.float32)
    y = torch.empty(t, two_i // 2)
    library().minillm_silu_mul(gate_up.data_ptr(), t, two_i // 2, y.data_ptr())
    return y


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor, check_ranges: bool = True) -> None:
    """k, v [T, Hkv, D] (views of one fused row are fine: same strides) -> caches [Hkv, slots, D] at slot_mapping [T]
    (int64). check_ranges=False skips reading slot_mapping (see rotary)."""
    hk, slots, d = k_cache.shape
    t = k.shape[0]
    ld = _rows_of_heads(k, "k")
    if _rows_of_heads(v, "v") != ld or tuple(k.shape) != (t, hk, d) or tuple(v.shape) != (t, hk, d):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, {hk}, {d}] with equal strides")
    _check(k_cache, "k_cache", torch.float32)
    _check(v_cache, "v_cache", torch.float32, (hk, slots, d))
    _check(slot_mapping, "slot_mapping", torch.int64, (t,))
    if check_ranges and t and (int(slot_mapping.max()) >= slots or int(slot_mapping.min()) < 0):
        raise ValueError(f"slot_mapping reaches {int(slot_mapping.max())}, the pool has {slots} slots")
    library().minillm_store_kv(k.data_ptr(), v.data_ptr(), ld, t, hk, d, slot_mapping.data_ptr(),
                               k_cache.data_ptr(), v_cache.data_ptr(), slots)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, block_size: int, scale: float, threads: int | None = None,
                     max_len: int | None = None) -> torch.Tensor:
    """One query per sequence: q [B, Hq, D] (heads contiguous: a view into a fused qkv row is fine) over each sequence's seq_lens[b] keys in the paged caches
    [Hkv, slots, D] (block_tables [B, max_blocks] int32) -> [B, Hq, D]. max_len: the longest seq_lens
    (given by a caller that knows it, the tables and lengths are then trusted; None: read and checked)."""
    b, hq, d = q.shape
    hk, slots, _ = k_cache.shape
    q_ld = _rows_of_heads(q, "q")
    _check(k_cache, "k_cache", torch.float32, (hk, slots, d))
    _check(v_cache, "v_cache", torch.float32, (hk, slots, d))
    _check(block_tables, "block_tables", torch.int32)
    _check(seq_lens, "seq_lens", torch.int32, (b,))
    if hq % hk:
        raise ValueError(f"{hq} query heads are not a multiple of {hk} KV heads")
    max_blocks = block_tables.shape[1]
    if block_tables.shape[0] != b:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {b} sequences")
    if max_len is None:
        max_len = int(seq_lens.max()) if b else 0
        if max_len > max_blocks * block_size or (b and int(seq_lens.min()) < 1):
            raise ValueError(f"seq_lens must be in [1, {max_blocks * block_size}] (block_tables {tuple(block_tables.shape)}, "
                             f"block_size {block_size}), got {seq_lens.tolist()}")
        if b and (int(block_tables.max()) + 1) * block_size > slots or (b and int(block_tables.min()) < 0):
            raise ValueError(f"block_tables name blocks outside [0, {slots // block_size})")
    nt = _threads(threads)
    out = torch.empty(b, hq, d)
    max_len = max(max_len, 1)
    scores = torch.empty(nt, max_len)
    library().minillm_decode_attn(q.data_ptr(), q_ld, b, hq, hk, d, k_cache.data_ptr(), v_cache.data_ptr(), slots,
                                  block_tables.data_ptr(), max_blocks, seq_lens.data_ptr(), block_size, scale,
                                  out.data_ptr(), scores.data_ptr(), max_len, nt)
    return out


# ------------------------------------------------------------------ a decode step's layers in one call
class Mat(ctypes.Structure):
    """cpu_decode_layers.c's minillm_mat: one projection's weights. kind 0: fp32 w [N, K]; 1: int8 q [N, K] with
    scale [N]; 2: int4 packed [N, Kp/2] (pack_i4) with scale, zero [N, Kp/g]. Kp: K padded to g (int4)."""
    _fields_ = [("kind", ctypes.c_int64), ("N", ctypes.c_int64), ("K", ctypes.c_int64), ("Kp", ctypes.c_int64),
                ("g", ctypes.c_int64), ("w", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("zero", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    """minillm_layer: a decoder layer's norms, four projections and KV pool."""
    _fields_ = [("ln1", ctypes.c_void_p), ("ln2", ctypes.c_void_p), ("qkv", Mat), ("o", Mat), ("gate_up", Mat),
                ("down", Mat), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]


class Step(ctypes.Structure):
    """minillm_step: the step's sizes and tables (m rows, one new token each)."""
    _fields_ = [(name, ctypes.c_int64) for name in ("m", "H", "hq", "hk", "D", "I", "num_slots", "block_size",
                                                    "max_blocks", "max_len", "max_k")] + \
               [("eps", ctypes.c_float), ("scale", ctypes.c_float), ("pos", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("block_tables", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p)]


def decode_layers(layers, step: Step, residual: torch.Tensor, delta: torch.Tensor, has_delta: bool,
                  threads: int | None = None) -> None:
    """Run a decode step's decoder layers (a ctypes array of Layer) in one call: residual [m, H] updated in place,
    delta [m, H] in (has_delta) and out. Every pointer in layers and step is trusted: the caller
    (minillm/models/cpu_decode.py) builds them from the model's own tensors and checks the step's shapes."""
    _check(residual, "residual", torch.float32, (step.m, step.H))
    _check(delta, "delta", torch.float32, (step.m, step.H))
    if library().minillm_decode_layers(ctypes.addressof(layers), len(layers), ctypes.addressof(step),
                                       residual.data_ptr(), delta.data_ptr(), int(has_delta), _threads(threads)):
        raise MemoryError(f"decode_layers: no memory for the scratch of {step.m} rows")

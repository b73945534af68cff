"""What machine are we on: device name, what its GPU generation can do, memory bandwidth (measured), peak
matmul FLOP/s."""

from __future__ import annotations

import os
import platform
import time
import warnings
from functools import lru_cache

import torch


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch sees no CUDA device; use 'cpu' or 'auto'")
    return dev


# ------------------------------------------------------------------ what a GPU generation can do
# CUDA compute capabilities the Triton kernels are compiled for ahead of time, with cards learners meet.
GPU_TARGETS = {
    75: "T4 (Colab, Kaggle)",
    80: "A100",
    86: "A10, RTX 30xx",
    89: "L4, RTX 40xx",
    90: "H100, H200",
}
# What a kernel may need from the card: (lowest capability, what the engine does on an older card).
GPU_FEATURES = {
    "bf16": ((8, 0), "bfloat16 needs sm_80+ (Ampere): dtype='auto' serves float16 on this card"),
    "fp8": ((8, 9), "fp8 e4m3 needs sm_89+ (Ada, Hopper): Triton has no fp8e4nv type below; kv_dtype='int8' "
                    "is the one-byte KV cache on this card"),
    "fp8_matmul": ((9, 0), "the fp8 weight kernels (tl.dot on e4m3) run on sm_90+ (Hopper): below, fp8 weights "
                           "are dequantized to the model dtype before torch's matmul"),
}


def capability_tuple(capability) -> tuple[int, int]:
    """(major, minor) from 90, "sm_90", "9.0" or (9, 0)."""
    if isinstance(capability, tuple):
        return int(capability[0]), int(capability[1])
    text = str(capability).removeprefix("sm_").replace(".", "")
    if not text.isdigit() or len(text) < 2:
        raise ValueError(f"capability={capability!r}: give it as 90, 'sm_90', '9.0' or (9, 0)")
    return int(text[:-1]), int(text[-1])


def sm_name(capability) -> str:
    """(8, 9), 89 or "8.9" -> "sm_89"."""
    major, minor = capability_tuple(capability)
    return f"sm_{major}{minor}"


def missing_gpu_feature(capability, feature: str) -> str | None:
    """Why a card of `capability` lacks `feature` (a key of GPU_FEATURES), or None when it has it."""
    if feature not in GPU_FEATURES:
        raise ValueError(f"feature={feature!r} is not one of {sorted(GPU_FEATURES)}")
    lowest, why = GPU_FEATURES[feature]
    return None if capability_tuple(capability) >= lowest else why


def gpu_capability(device: torch.device) -> tuple[int, int]:
    """The compute capability of a CUDA device; MINILLM_FAKE_CAPABILITY (e.g. "7.5") stands in for it, so the
    format choices of other cards can be checked on any machine."""
    fake = os.environ.get("MINILLM_FAKE_CAPABILITY")
    if fake:
        return capability_tuple(fake)
    return tuple(torch.cuda.get_device_capability(device))


def gpu_formats(capability) -> dict:
    """The number formats minillm serves on a card of `capability`, and what it cannot do (for doctor, labs)."""
    cc = capability_tuple(capability)
    lacks = {feature: missing_gpu_feature(cc, feature) for feature in GPU_FEATURES}
    return {
        "capability": sm_name(cc),
        "auto_dtype": "float16" if lacks["bf16"] else "bfloat16",
        "dtypes": ("float32", "float16") + (() if lacks["bf16"] else ("bfloat16",)),
        "kv_dtypes": ("int8",) + (() if lacks["fp8"] else ("fp8",)),
        "fp8_weights": "dequantize" if lacks["fp8_matmul"] else "triton",
        "cannot": [why for why in lacks.values() if why],
    }


def describe_gpu_formats(capability) -> str:
    """One line in words: the card, the formats minillm serves on it, what it cannot do."""
    formats = gpu_formats(capability)
    major, minor = capability_tuple(capability)
    card = GPU_TARGETS.get(major * 10 + minor)
    line = (f"{formats['capability']}{f' ({card})' if card else ''}: dtype='auto' serves {formats['auto_dtype']}; "
            f"Triton KV formats {' / '.join(formats['kv_dtypes'])}; fp8 weights "
            + ("on the Triton fp8 kernels" if formats["fp8_weights"] == "triton" else "dequantized before the matmul"))
    return line + (f". On this card: {'; '.join(formats['cannot'])}" if formats["cannot"] else "")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """dtype="auto": float32 on a CPU (bf16 matmuls are slower there), bfloat16 on a GPU (half the bytes), and
    float16 on a GPU without bfloat16 (sm_75: T4), with a warning that says so. dtype="bfloat16" on such a
    card is refused."""
    if device.type == "cuda":
        capability = gpu_capability(device)
        lacks_bf16 = missing_gpu_feature(capability, "bf16")
        if dtype == "auto":
            if lacks_bf16:
                warnings.warn(f"{sm_name(capability)}: {lacks_bf16}", stacklevel=3)
                return torch.float16
            return torch.bfloat16
        if dtype == "bfloat16" and lacks_bf16:
            raise ValueError(f"dtype='bfloat16' on a GPU of compute capability {sm_name(capability)}: "
                             f"{lacks_bf16}. Use dtype='float16' or 'auto'.")
    elif dtype == "auto":
        return torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


@lru_cache(maxsize=None)
def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(device: torch.device | str = "auto") -> str:
    """A label for plots and tables, e.g. 'cpu: AMD EPYC 7B13 (2 threads)' or 'cuda: NVIDIA H200'."""
    dev = resolve_device(device) if isinstance(device, str) else device
    if dev.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(dev)}"
    return f"cpu: {cpu_name()} ({torch.get_num_threads()} threads)"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


@lru_cache(maxsize=None)
def measure_memory_bandwidth(device: str = "auto", nbytes: int = 256 << 20, repeats: int = 5, kind: str = "read") -> float:
    """Achieved memory bandwidth in bytes/s, best of `repeats`, on a buffer far larger than caches.

    kind="read": a sum over the buffer, which only reads — the pattern of decode, which
    reads every weight once per step. kind="copy": a device-to-device copy, read + write
    bytes counted (what GPU papers usually quote). Cached per process (it takes ~1 s).
    """
    if kind not in ("read", "copy"):
        raise ValueError(f"kind={kind!r} must be 'read' or 'copy'")
    dev = resolve_device(device)
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src) if kind == "copy" else None
    op = (lambda: dst.copy_(src)) if kind == "copy" else (lambda: src.sum())
    op()
    best = float("inf")
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        op()
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return (2 if kind == "copy" else 1) * n * 4 / best


@lru_cache(maxsize=None)
def measure_matmul_flops(device: str = "auto", size: int = 1024, dtype: torch.dtype = torch.float32, repeats: int = 5) -> float:
    """Achieved dense matmul FLOP/s on square matrices (the compute roof)."""
    dev = resolve_device(device)
    a = torch.randn(size, size, dtype=dtype, device=dev)
    b = torch.randn(size, size, dtype=dtype, device=dev)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        a @ b
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return 2 * size ** 3 / best


def num_cpu_threads() -> int:
    return torch.get_num_threads() or os.cpu_count() or 1

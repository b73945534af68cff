"""What machine are we on: device name, memory bandwidth (measured), peak matmul FLOP/s."""

from __future__ import annotations

import os
import platform
import time
from functools import lru_cache

import torch


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but torch sees no CUDA device; use 'cpu' or 'auto'")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        # bf16 matmuls are slower than fp32 on most CPUs; on GPUs bf16 halves the bytes read.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
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

"""Compile every Triton kernel ahead of time for sm_80 and sm_90 — no GPU needed.

Triton ships ptxas, so `triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`
runs on a CPU-only machine and catches what the interpreter forgives (a `tl.dot` with a
dimension under 16, an unsupported dtype on one architecture, register spills).
Run it in a process *without* TRITON_INTERPRET=1: `python -m minillm.kernels.aot`.
"""

from __future__ import annotations

import os
import sys

# (kernel name, signature, constexprs) for every configuration the engine launches.
_FLOAT_TYPES = ("fp32", "bf16", "fp16")


def configurations():
    from .rmsnorm import rmsnorm_kernel

    for dtype in _FLOAT_TYPES:
        for has_residual in (False, True):
            for block in (64, 1024, 8192):  # head-sized, SmolLM2's 576 -> 1024, Llama-8B's 4096 -> 8192
                sig = {"x_ptr": f"*{dtype}", "residual_ptr": f"*{dtype}", "weight_ptr": f"*{dtype}",
                       "out_ptr": f"*{dtype}", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32",
                       "hidden": "i32", "eps": "fp32", "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr"}
                yield (f"rmsnorm[{dtype},residual={has_residual},BLOCK={block}]", rmsnorm_kernel, sig,
                       {"HAS_RESIDUAL": has_residual, "BLOCK": block})


def compile_all(capabilities=(80, 90)) -> list[tuple[str, int, bool, str]]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("ahead-of-time compilation needs TRITON_INTERPRET unset (the interpreter replaces @triton.jit)")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    results = []
    for name, kernel, sig, constexprs in configurations():
        for cc in capabilities:
            try:
                compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs),
                                          target=GPUTarget("cuda", cc, 32))
                results.append((name, cc, True, f"{len(compiled.asm['cubin'])} bytes of cubin"))
            except Exception as exc:  # report every failure, not only the first
                results.append((name, cc, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"))
    return results


def main() -> int:
    results = compile_all()
    for name, cc, ok, msg in results:
        print(f"{'ok ' if ok else 'BAD'} sm_{cc} {name}: {msg}")
    bad = sum(not ok for *_, ok, _ in results)
    print(f"{len(results) - bad} compiled, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

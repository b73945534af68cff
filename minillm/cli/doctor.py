"""The installation: `minillm doctor` (run_doctor, also lab 00's checks) and `minillm model` (the default model's cache)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


_TRITON_SELF_CHECK = textwrap.dedent("""
    import torch
    from minillm.kernels.rmsnorm import rmsnorm, rmsnorm_reference
    torch.manual_seed(0)
    x = torch.randn(5, 80); w = torch.randn(80); r = torch.randn(5, 80)
    r1, r2 = r.clone(), r.clone()
    got = rmsnorm(x, w, 1e-6, residual=r1); want = rmsnorm_reference(x, w, 1e-6, residual=r2)
    err = (got - want).abs().max().item()
    assert err < 1e-5 and torch.allclose(r1, r2), f"max error {err}"
    print(f"max abs error {err:.1e}")
""")


def run_doctor(load_model: bool = True, capability=None) -> list[tuple[str, bool, str]]:
    """Each check -> (name, ok, message in words). Used by `minillm doctor` and lab 00. `capability` (e.g. 75):
    also say which formats a card of that compute capability gets, on any machine."""
    checks: list[tuple[str, bool, str]] = []
    checks.append(("python", sys.version_info >= (3, 10), f"{sys.version.split()[0]} (3.10 or newer needed)"))
    try:
        import torch

        checks.append(("torch", True, f"{torch.__version__}"))
    except Exception as exc:  # pragma: no cover - doctor explains broken installs
        checks.append(("torch", False, f"cannot import torch ({exc}); run `make setup`"))
        return checks
    try:
        import triton

        checks.append(("triton", True, triton.__version__))
    except Exception as exc:
        checks.append(("triton", False, f"cannot import triton ({exc}); `pip install triton` (3.6 or newer)"))
    from ..hardware import describe_gpu_formats, device_name, gpu_capability, resolve_device

    dev = resolve_device()
    checks.append(("device", True, device_name(dev) + ("" if dev.type == "cuda" else
                  " — no CUDA GPU seen: the engine runs on the CPU (minillm's CPU kernels, else torch's ops); Triton kernels "
                  "run in the interpreter")))
    from ..threads import cpu_load_report, format_cpu_load

    # Information, never a failure: a busy machine is a reason decode is slow, not a broken install.
    threads_line, load_line = format_cpu_load(cpu_load_report(interval_s=0.5))
    checks.append(("threads", True, threads_line))
    checks.append(("cpu load", True, load_line))
    from ..kernels import cpu

    # Information too: without a C compiler the engine keeps torch's CPU ops (slower, same tokens).
    checks.append(("cpu kernels", True, cpu.describe() + ("" if cpu.available() else
                  " — the engine uses torch's CPU ops instead; install gcc or clang (set CC) for the fast path")))
    if dev.type == "cuda" or capability is not None:
        checks.append(("gpu formats", True, describe_gpu_formats(capability or gpu_capability(dev))
                       + ("" if dev.type == "cuda" else " (asked with --capability; this machine has no GPU)")))
    env = dict(os.environ)
    if dev.type != "cuda":
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-c", _TRITON_SELF_CHECK], capture_output=True, text=True, env=env, timeout=300)
    mode = "compiled for the GPU" if dev.type == "cuda" else "under TRITON_INTERPRET=1"
    if proc.returncode == 0:
        checks.append(("triton kernel", True, f"fused RMSNorm {mode} matches torch: {proc.stdout.strip()}"))
    else:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
        checks.append(("triton kernel", False, f"fused RMSNorm {mode} failed: {tail[0]}"))
    from ..models.default import check_model_dir, default_model_dir, gguf_path

    try:
        checks.append(("default model GGUF", True, str(gguf_path())))
    except FileNotFoundError as exc:
        checks.append(("default model GGUF", False, str(exc)))
    problem = check_model_dir(default_model_dir())
    if problem is None:
        checks.append(("default model cache", True, str(default_model_dir())))
    else:
        checks.append(("default model cache", False, f"{problem}; `minillm model` converts it (about 30 s)"))
    if load_model and problem is None:
        try:
            from .. import LLM, SamplingParams

            llm = LLM()
            out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4))[0]
            ok = "Paris" in out.outputs[0].text
            checks.append(("default model answers", ok, f"'The capital of France is' -> {out.outputs[0].text!r}"
                           + ("" if ok else " (expected Paris: the weights may be damaged; run `minillm model --rebuild`)")))
        except Exception as exc:
            checks.append(("default model answers", False, f"{type(exc).__name__}: {exc}"))
    return checks


def cmd_doctor(args) -> int:
    checks = run_doctor(load_model=not args.no_model, capability=args.capability)
    width = max(len(name) for name, _, _ in checks)
    for name, ok, msg in checks:
        print(f"{('!! ' if msg.startswith('WARNING') else 'ok ') if ok else 'BAD'}  {name:<{width}}  {msg}")
    bad = [name for name, ok, _ in checks if not ok]
    warned = [name for name, ok, msg in checks if ok and msg.startswith("WARNING")]
    print(("\nall good" if not bad else f"\n{len(bad)} problem(s): {', '.join(bad)}")
          + (f" (warning: {', '.join(warned)})" if warned else ""))
    return 1 if bad else 0


def cmd_model(args) -> int:
    from ..models.default import check_model_dir, convert_default_model, default_model_dir, default_model_path

    if args.check:
        problem = check_model_dir(default_model_dir(), deep=True)
        print(problem or f"ok: {default_model_dir()}")
        return 1 if problem else 0
    if args.rebuild:
        print(convert_default_model())
        return 0
    print(default_model_path())
    return 0


def add_parsers(sub) -> None:
    d = sub.add_parser("doctor", help="check the installation and explain what is wrong")
    d.add_argument("--no-model", action="store_true", help="skip loading the model")
    d.add_argument("--capability", default=None, metavar="CC",
                   help="also say which formats a GPU of this compute capability gets (75: T4, 80, 86, 89, 90: H100)")
    d.set_defaults(func=cmd_doctor)

    m = sub.add_parser("model", help="convert the default model into the cache (once) and print its path")
    m.add_argument("--check", action="store_true", help="verify the cache (sizes and SHA-256)")
    m.add_argument("--rebuild", action="store_true", help="convert again from the GGUF")
    m.set_defaults(func=cmd_model)

"""minillm generate | bench | quality | memory | doctor | model — the command line."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

from .levers import parse_levers


def _parse_levers(pairs: list[str]) -> dict:
    """['kv_cache=false', 'max_num_seqs=8'] -> {'kv_cache': False, 'max_num_seqs': 8} (minillm/levers.py reads each
    value by its field's type); a bad pair stops the command with the reason."""
    try:
        return parse_levers(pairs)
    except ValueError as error:
        raise SystemExit(str(error)) from None


# ------------------------------------------------------------------ generate
def cmd_generate(args) -> int:
    from . import LLM, SamplingParams

    llm = LLM(args.model, **_parse_levers(args.set))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    prompt = args.prompt
    if not args.raw and getattr(llm.tokenizer, "chat_template", None):
        ids = llm.chat_token_ids([{"role": "user", "content": prompt}])
        prompt = {"prompt": prompt, "prompt_token_ids": ids}
    for piece in llm.stream(prompt, params):
        print(piece, end="", flush=True)
    print()
    return 0


# ------------------------------------------------------------------ bench
def _format_table(rows: list[dict], device: str) -> str:
    # (key, header, width, number format)
    cols = [
        ("label", "setting", 22, ""),
        ("ttft_p50_ms", "TTFT p50 ms", 12, ".1f"),
        ("ttft_p90_ms", "TTFT p90 ms", 12, ".1f"),
        ("tpot_p50_ms", "TPOT p50 ms", 12, ".1f"),
        ("tpot_p90_ms", "TPOT p90 ms", 12, ".1f"),
        ("output_tok_per_s", "out tok/s", 10, ".1f"),
        ("peak_kv_mib", "KV MiB", 8, ".1f"),
        ("usd_per_mtok", "$/Mtok", 9, ".3f"),
    ]
    align = {"label": "<"}
    head = "".join(f"{h:{align.get(k, '>')}{w}}" for k, h, w, _ in cols)
    lines = [f"device: {device}", head]
    for row in rows:
        lines.append("".join(f"{row[k]:{align.get(k, '>')}{w}{fmt}}" for k, _, w, fmt in cols))
    return "\n".join(lines)


def cmd_bench(args) -> int:
    from . import LLM
    from .bench.compare import compare_with_transformers, format_compare
    from .bench.runner import run_workload
    from .bench.workloads import chat_workload

    levers = _parse_levers(args.set)
    if args.compare_peers:   # minillm's formats vs transformers, CTranslate2 (and llama.cpp), batch-1 decode
        from .bench.peers import run as run_peers

        run_peers(args.model, args.compare_prompts, args.max_tokens or 64, args.rounds, args.gguf, args.json,
                  levers=levers)
        return 0
    if args.tensor_parallel is not None:   # N ranks vs N = 1: all-reduce bytes and time per step
        from .bench.tensor_parallel import run as run_tensor_parallel

        result = run_tensor_parallel(args.model, args.tensor_parallel, args.num_requests or 4, 32,
                                     args.max_tokens or 16, levers={"max_model_len": 512, **levers})
        return 0 if result["tokens_match"] and result["bytes_match"] else 1
    llm = LLM(args.model, **levers)
    if args.workload == "mixed":
        return _bench_mixed(llm, args)
    if args.workload == "shared-prefix":
        return _bench_shared_prefix(llm, args)
    if args.workload == "repeat":
        return _bench_repeat(llm, args)
    args.max_tokens = args.max_tokens or 64
    requests = chat_workload(args.num_requests or 8, args.max_tokens, llm.tokenizer)
    results = [run_workload(llm, requests, label=", ".join(f"{k}={v}" for k, v in levers.items()) or "default")]
    if args.compare_kv_cache:
        other = LLM(args.model, **{**levers, "kv_cache": not llm.config.kv_cache})
        results.append(run_workload(other, requests, label=f"kv_cache={other.config.kv_cache}"))
    rows = [r.row() for r in results]
    first = results[0]
    print(f"workload: {first.num_requests} chat requests, {first.prompt_tokens} prompt tokens, "
          f"{args.max_tokens} output tokens each, max batch {first.max_batch}")
    print(_format_table(rows, first.device))
    print(
        f"\nmemory-bandwidth bound, batch 1: {first.weight_bytes / 1e6:.0f} MB of weights + "
        f"{first.kv_bytes_per_token * first.mean_context_tokens / 1e6:.1f} MB of KV per decode step "
        f"at {first.bandwidth_bytes_per_s / 1e9:.1f} GB/s (measured read) -> {first.bound_tokens_per_s:.1f} tok/s; "
        f"measured: {rows[0]['decode_tok_per_s_per_seq']:.1f} tok/s per sequence at batch {first.max_batch} "
        f"({rows[0]['output_tok_per_s']:.1f} tok/s in all, prefill included)"
    )
    print(f"cost model: {first.usd_per_hour:.2f} USD/hour (set with --set gpu_hourly_usd=...)")
    report = {"results": rows, "device": first.device}
    if args.compare_transformers:
        prompt_ids = [r.prompt["prompt_token_ids"] if isinstance(r.prompt, dict) else llm.tokenizer.encode(r.prompt)
                      for r in requests[: args.compare_prompts]]
        cmp = compare_with_transformers(llm, prompt_ids, new_tokens=args.max_tokens)
        print()
        print(format_compare(cmp))
        report["compare_transformers"] = {**cmp, "rows": [r.__dict__ for r in cmp["rows"]]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


def _bench_shared_prefix(llm, args) -> int:
    from .bench.prefix import compare_prefix_caching, format_prefix, shared_prefix_workload

    requests = shared_prefix_workload(llm.tokenizer, prefix_tokens=args.prefix_tokens,
                                      num_questions=args.num_requests or 10, max_tokens=args.max_tokens or 16)
    result = compare_prefix_caching(llm, requests)
    print(format_prefix(result, args.prefix_tokens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "off": result["off"].__dict__, "on": result["on"].__dict__}, f, indent=1, default=str)
    return 0 if result["identical"] == result["num_requests"] else 1


def _bench_repeat(llm, args) -> int:
    from .bench.speculative import compare_speculative, format_speculative, repeat_workload

    requests = repeat_workload(llm, num_requests=args.num_requests or 4, max_tokens=args.max_tokens or 96)
    others = {}
    if args.self_draft:
        others["self k=4"] = dict(speculative="self", num_speculative_tokens=4)
    if args.draft_model:
        others["draft k=4"] = dict(speculative="draft", draft_model=args.draft_model, num_speculative_tokens=4)
    result = compare_speculative(llm, requests, others=others)
    print(format_speculative(result))
    if args.json:
        rows = [{k: v for k, v in row.items() if k != "run"} for row in result["rows"]]
        with open(args.json, "w") as f:
            json.dump({"device": result["device"], "rows": rows}, f, indent=1, default=str)
    return 0 if all(row["identical"] == result["num_requests"] for row in result["rows"]) else 1


def _bench_mixed(llm, args) -> int:
    from .bench.batching import compare_batching, format_batching
    from .bench.workloads import mixed_workload

    requests = mixed_workload(llm.tokenizer, num_requests=args.num_requests or 256, scale=args.scale, seed=args.seed)
    result = compare_batching(llm, requests, batch_size=llm.config.max_num_seqs,
                              with_transformers=args.compare_transformers)
    print(format_batching(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "rows": [{**r.__dict__, "tok_per_s": r.tok_per_s} for r in result["rows"]]}, f,
                      indent=1, default=str)
    return 0


# ------------------------------------------------------------------ quality
def _quality_settings(names: list[str]) -> dict:
    """'int8' (a known name) or 'weight_dtype=int4,kv_cache=false' (levers; the label is the text)."""
    from .bench.quality import KNOWN_SETTINGS

    settings = {}
    for name in names:
        if name in KNOWN_SETTINGS:
            settings[name] = KNOWN_SETTINGS[name]
        elif "=" in name:
            settings[name] = _parse_levers(name.split(","))
        else:
            raise ValueError(f"--settings: {name!r} is neither one of {sorted(KNOWN_SETTINGS)} "
                             "nor LEVER=VALUE[,LEVER=VALUE...]")
    return settings


def cmd_quality(args) -> int:
    from .bench.quality import DEFAULT_SETTINGS, evaluate, format_quality, result_to_json

    settings = _quality_settings(args.settings or list(DEFAULT_SETTINGS))
    result = evaluate(settings, model=args.model, window=args.window, stride=args.stride,
                      max_windows=args.max_windows, num_prompts=args.prompts, decode_tokens=args.decode_tokens,
                      decode_repeats=args.decode_repeats, num_generations=args.generations,
                      generation_tokens=args.generation_tokens, progress=not args.no_progress,
                      **_parse_levers(args.set))
    print(format_quality(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result_to_json(result), f, indent=1, default=str)
    return 0


# ------------------------------------------------------------------ memory
def cmd_memory(args) -> int:
    from .bench.memory import memory_table, format_memory, plot_memory
    from .models.presets import preset_config

    if args.budget_gb <= 0:
        raise ValueError(f"--budget-gb {args.budget_gb} must be > 0")
    budget = args.budget_gb * 1e9
    tables = {}
    for name in args.models:
        cfg = preset_config(name)
        tables[name] = (cfg, memory_table(cfg, budget, args.seq_len, args.base_dtype))
        print(format_memory(name, cfg, tables[name][1], budget, args.seq_len) + "\n")
    print(f"quantized settings keep the norms (and an untied embedding) in {args.base_dtype}; a tied embedding is "
          "looked up in the quantized head (one copy). Under int4 the lm_head is int8 per-channel (int4-head4: int4, "
          "groups of 32). seqs = floor((budget - weights) / (seq_len x KV bytes per token)): "
          "activations and pool rounding not counted. GB = 1e9 bytes.")
    if args.plot:
        print(f"plot: {plot_memory(tables, args.plot, budget, args.seq_len, args.base_dtype)}")
    return 0


# ------------------------------------------------------------------ doctor
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
    from .hardware import describe_gpu_formats, device_name, gpu_capability, resolve_device

    dev = resolve_device()
    checks.append(("device", True, device_name(dev) + ("" if dev.type == "cuda" else
                  " — no CUDA GPU seen: the engine runs on the CPU (minillm's CPU kernels, else torch's ops); Triton kernels "
                  "run in the interpreter")))
    from .threads import cpu_load_report, format_cpu_load

    # Information, never a failure: a busy machine is a reason decode is slow, not a broken install.
    threads_line, load_line = format_cpu_load(cpu_load_report(interval_s=0.5))
    checks.append(("threads", True, threads_line))
    checks.append(("cpu load", True, load_line))
    from .kernels import cpu

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
    from .models.default import check_model_dir, default_model_dir, gguf_path

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
            from . import LLM, SamplingParams

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


# ------------------------------------------------------------------ model
def cmd_model(args) -> int:
    from .models.default import check_model_dir, convert_default_model, default_model_dir, default_model_path

    if args.check:
        problem = check_model_dir(default_model_dir(), deep=True)
        print(problem or f"ok: {default_model_dir()}")
        return 1 if problem else 0
    if args.rebuild:
        print(convert_default_model())
        return 0
    print(default_model_path())
    return 0


# Commands with their own argument parsers, in their own modules (each exposes main(argv) -> int).
DELEGATED = {
    ("serve",): ("minillm.serve.cli", "an OpenAI-compatible HTTP server on the engine (every lever is a flag)"),
    ("fleet",): ("minillm.fleet.ray_fleet", "replicas behind Ray Serve's router and autoscaler (the same OpenAI "
                                            "routes); --demo-autoscale prints a 1 -> 2 -> 1 timeline"),
    ("bench", "serve"): ("minillm.bench.serve", "load generator against an OpenAI-compatible endpoint "
                                                 "(Poisson arrivals or fixed concurrency; vLLM-style report)"),
    ("bench", "lora"): ("minillm.bench.lora", "one batch mixing N LoRA adapters vs merging each into the weights "
                                               "and serving the groups one after another: tok/s and memory"),
    ("bench", "many-models"): ("minillm.bench.many_models", "multi-LoRA batched vs merge-and-swap, then MoE bytes "
                                                             "read per decode step vs batch size, in one run"),
    ("bench", "fleet"): ("minillm.bench.fleet", "the fleet simulator: a simulated day hour by hour, the warm replicas "
                                                 "a p99 TTFT target needs, --validate against a real Ray Serve fleet"),
    ("cost",): ("minillm.bench.cost", "$ per million output tokens as the levers stack, measured here, plotted"),
}


def _delegate(argv: list[str]) -> int | None:
    import importlib

    for prefix, (module, _) in DELEGATED.items():
        if tuple(argv[:len(prefix)]) == prefix:
            return importlib.import_module(module).main(argv[len(prefix):])
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    delegated = _delegate(argv)
    if delegated is not None:
        return delegated
    parser = argparse.ArgumentParser(prog="minillm", description=__doc__,
                                     epilog="also: " + "; ".join(f"minillm {' '.join(k)}: {h}"
                                                                 for k, (_, h) in DELEGATED.items()))
    sub = parser.add_subparsers(dest="command", required=True)
    for prefix, (_, help_text) in DELEGATED.items():
        if len(prefix) == 1:
            sub.add_parser(prefix[0], help=help_text, add_help=False)

    g = sub.add_parser("generate", help="stream an answer to a prompt")
    g.add_argument("prompt")
    g.add_argument("--model", default=None, help="HF directory or hub id (default: SmolLM2-135M-Instruct)")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="no chat template: continue the text as given")
    g.add_argument("--set", nargs="*", metavar="LEVER=VALUE", help="engine levers, e.g. kv_cache=false")
    g.set_defaults(func=cmd_generate)

    b = sub.add_parser("bench", help="run a workload and print latency, throughput, memory, cost and bounds")
    b.add_argument("--model", default=None)
    b.add_argument("--workload", choices=["chat", "mixed", "shared-prefix", "repeat"], default="chat",
                   help="chat: questions from data/prompts.txt, one setting (plus comparisons); mixed: nano-vllm's "
                        "shape (prompt and output lengths uniform in 100-1024, times --scale) on data/corpus.txt, "
                        "static vs continuous and paged vs contiguous side by side; shared-prefix: prefix caching off vs "
                        "on; repeat: answers that repeat the prompt, speculative decoding off vs ngram at batch 1")
    b.add_argument("--num-requests", type=int, default=None,
                   help="default 8 (chat), 256 (mixed) or 10 (shared-prefix: questions after one document)")
    b.add_argument("--prefix-tokens", type=int, default=2000,
                   help="shared-prefix: tokens of data/corpus.txt every question follows (prefix caching off vs on)")
    b.add_argument("--scale", type=float, default=1.0, help="mixed: multiply the 100-1024 lengths (0.125 on a CPU)")
    b.add_argument("--seed", type=int, default=0, help="mixed: the lengths and text windows drawn")
    b.add_argument("--max-tokens", type=int, default=None, help="output tokens per request (default 64; 16 for shared-prefix)")
    b.add_argument("--set", nargs="*", metavar="LEVER=VALUE", help="engine levers, e.g. kv_cache=false max_num_seqs=4")
    b.add_argument("--draft-model", default=None,
                   help="repeat: also speculate with this draft model (same tokenizer), k=4")
    b.add_argument("--self-draft", action="store_true", help="repeat: also speculate with the early-exit self-draft, k=4")
    b.add_argument("--compare-kv-cache", action="store_true", help="also run with the kv_cache lever flipped")
    b.add_argument("--compare-transformers", action="store_true",
                   help="chat: single-request decode tokens/s beside transformers' generate, same prompts; "
                        "mixed: transformers' generate with static padded batches of the same size")
    b.add_argument("--compare-prompts", type=int, default=4)
    b.add_argument("--compare-peers", action="store_true",
                   help="batch-1 decode of minillm fp32/int8/int4 vs transformers, CTranslate2 float32/int8 and "
                        "llama.cpp (with --gguf) on the same prompts (python -m minillm.bench.peers)")
    b.add_argument("--gguf", default=None, metavar="PATH",
                   help="--compare-peers: a GGUF of the same model for llama.cpp ('default': the shipped Q4_1)")
    b.add_argument("--rounds", type=int, default=3, help="--compare-peers: interleaved rounds (median reported)")
    b.add_argument("--json", default=None, help="also write the results to this file")
    b.add_argument("--tensor-parallel", type=int, default=None, metavar="N",
                   help="tensor parallelism: N ranks vs N=1, per step all-reduce bytes and time beside the compute "
                        "(python -m minillm.bench.tensor_parallel)")
    b.set_defaults(func=cmd_bench)

    q = sub.add_parser("quality", help="perplexity, top-1 agreement, memory and decode tok/s of each setting "
                                       "(baseline, bf16, int8, int4) side by side")
    q.add_argument("--model", default=None)
    q.add_argument("--settings", nargs="+", metavar="SETTING",
                   help="the first is the reference; names (baseline bf16 fp16 int8 int4 int4-awq int4-gptq int4-gptq-tuned int4-autoround int4-g64 int4-g32 int4-head4 int4-gptq-head4 int4-gptq-tuned-head4 int4-autoround-head4 fp8 kv-int8 kv-fp8; int4 keeps an int8 head) or "
                        "LEVER=VALUE[,LEVER=VALUE] "
                        "(default: baseline bf16 int8 int4)")
    q.add_argument("--max-windows", type=int, default=None, help="score only the first N corpus windows (quicker)")
    q.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    q.add_argument("--stride", type=int, default=256, help="tokens between window starts")
    q.add_argument("--prompts", type=int, default=24, help="chat prompts for next-token agreement")
    q.add_argument("--decode-tokens", type=int, default=32, help="tokens per batch-1 decode timing (0: skip)")
    q.add_argument("--decode-repeats", type=int, default=3)
    q.add_argument("--generations", type=int, default=3, help="prompts generated side by side")
    q.add_argument("--generation-tokens", type=int, default=24)
    q.add_argument("--set", nargs="*", metavar="LEVER=VALUE", help="levers for every setting, e.g. device=cpu")
    q.add_argument("--no-progress", action="store_true")
    q.add_argument("--json", default=None, help="also write the results to this file")
    q.set_defaults(func=cmd_quality)

    mem = sub.add_parser("memory", help="weight bytes, KV bytes per token and sequences that fit in a budget, "
                                         "for every weight and KV setting (from the model's shape; no weights loaded)")
    mem.add_argument("--budget-gb", type=float, default=1.0, help="memory for weights + KV cache, in GB (1e9 bytes)")
    mem.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence (prompt + output)")
    mem.add_argument("--models", nargs="+", default=["smollm2-135m", "llama-3-8b"],
                     help="model presets (minillm/models/presets.py)")
    mem.add_argument("--base-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                     help="dtype of what quantized settings leave unquantized (embedding, norms) and of their KV")
    mem.add_argument("--plot", default=None, metavar="PNG", help="also plot to this PNG file (needs matplotlib)")
    mem.set_defaults(func=cmd_memory)

    d = sub.add_parser("doctor", help="check the installation and explain what is wrong")
    d.add_argument("--no-model", action="store_true", help="skip loading the model")
    d.add_argument("--capability", default=None, metavar="CC",
                   help="also say which formats a GPU of this compute capability gets (75: T4, 80, 86, 89, 90: H100)")
    d.set_defaults(func=cmd_doctor)

    m = sub.add_parser("model", help="convert the default model into the cache (once) and print its path")
    m.add_argument("--check", action="store_true", help="verify the cache (sizes and SHA-256)")
    m.add_argument("--rebuild", action="store_true", help="convert again from the GGUF")
    m.set_defaults(func=cmd_model)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError, TypeError, ImportError) as exc:
        print(f"minillm {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

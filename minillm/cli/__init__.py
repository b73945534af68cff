"""The `minillm` command: main(argv) hands each command to its module, one module per group of commands.

generate, bench, quality, memory, doctor (+ model) each live beside this file with their arguments
(add_parser) and their handler; the commands with their own argument parsers (serve, fleet,
bench serve, cost, ...) are delegated to the modules named in DELEGATED.
"""

from __future__ import annotations

import argparse
import sys

from . import bench, distill, doctor, generate, memory, quality
from .set_levers import _parse_levers

__all__ = ["DELEGATED", "_parse_levers", "main"]   # _parse_levers: `from minillm.cli import _parse_levers`
DESCRIPTION = "minillm generate | bench | quality | memory | doctor | model | distill — the command line."


# Commands with their own argument parsers, in their own modules (each exposes main(argv) -> int).
DELEGATED = {
    ("serve",): ("minillm.serve.cli", "an OpenAI-compatible HTTP server on the engine (every lever is a flag)"),
    ("fleet",): ("minillm.fleet.ray_fleet", "replicas behind Ray Serve's router and autoscaler (the same OpenAI "
                                            "routes); --demo-autoscale prints a 1 -> 2 -> 1 timeline"),
    ("bench", "serve"): ("minillm.bench.serve", "load generator against an OpenAI-compatible endpoint "
                                                 "(Poisson arrivals or fixed concurrency; vLLM-style report)"),
    ("bench", "prefill"): ("minillm.bench.prefill", "TTFT and prefill tok/s by prompt length (128 to 8192): minillm "
                                                     "fp32/int8/int4 beside transformers, CTranslate2, llama.cpp"),
    ("bench", "lora"): ("minillm.bench.lora", "one batch mixing N LoRA adapters vs merging each into the weights "
                                               "and serving the groups one after another: tok/s and memory"),
    ("bench", "many-models"): ("minillm.bench.many_models", "multi-LoRA batched vs merge-and-swap, then MoE bytes "
                                                             "read per decode step vs batch size, in one run"),
    ("bench", "fleet"): ("minillm.bench.fleet", "the fleet simulator: a simulated day hour by hour, the warm replicas "
                                                 "a p99 TTFT target needs, --validate against a real Ray Serve fleet"),
    ("distill", "export"): ("minillm.cli.distill", "a Hugging Face Llama directory (a student, or 'default') to GGUF "
                                                    "F16 / Q8_0 / Q4_0 with an Ollama Modelfile beside it"),
    ("distill", "sweep"): ("minillm.cli.distill", "student depth x weight_dtype beside the teacher: score, tok/s, "
                                                   "TTFT, memory, $/Mtok, the Pareto front and the cheapest point "
                                                   "within a margin of the teacher (--draft, --memory, --llama-cpp)"),
    ("distill", "memory"): ("minillm.cli.distill", "weights + KV cache at a context against 4 / 8 / 16 GB devices "
                                                    "and this machine, with the bandwidth bound on tok/s"),
    ("distill", "llama-cpp"): ("minillm.cli.distill", "llama.cpp (llama-cpp-python) beside minillm on a model's "
                                                       "exported GGUF: tok/s and greedy tokens"),
    ("cost",): ("minillm.bench.cost", "$ per million output tokens as the levers stack, measured here, plotted"),
}


ENTRIES = {("distill", "export"): "cmd_export", ("distill", "sweep"): "cmd_sweep", ("distill", "memory"): "cmd_memory",
           ("distill", "llama-cpp"): "cmd_llama_cpp"}   # delegated commands whose entry is not `main`


def _delegate(argv: list[str]) -> int | None:
    import importlib

    for prefix, (module, _) in DELEGATED.items():
        if tuple(argv[:len(prefix)]) == prefix:
            target = importlib.import_module(module)
            entry = getattr(target, ENTRIES.get(prefix, "main"))
            return entry(argv[len(prefix):])
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    delegated = _delegate(argv)
    if delegated is not None:
        return delegated
    parser = argparse.ArgumentParser(prog="minillm", description=DESCRIPTION,
                                     epilog="also: " + "; ".join(f"minillm {' '.join(k)}: {h}"
                                                                 for k, (_, h) in DELEGATED.items()))
    sub = parser.add_subparsers(dest="command", required=True)
    for prefix, (_, help_text) in DELEGATED.items():
        if len(prefix) == 1:
            sub.add_parser(prefix[0], help=help_text, add_help=False)

    generate.add_parser(sub)
    bench.add_parser(sub)
    quality.add_parser(sub)
    memory.add_parser(sub)
    doctor.add_parsers(sub)
    distill.add_parser(sub)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotImplementedError, TypeError, ImportError) as exc:
        print(f"minillm {args.command}: {exc}", file=sys.stderr)
        return 2


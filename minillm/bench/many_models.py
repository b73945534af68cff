"""Many models on one engine, in one run: batched multi-LoRA vs merge-and-swap, then MoE bytes per decode step.

    python -m minillm.bench.many_models                 # = minillm bench many-models
    python -m minillm.bench.many_models --quick         # fewer requests, adapters and batch sizes

Runs minillm.bench.lora (one batch mixing N adapters against merging each into the weights and serving them in
turn: tok/s and their ratio, adapter bytes against N merged copies) and then minillm.bench.moe (experts touched
and bytes read per decode step against batch size on a random-weight Mixtral-shaped CPU model, and modelled for
Mixtral 8x7B on an H100). Each part's own module documents its columns.
"""

from __future__ import annotations

import argparse

from . import lora, moe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench.many_models", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="N = 1, 2, 4 adapters, 8 requests; batches 1, 4, 16")
    args = parser.parse_args(argv)
    print("== multi-LoRA: one batch of N adapters vs merge-and-swap ==")
    lora.main(["--adapters", "1", "2", "4", "--num-requests", "8", "--max-tokens", "16"] if args.quick else [])
    print("\n== mixture of experts: bytes read per decode step vs batch size ==")
    moe.main(["--batches", "1", "4", "16", "--tokens", "8"] if args.quick else [])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

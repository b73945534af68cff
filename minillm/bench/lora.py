"""Batched multi-LoRA vs merge-and-swap: one batch mixing N adapters against N merged copies served in turn.

    python -m minillm.bench.lora                         # N = 1, 2, 4, 8 on the default model
    python -m minillm.bench.lora --adapters 2 4 --num-requests 16 --max-tokens 32
    python -m minillm.bench.lora --triton                # the SGMV kernels (a GPU; the interpreter on a CPU is slow)

The same requests (num_requests prompts, spread round-robin over the N adapters, greedy, ignore_eos) run two ways:

1. batched: one generate() call on an engine with enable_lora=True; every token gets its own adapter's delta
   (x A^T) B^T beside the shared base matmul, so all N groups decode in one batch.
2. merge-and-swap: the way to serve adapters without LoRA support: merge adapter i into the weights
   (W += scale * B A for every targeted module), serve its group alone, restore W, next adapter. The merge and
   restore are timed too (they are what a swap costs); the tokens/s without them is printed beside.

Printed per N: output tokens/s of each and their ratio, the memory N adapters take (their A and B as stored, and the
engine's stacked slots) against the N merged copies of the model that serving them side by side without LoRA needs
(model bytes x N), and the share of requests whose greedy tokens agree (merging rounds differently, so a near-tie
may flip). Adapters: the default model's trained ones (minillm.adapters) when they are already built, then random
ones of rank 8 to 16 on every linear module, written in code as PEFT directories.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from ..lora import LoRARequest

PROMPTS = [
    "Explain why the sky is blue.", "Write a haiku about autumn.", "What is the capital of Japan?",
    "Give three tips for learning to code.", "Summarise the plot of Hamlet in two sentences.",
    "How does a refrigerator work?", "List five fruits that are red.", "What is 17 times 23?",
    "Describe the water cycle.", "Translate 'good night' into Spanish.", "Why do cats purr?",
    "What causes the seasons on Earth?", "Name three famous painters.", "How do vaccines work?",
    "What is a prime number?", "Suggest a name for a bakery.",
]
MIB = 2 ** 20


def random_adapter(path: str, layer_shapes: list[dict[str, tuple[int, int]]], rank: int, seed: int,
                   std: float = 0.02) -> str:
    """A PEFT directory with rank-`rank` A and B on every module of every layer (random, non-zero), alpha = 2 r."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, shapes in enumerate(layer_shapes):
        for module, (out_features, in_features) in shapes.items():
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) / in_features ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * std
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none", "use_rslora": False,
              "target_modules": sorted({m for shapes in layer_shapes for m in shapes})}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def trained_adapters(model_path: str) -> list[str]:
    """The default model's trained adapters (minillm.adapters) that are already built; none are trained here."""
    try:
        from ..adapters import ADAPTERS, adapter_path, is_complete
    except ImportError:
        return []
    paths = []
    for recipe in ADAPTERS.values():
        try:
            path = adapter_path(recipe, model_path)
        except (OSError, ValueError):
            continue
        if is_complete(path):
            paths.append(str(path))
    return paths


def merge(model, adapter, sign: float = 1.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """W += sign * B A (scaling already in B) on every module the adapter targets; returns (weight, original rows)
    to restore the exact weights afterwards."""
    from ..layers.lora import lora_targets

    saved = []
    targets = lora_targets(model)
    for (layer_index, module), (a, b) in adapter.weights.items():
        for attr, (_in, slices) in targets[layer_index].items():
            for name, offset, width in slices:
                if name == module:
                    weight = model.layers[layer_index].get_submodule(attr).weight
                    rows = weight[offset:offset + width]
                    saved.append((rows, rows.clone()))
                    rows += sign * (b.to(rows) @ a.to(rows))
    return saved


def restore(saved) -> None:
    for rows, original in saved:
        rows.copy_(original)


def run(llm, adapters: list[LoRARequest], num_requests: int, max_tokens: int, progress=None) -> dict:
    from ..sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(num_requests)]
    owners = [adapters[i % len(adapters)] for i in range(num_requests)]
    engine = llm.engine
    # batched: every adapter in one batch
    t0 = time.perf_counter()
    batched = llm.generate(prompts, params, lora_request=owners)
    batched_s = time.perf_counter() - t0
    if progress:
        progress.update(1)
    # merge-and-swap: each adapter merged into the weights in turn, its group served alone (no LoRA path)
    plain = llm.with_levers(enable_lora=False)
    swapped: dict[int, list[int]] = {}
    merge_s = serve_s = 0.0
    for adapter in adapters:
        group = [i for i, owner in enumerate(owners) if owner is adapter]
        t0 = time.perf_counter()
        saved = merge(plain.engine.model, engine.lora_registry.get(adapter))
        t1 = time.perf_counter()
        outs = plain.generate([prompts[i] for i in group], params)
        t2 = time.perf_counter()
        restore(saved)
        merge_s += (t1 - t0) + (time.perf_counter() - t2)
        serve_s += t2 - t1
        swapped.update({i: out.outputs[0].token_ids for i, out in zip(group, outs)})
        if progress:
            progress.update(1)
    tokens = num_requests * max_tokens
    agree = sum(out.outputs[0].token_ids == swapped[i] for i, out in enumerate(batched)) / num_requests
    adapter_bytes = sum(engine.lora_registry.get(a).nbytes for a in adapters)
    return {"num_adapters": len(adapters), "num_requests": num_requests, "tokens": tokens,
            "batched_tok_s": tokens / batched_s, "swap_tok_s": tokens / (serve_s + merge_s),
            "swap_serve_only_tok_s": tokens / serve_s, "merge_s": merge_s, "agree": agree,
            "adapter_bytes": adapter_bytes, "slot_bytes": engine.runner.lora.nbytes,
            "merged_copies_bytes": llm.weight_bytes * len(adapters)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench.lora", description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 2, 4, 8], metavar="N",
                        help="numbers of adapters mixed in one batch (default 1 2 4 8)")
    parser.add_argument("--num-requests", type=int, default=16, help="requests per run, round-robin over adapters")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (ignore_eos)")
    parser.add_argument("--model", default=None, help="model (default: the default model)")
    parser.add_argument("--no-trained", action="store_true", help="random adapters only (not minillm.adapters')")
    parser.add_argument("--triton", action="store_true", help="attention_backend='triton' (the SGMV kernels)")
    args = parser.parse_args(argv)
    bad = [n for n in args.adapters if not 1 <= n <= args.num_requests]
    if bad:
        parser.error(f"--adapters {bad}: each N must be in [1, --num-requests={args.num_requests}]")
    from tqdm.auto import tqdm

    from ..layers.lora import layer_shapes
    from ..llm import LLM

    max_n = max(args.adapters)
    llm = LLM(args.model, enable_lora=True, max_loras=max_n, max_lora_rank=16, max_num_seqs=args.num_requests,
              attention_backend="triton" if args.triton else "torch")
    paths = [] if args.no_trained else trained_adapters(str(llm.engine.model_path))[:max_n]
    workdir = tempfile.mkdtemp(prefix="minillm-bench-lora-")
    shapes = layer_shapes(llm.engine.model)
    for i in range(len(paths), max_n):
        paths.append(random_adapter(os.path.join(workdir, f"random{i}"), shapes, rank=8 + (5 * i) % 9, seed=i))
    requests = [LoRARequest(f"adapter{i}", i + 1, path) for i, path in enumerate(paths)]
    for request in requests:
        llm.engine.validate_lora(request)   # read and checked before anything is timed
    num_trained = 0 if args.no_trained else len(trained_adapters(str(llm.engine.model_path))[:max_n])
    print(f"minillm.bench.lora on {llm.device}, {llm.model_config.num_layers}-layer "
          f"model ({llm.weight_bytes / MIB:.0f} MiB), {args.num_requests} requests x {args.max_tokens} tokens, "
          f"adapters: {num_trained} trained + {max_n - num_trained} random (ranks "
          f"{sorted({llm.engine.lora_registry.get(r).rank for r in requests})}), all 7 linear modules")
    # warm-up: the first passes allocate (both paths)
    run(llm, requests[:1], 2, 2)
    rows = []
    with tqdm(total=sum(1 + n for n in args.adapters), desc="lora bench", unit="run") as bar:
        for n in args.adapters:
            rows.append(run(llm, requests[:n], args.num_requests, args.max_tokens, bar))
    print(f"{'N':>3} {'batched tok/s':>14} {'swap tok/s':>11} {'ratio':>6} {'swap w/o merge':>15} {'merge s':>8} "
          f"{'adapters MiB':>13} {'slots MiB':>10} {'N copies MiB':>13} {'mem ratio':>10} {'agree':>6}")
    for r in rows:
        print(f"{r['num_adapters']:>3} {r['batched_tok_s']:>14.1f} {r['swap_tok_s']:>11.1f} "
              f"{r['batched_tok_s'] / r['swap_tok_s']:>5.2f}x {r['swap_serve_only_tok_s']:>15.1f} {r['merge_s']:>8.2f} "
              f"{r['adapter_bytes'] / MIB:>13.1f} {r['slot_bytes'] / MIB:>10.1f} {r['merged_copies_bytes'] / MIB:>13.0f} "
              f"{r['merged_copies_bytes'] / r['adapter_bytes']:>9.0f}x {r['agree']:>6.0%}")
    print("ratio: batched / merge-and-swap tok/s (swap includes merging and restoring the weights); mem ratio: N "
          "merged model copies / N adapters' bytes. slots: the engine's stacked A/B for max_loras adapters at rank 16.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Mixture of experts: experts touched and bytes read per decode step vs batch size, measured and modelled.

    python -m minillm.bench.moe                      # CPU measurement + the Mixtral 8x7B / H100 model
    python -m minillm.bench.moe --batches 1 4 16 --tokens 12
    python -m minillm.bench.moe --model-only         # only the H100 table (no engine run)

1. Measured: a random-weight Mixtral-shaped model scaled to fit a CPU (8 experts, top-2, GQA 4:1, expert
   width 3.5x hidden as in Mixtral) decodes batches of B requests; each decode step's expert counts come
   from the engine's StepStats.expert_tokens. Printed per B: distinct experts each MoE layer read per
   step (measured vs the uniform-routing expectation E * (1 - (1 - k/E)^B)), the bytes that step must
   read (models/moe.py decode_step_bytes with the measured experts), step time, tokens/s and the
   bandwidth achieved (bytes / step time: how close the CPU runs to its memory bound).
2. Modelled: Mixtral 8x7B (46.7B parameters, 12.9B active) in bf16 on an H100 (3.35 TB/s HBM): bytes
   per decode step and the memory-bound tokens/s ceiling (B * bandwidth / bytes) vs B, for the MoE and
   for dense models of its total (46.7B) and of its active (12.9B) size with the same attention and KV.
   At batch 1 the MoE reads about what the 12.9B dense model reads; from batch ~16 on nearly every expert
   is touched and it reads what the 46.7B model reads, so batching buys less per token than for a dense model.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

from ..models.moe import decode_step_bytes, expected_experts_touched
from ..models.presets import PRESETS, register_preset

CPU_PRESET = "bench-mixtral-cpu"
# Mixtral's proportions (GQA 4:1, 8 experts, top-2, expert width 3.5 x hidden) at 1/10 of its width, 4 layers.
CPU_MIXTRAL = dataclasses.replace(PRESETS["mixtral-8x7b"], vocab_size=2048, hidden_size=384, intermediate_size=1344,
                                  moe_intermediate_size=1344, num_layers=4, num_heads=8, num_kv_heads=2, head_dim=48,
                                  max_position_embeddings=4096)
H100_HBM_BYTES_PER_S = 3.35e12
GIB = 2 ** 30


def measure_cpu(batches=(1, 2, 4, 8, 16, 32), prompt_len: int = 16, tokens: int = 16, seed: int = 0) -> list[dict]:
    """Decode batches of each size on the CPU model; one row per batch size (decode steps that ran the full batch)."""
    import torch
    from tqdm import tqdm

    from ..llm import LLM
    from ..sampling import SamplingParams

    register_preset(CPU_PRESET, CPU_MIXTRAL)
    cfg = CPU_MIXTRAL
    llm = LLM(f"random:{CPU_PRESET}", max_num_seqs=max(batches), seed=seed)
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for batch in tqdm(batches, desc="batch sizes", unit="batch"):
        prompts = [{"prompt_token_ids": torch.randint(3, cfg.vocab_size, (prompt_len,), generator=gen).tolist()}
                   for _ in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
        steps = [s for s in llm.engine.stats.steps if s.kind == "decode" and s.num_seqs == batch and s.expert_tokens]
        touched = statistics.mean(sum(s.experts_touched) / len(s.experts_touched) for s in steps)
        step_s = statistics.median(s.duration_s for s in steps)
        context = prompt_len + tokens / 2   # mean cached tokens per sequence over the decode steps
        read = decode_step_bytes(cfg, batch, context, bytes_per_param=4, kv_bytes_per_value=4, experts_touched=touched)
        rows.append({"batch": batch, "experts_touched": touched,
                     "expected": expected_experts_touched(cfg.num_experts, cfg.num_experts_per_tok, batch),
                     "bytes": read["total"], "step_s": step_s, "tokens_per_s": batch / step_s,
                     "bytes_per_s": read["total"] / step_s, "steps": len(steps)})
    return rows


def model_h100(batches=(1, 2, 4, 8, 16, 32, 64, 128, 256), context_len: int = 512, bytes_per_param: float = 2.0,
               bandwidth: float = H100_HBM_BYTES_PER_S) -> list[dict]:
    """Mixtral 8x7B (bf16 weights and KV) vs dense models of its total and active sizes: bytes per decode step
    and the memory-bound tokens/s ceiling per batch size."""
    cfg = PRESETS["mixtral-8x7b"]
    rows = []
    for batch in batches:
        moe = decode_step_bytes(cfg, batch, context_len, bytes_per_param)
        total = decode_step_bytes(cfg, batch, context_len, bytes_per_param, experts_touched=cfg.num_experts)
        active = decode_step_bytes(cfg, batch, context_len, bytes_per_param, experts_touched=cfg.num_experts_per_tok)
        rows.append({"batch": batch, "experts_touched": moe["experts_touched_per_layer"], "moe_bytes": moe["total"],
                     "kv_bytes": moe["kv"], "dense_total_bytes": total["total"], "dense_active_bytes": active["total"],
                     "moe_tok_s": batch * bandwidth / moe["total"],
                     "dense_total_tok_s": batch * bandwidth / total["total"],
                     "dense_active_tok_s": batch * bandwidth / active["total"]})
    return rows


def print_cpu(rows: list[dict]) -> None:
    cfg = CPU_MIXTRAL
    print(f"\nMeasured on this CPU: random-weight Mixtral-shaped model, {cfg.num_params / 1e6:.0f}M parameters "
          f"({cfg.num_active_params / 1e6:.0f}M active), {cfg.num_layers} MoE layers, top-{cfg.num_experts_per_tok} "
          f"of {cfg.num_experts}, fp32")
    print(f"{'batch':>5} {'experts/layer':>13} {'expected':>8} {'MB/step':>8} {'ms/step':>8} {'tok/s':>7} "
          f"{'GB/s':>6} {'steps':>5}")
    for r in rows:
        print(f"{r['batch']:>5} {r['experts_touched']:>13.2f} {r['expected']:>8.2f} {r['bytes'] / 1e6:>8.1f} "
              f"{r['step_s'] * 1e3:>8.1f} {r['tokens_per_s']:>7.1f} {r['bytes_per_s'] / 1e9:>6.2f} {r['steps']:>5}")
    first, last = rows[0], rows[-1]
    print(f"batch {last['batch']} reads {last['bytes'] / first['bytes']:.2f}x the bytes of batch {first['batch']} per "
          f"step for {last['batch'] / first['batch']:.0f}x the tokens; tokens/s {last['tokens_per_s'] / first['tokens_per_s']:.2f}x")


def print_h100(rows: list[dict], context_len: int) -> None:
    cfg = PRESETS["mixtral-8x7b"]
    print(f"\nModelled: Mixtral 8x7B ({cfg.num_params / 1e9:.1f}B parameters, {cfg.num_active_params / 1e9:.1f}B "
          f"active), bf16 weights and KV, {context_len} cached tokens per sequence, H100 HBM "
          f"{H100_HBM_BYTES_PER_S / 1e12:.2f} TB/s: memory-bound decode ceiling")
    print(f"{'batch':>5} {'experts/layer':>13} {'MoE GiB':>8} {'KV GiB':>7} {'MoE tok/s':>10} "
          f"{'dense46.7B tok/s':>16} {'dense12.9B tok/s':>16} {'MoE/dense46.7B':>14} {'MoE/dense12.9B':>14}")
    for r in rows:
        print(f"{r['batch']:>5} {r['experts_touched']:>13.2f} {r['moe_bytes'] / GIB:>8.1f} {r['kv_bytes'] / GIB:>7.2f} "
              f"{r['moe_tok_s']:>10.0f} {r['dense_total_tok_s']:>16.0f} {r['dense_active_tok_s']:>16.0f} "
              f"{r['moe_tok_s'] / r['dense_total_tok_s']:>14.2f} {r['moe_tok_s'] / r['dense_active_tok_s']:>14.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minillm.bench.moe", description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="CPU batch sizes")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated per request on the CPU")
    parser.add_argument("--context", type=int, default=512, help="cached tokens per sequence in the H100 model")
    parser.add_argument("--model-only", action="store_true", help="print the H100 model only (no engine run)")
    args = parser.parse_args(argv)
    if min(args.batches) < 1 or args.tokens < 2 or args.context < 0:
        parser.error(f"--batches must be >= 1, --tokens >= 2, --context >= 0 (got {args.batches}, {args.tokens}, "
                     f"{args.context})")
    if not args.model_only:
        print_cpu(measure_cpu(tuple(args.batches), tokens=args.tokens))
    print_h100(model_h100(context_len=args.context), args.context)


if __name__ == "__main__":
    main()

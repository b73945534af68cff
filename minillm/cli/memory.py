"""`minillm memory`: weight bytes, KV bytes per token and the sequences that fit a budget, from the model's shape."""

from __future__ import annotations


def cmd_memory(args) -> int:
    from ..bench.memory import memory_table, format_memory, plot_memory
    from ..models.presets import preset_config

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


def add_parser(sub) -> None:
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

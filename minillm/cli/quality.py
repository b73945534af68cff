"""`minillm quality`: perplexity, top-1 agreement, memory and decode tok/s of each setting side by side."""

from __future__ import annotations

import json

from .set_levers import _parse_levers


def _quality_settings(names: list[str]) -> dict:
    """'int8' (a known name) or 'weight_dtype=int4,kv_cache=false' (levers; the label is the text)."""
    from ..bench.quality import KNOWN_SETTINGS

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
    from ..bench.quality import DEFAULT_SETTINGS, evaluate, format_quality, result_to_json

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


def add_parser(sub) -> None:
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

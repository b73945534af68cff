"""`minillm bench`: run a workload and print latency, throughput, memory, cost and the bandwidth bound."""

from __future__ import annotations

import json

from .set_levers import _parse_levers


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
    from .. import LLM
    from ..bench.compare import compare_with_transformers, format_compare
    from ..bench.runner import run_workload
    from ..bench.workloads import chat_workload

    levers = _parse_levers(args.set)
    if args.compare_peers:   # minillm's formats vs transformers, CTranslate2 (and llama.cpp), batch-1 decode
        from ..bench.peers import run as run_peers

        run_peers(args.model, args.compare_prompts, args.max_tokens or 64, args.rounds, args.gguf, args.json,
                  levers=levers)
        return 0
    if args.tensor_parallel is not None:   # N ranks vs N = 1: all-reduce bytes and time per step
        from ..bench.tensor_parallel import run as run_tensor_parallel

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
    from ..bench.prefix import compare_prefix_caching, format_prefix, shared_prefix_workload

    requests = shared_prefix_workload(llm.tokenizer, prefix_tokens=args.prefix_tokens,
                                      num_questions=args.num_requests or 10, max_tokens=args.max_tokens or 16)
    result = compare_prefix_caching(llm, requests)
    print(format_prefix(result, args.prefix_tokens))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "off": result["off"].__dict__, "on": result["on"].__dict__}, f, indent=1, default=str)
    return 0 if result["identical"] == result["num_requests"] else 1


def _bench_repeat(llm, args) -> int:
    from ..bench.speculative import compare_speculative, format_speculative, repeat_workload

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
    from ..bench.batching import compare_batching, format_batching
    from ..bench.workloads import mixed_workload

    requests = mixed_workload(llm.tokenizer, num_requests=args.num_requests or 256, scale=args.scale, seed=args.seed)
    result = compare_batching(llm, requests, batch_size=llm.config.max_num_seqs,
                              with_transformers=args.compare_transformers)
    print(format_batching(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**result, "rows": [{**r.__dict__, "tok_per_s": r.tok_per_s} for r in result["rows"]]}, f,
                      indent=1, default=str)
    return 0


def add_parser(sub) -> None:
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

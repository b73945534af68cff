"""`minillm generate`: stream an answer to one prompt (the chat template unless --raw)."""

from __future__ import annotations

from .set_levers import _parse_levers


def cmd_generate(args) -> int:
    from .. import LLM, SamplingParams

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


def add_parser(sub) -> None:
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

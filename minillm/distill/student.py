"""The student: the teacher with a chosen subset of its layers (and optionally narrower MLPs), saved as an HF directory.

    select_layers(30, 6)                       [0, 6, 12, 17, 23, 29]: first and last kept, the rest evenly spread
    build_student(teacher_dir, [0, 6, ...])    a transformers LlamaForCausalLM initialised from the teacher's weights
    save_student(model, teacher_dir, out_dir)  config + model.safetensors + the teacher's tokenizer files

The student keeps the teacher's embedding, final norm and head, and copies each kept decoder layer whole.
With `intermediate_size` below the teacher's, each kept MLP keeps the channels whose gate, up and down
weights have the largest norms (the channels that move the residual stream most). Training runs in
transformers' torch model because minillm's engine is inference-only; the saved directory is an ordinary
Hugging Face one that `LLM(path)` and `AutoModelForCausalLM.from_pretrained(path)` both load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", "vocab.json", "merges.txt")
STRATEGIES = ("spread", "first", "last")


def select_layers(num_layers: int, num_keep: int, strategy: str = "spread") -> list[int]:
    """Which of the teacher's `num_layers` layers the student keeps, ascending.

    "spread": the first and the last layer and the rest at even steps between them (the first layer turns
    embeddings into features and the last turns features into the head's input; both are the costliest to lose);
    "first" / "last": a contiguous block from the bottom / top."""
    if not 1 <= num_layers:
        raise ValueError(f"num_layers={num_layers} must be >= 1")
    if not 1 <= num_keep <= num_layers:
        raise ValueError(f"num_keep={num_keep} is outside 1..{num_layers} (the teacher's layers)")
    if strategy == "first":
        return list(range(num_keep))
    if strategy == "last":
        return list(range(num_layers - num_keep, num_layers))
    if strategy != "spread":
        raise ValueError(f"strategy {strategy!r} is not one of {list(STRATEGIES)}")
    if num_keep == 1:
        return [num_layers - 1]
    return [round(i * (num_layers - 1) / (num_keep - 1)) for i in range(num_keep)]


def load_teacher(teacher_dir: str | Path, adapter_path: str | Path | None = None, dtype=torch.float32):
    """The teacher as a transformers model in eval mode (a PEFT adapter, if given, merged into its weights)."""
    from transformers import AutoModelForCausalLM

    teacher_dir = Path(teacher_dir)
    if not (teacher_dir / "config.json").is_file():
        raise FileNotFoundError(f"teacher {str(teacher_dir)!r} is not a Hugging Face directory (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=dtype)
    if adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_path)).merge_and_unload()
    return model.eval()


def _mlp_channels(mlp, keep: int) -> torch.Tensor:
    importance = (mlp.gate_proj.weight.norm(dim=1) * mlp.up_proj.weight.norm(dim=1) * mlp.down_proj.weight.norm(dim=0))
    return importance.topk(keep).indices.sort().values


def build_student(teacher, keep_layers: list[int], intermediate_size: int | None = None):
    """A LlamaForCausalLM with the teacher's layers `keep_layers` (its weights copied), trainable, fp32."""
    from transformers import LlamaForCausalLM

    if not hasattr(teacher, "model") or teacher.config.model_type != "llama":    # transformers' Llama layout only
        raise ValueError(f"the teacher is a {teacher.config.model_type!r} model; distillation builds Llama students")
    num_layers = teacher.config.num_hidden_layers
    if not keep_layers or sorted(set(keep_layers)) != list(keep_layers):
        raise ValueError(f"keep_layers={keep_layers} must be distinct layer indices in ascending order")
    if keep_layers[0] < 0 or keep_layers[-1] >= num_layers:
        raise ValueError(f"keep_layers={keep_layers} has an index outside 0..{num_layers - 1} (the teacher's layers)")
    width = teacher.config.intermediate_size
    if intermediate_size is not None and not 1 <= intermediate_size <= width:
        raise ValueError(f"intermediate_size={intermediate_size} is outside 1..{width} (the teacher's MLP width)")
    config = teacher.config.to_dict()
    config.update(num_hidden_layers=len(keep_layers), intermediate_size=intermediate_size or width)
    config.pop("layer_types", None)
    student = LlamaForCausalLM(type(teacher.config).from_dict(config)).to(torch.float32)
    state = {name: value for name, value in teacher.state_dict().items() if ".layers." not in name}
    for new_index, old_index in enumerate(keep_layers):
        layer = teacher.model.layers[old_index]
        channels = _mlp_channels(layer.mlp, intermediate_size) if intermediate_size else None
        for name, value in layer.state_dict().items():
            if channels is not None and name.startswith(("mlp.gate_proj", "mlp.up_proj")):
                value = value[channels]
            elif channels is not None and name.startswith("mlp.down_proj"):
                value = value[:, channels]
            state[f"model.layers.{new_index}.{name}"] = value
    missing, unexpected = student.load_state_dict({k: v.float().clone() for k, v in state.items()}, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m and m != "lm_head.weight"]:
        raise ValueError(f"the student's weights do not match the teacher's: missing {missing}, unexpected {unexpected}")
    student.tie_weights()
    return student


def save_student(student, teacher_dir: str | Path, out_dir: str | Path, manifest: dict | None = None) -> Path:
    """Write an HF directory: config.json, model.safetensors, the teacher's tokenizer files, minillm-distill.json."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        source = Path(teacher_dir) / name
        if source.is_file():
            shutil.copyfile(source, out_dir / name)
    if manifest is not None:
        (out_dir / "minillm-distill.json").write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    return out_dir

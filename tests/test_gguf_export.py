"""GGUF export: each format read back by transformers' GGUF loader (an independent reader that dequantizes) gives
the logits of the source model with that format's rounding applied, and stays within a measured distance of the
source's own logits; the tokenizer survives the trip; an Ollama Modelfile sits beside the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from minillm.distill.export_gguf import FILE_TYPES, export_gguf

# ||logits(GGUF) - logits(source)|| / ||logits(source)|| on the default model cut to layers [0, 29], measured on a
# 2-core CPU: f16 2.5e-4, q8_0 6.6e-3, q4_0 0.109 (top-1 agreement 100%, 92%, 69% over one 13-token prompt).
# Bounds at about twice that: a wrong permutation or tensor name gives errors of order 1.
SOURCE_BOUND = {"f16": 1e-3, "q8_0": 2e-2, "q4_0": 0.25}
# The same distance to the source with the format's rounding applied in torch (gguf.quants round trip): only
# float32 summation order separates them.
ROUNDED_BOUND = 1e-4
PROMPT = "The capital of France is Paris, and the capital of Germany is"


def _tiny_llama(path: Path) -> Path:
    """A 2-layer Llama with random seeded weights and a 512-token byte-level BPE trained here on the task's messages
    (transformers' GGUF loader reads a 49k vocabulary for a minute; this one in a second)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    from minillm.distill.tasks import make_examples

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator([e.message for e in make_examples("extract", "train", 300)] + [PROMPT], trainer)
    path.mkdir(parents=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "add_bos_token": False}))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         initializer_range=0.1)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def source_dir(tmp_path_factory):
    return _tiny_llama(tmp_path_factory.mktemp("source") / "tiny-2layer")


@pytest.fixture(scope="module")
def real_source_dir(tmp_path_factory, default_model_dir):
    from minillm.distill.student import build_student, load_teacher, save_student

    return save_student(build_student(load_teacher(default_model_dir), [0, 29]), default_model_dir,
                        tmp_path_factory.mktemp("source") / "smol-2layer")


def _rounded_copy(model, file_type: str):
    """The model with every tensor the export quantizes rounded through gguf.quants the same way."""
    import gguf

    from minillm.distill.export_gguf import quantize

    rounded = type(model)(model.config)
    state = {}
    for name, weight in model.state_dict().items():
        data, qtype = quantize(weight, file_type)
        if qtype == gguf.GGMLQuantizationType.F32:
            state[name] = weight.clone()
        elif qtype == gguf.GGMLQuantizationType.F16:
            state[name] = torch.from_numpy(data.astype("float32"))
        else:
            state[name] = torch.from_numpy(gguf.quants.dequantize(data, qtype)).reshape(weight.shape)
    rounded.load_state_dict(state)
    return rounded.eval()


def _round_trip(source_dir, out_dir, file_type: str, rounded: bool = True) -> dict:
    """Export, load back with transformers' GGUF loader, and measure against the source (and its rounded copy)."""
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = export_gguf(source_dir, out_dir, file_type)
    source = AutoModelForCausalLM.from_pretrained(source_dir, dtype=torch.float32).eval()
    loaded = AutoModelForCausalLM.from_pretrained(out_dir, gguf_file=path.name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(source_dir)
    text = "Hello <|im_start|>user\nnaïve café, order K77120 {\"a\": 1}"
    ids = tokenizer([PROMPT], return_tensors="pt").input_ids
    with torch.no_grad():
        want, got = source(ids).logits, loaded(ids).logits
        to_rounded = None
        if rounded:
            reference = _rounded_copy(source, file_type)(ids).logits
            to_rounded = float((got - reference).norm() / reference.norm())
    data_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    return {"path": path, "to_rounded": to_rounded, "to_source": float((got - want).norm() / want.norm()),
            "agreement": float((got.argmax(-1) == want.argmax(-1)).float().mean()),
            "tokens_match": AutoTokenizer.from_pretrained(out_dir, gguf_file=path.name).encode(text) == tokenizer.encode(text),
            "bytes_per_weight": data_bytes / sum(p.numel() for p in source.parameters())}


@pytest.mark.parametrize("file_type", list(FILE_TYPES))
def test_gguf_round_trip_through_transformers_matches_within_the_formats_rounding(source_dir, tmp_path, file_type):
    result = _round_trip(source_dir, tmp_path, file_type)
    assert result["path"].name == f"tiny-2layer.{FILE_TYPES[file_type][0]}.gguf"
    assert result["tokens_match"]
    assert result["to_rounded"] < ROUNDED_BOUND, f"{file_type}: {result}"
    # F16 is 2 bytes a weight; Q8_0 34 bytes per block of 32, Q4_0 18 (the norms' float32 are a rounding error)
    assert result["bytes_per_weight"] == pytest.approx({"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}[file_type],
                                                       rel=0.01)


@pytest.mark.slow
@pytest.mark.parametrize("file_type", list(FILE_TYPES))
def test_gguf_round_trip_of_real_weights_stays_near_the_source(real_source_dir, tmp_path, file_type):
    result = _round_trip(real_source_dir, tmp_path, file_type, rounded=False)
    assert result["tokens_match"]
    assert result["to_source"] < SOURCE_BOUND[file_type], f"{file_type}: {result}"


def test_modelfile_beside_the_gguf(source_dir, tmp_path):
    path = export_gguf(source_dir, tmp_path / "chat", "q8_0")
    modelfile = (path.parent / "Modelfile").read_text()
    assert modelfile.startswith(f"FROM ./{path.name}\n")
    assert "<|im_start|>assistant" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile
    # a distilled student: its task's short prompt around the message, stopping at the newline
    student = tmp_path / "student"
    shutil.copytree(source_dir, student)
    (student / "minillm-distill.json").write_text(json.dumps({"recipe": {"task": "intent"}}))
    student_file = (export_gguf(student, tmp_path / "student-out", "q4_0").parent / "Modelfile").read_text()
    assert "Message: {{ .Prompt }}\nJSON:" in student_file and 'PARAMETER stop "\\n"' in student_file
    assert "intent" in student_file.splitlines()[2]


def test_export_refuses_bad_input(source_dir, tmp_path):
    with pytest.raises(ValueError, match=r"file_type 'q5_k' is not one of \['f16', 'q8_0', 'q4_0'\]"):
        export_gguf(source_dir, tmp_path, "q5_k")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        export_gguf(tmp_path, tmp_path / "out", "f16")

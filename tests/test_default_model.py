"""The default model: its cache (detection of half-written or corrupt conversions, rebuild)
and the engine's public API end to end on it (stream, chat, stop, metrics, stats)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_engine_idle

from minillm import SamplingParams
from minillm.models import default as dm

WEIGHTS = "model.safetensors"


# ------------------------------------------------------------------ the cache

@pytest.fixture
def cache_copy(tmp_path, monkeypatch, default_model_dir):
    """MINILLM_CACHE -> a tmp dir holding the converted model: small files copied, the big
    weight file symlinked (tests that damage it replace the link with a new file first;
    nothing here ever writes through the link)."""
    src = Path(default_model_dir)
    dst = tmp_path / "models" / dm.DEFAULT_MODEL_NAME
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == WEIGHTS:
            (dst / WEIGHTS).symlink_to(f.resolve())
        else:
            shutil.copy(f, dst / f.name)
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path))
    assert dm.default_model_dir() == dst
    return dst


def _replace_link_with_file(path: Path, data_source: Path, nbytes: int) -> None:
    assert path.is_symlink()
    path.unlink()                     # the real cache file is untouched
    with open(data_source, "rb") as src, open(path, "wb") as out:
        left = nbytes
        while left:
            chunk = src.read(min(left, 1 << 24))
            assert chunk
            out.write(chunk)
            left -= len(chunk)


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "a"))
    assert dm.cache_root() == tmp_path / "a"
    monkeypatch.delenv("MINILLM_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert dm.cache_root() == tmp_path / "xdg" / "minillm"
    assert dm.default_model_dir() == tmp_path / "xdg" / "minillm" / "models" / "SmolLM2-135M-Instruct"


def test_the_real_cache_is_complete(default_model_dir):
    path = Path(default_model_dir)
    assert dm.check_model_dir(path) is None
    manifest = json.loads((path / dm.MANIFEST).read_text())
    assert manifest["conversion_version"] == dm.CONVERSION_VERSION
    assert {WEIGHTS, "config.json", "tokenizer.json"} <= set(manifest["files"])
    assert dm.gguf_path().is_file()


def test_intact_copy_passes_and_is_used_without_rebuilding(cache_copy, capfd):
    assert dm.check_model_dir(cache_copy, deep=True) is None
    assert dm.default_model_path(progress=False) == str(cache_copy)
    assert "rebuilding" not in capfd.readouterr().err


def test_missing_directory_and_manifest(cache_copy, tmp_path):
    assert "does not exist" in dm.check_model_dir(tmp_path / "nowhere")
    (cache_copy / dm.MANIFEST).unlink()
    msg = dm.check_model_dir(cache_copy)
    assert msg is not None and dm.MANIFEST in msg and "did not finish" in msg


def test_unreadable_or_outdated_manifest(cache_copy):
    manifest = cache_copy / dm.MANIFEST
    good = json.loads(manifest.read_text())
    manifest.write_text("{not json")
    assert "unreadable" in dm.check_model_dir(cache_copy)
    manifest.write_text(json.dumps({**good, "conversion_version": 0}))
    assert "older conversion" in dm.check_model_dir(cache_copy)
    manifest.write_text(json.dumps({**good, "files": {}}))
    assert "lists no files" in dm.check_model_dir(cache_copy)


def test_missing_file_is_detected(cache_copy):
    (cache_copy / "tokenizer.json").unlink()
    msg = dm.check_model_dir(cache_copy)
    assert msg is not None and "tokenizer.json is missing" in msg


def test_truncated_weights_are_detected(cache_copy, default_model_dir):
    weights = cache_copy / WEIGHTS
    full = weights.stat().st_size
    _replace_link_with_file(weights, Path(default_model_dir) / WEIGHTS, 1 << 20)   # first MiB only
    msg = dm.check_model_dir(cache_copy)
    assert msg is not None and f"has {1 << 20} bytes, expected {full}" in msg
    assert dm.check_model_dir(Path(default_model_dir)) is None   # the real cache is untouched


def test_same_size_corruption_needs_the_deep_check(cache_copy, default_model_dir):
    weights = cache_copy / WEIGHTS
    full = weights.stat().st_size
    _replace_link_with_file(weights, Path(default_model_dir) / WEIGHTS, full)   # a real copy
    with open(weights, "r+b") as f:       # flip bytes in the middle of the copy
        f.seek(full // 2)
        byte = f.read(16)
        f.seek(full // 2)
        f.write(bytes(b ^ 0xFF for b in byte))
    assert weights.stat().st_size == full
    assert dm.check_model_dir(cache_copy) is None            # sizes still match
    msg = dm.check_model_dir(cache_copy, deep=True)
    assert msg is not None and "SHA-256" in msg and "corrupt" in msg
    assert dm.check_model_dir(Path(default_model_dir), deep=True) is None


@pytest.mark.slow
def test_default_model_path_rebuilds_a_corrupt_cache(cache_copy, capfd):
    weights = cache_copy / WEIGHTS
    weights.unlink()
    weights.write_bytes(b"\0" * 100)      # truncated
    path = dm.default_model_path(progress=False)
    assert path == str(cache_copy)
    err = capfd.readouterr().err
    assert "unusable" in err and "rebuilding" in err and "bytes, expected" in err
    assert not weights.is_symlink()
    assert dm.check_model_dir(cache_copy, deep=True) is None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers == 30


def test_transformers_loads_the_default_model(hf_default, default_model_dir):
    from transformers import AutoTokenizer

    assert hf_default.config.model_type == "llama"
    assert (hf_default.config.num_hidden_layers, hf_default.config.num_key_value_heads) == (30, 3)
    assert hf_default.config.vocab_size == 49152
    assert sum(p.numel() for p in hf_default.parameters()) == 134_515_008
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"


def test_engine_sizes_agree_with_transformers(default_llm, hf_default):
    mc = default_llm.model_config
    assert mc.num_params == sum(p.numel() for p in hf_default.parameters())
    assert default_llm.weight_bytes == 4 * mc.num_params
    assert mc.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4 == default_llm.engine.kv_bytes_per_token


# ------------------------------------------------------------------ the public API end to end

def test_chat_answers_paris(default_llm):
    out = default_llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(max_tokens=40))[0]
    text = out.outputs[0].text
    assert "Paris" in text, text
    assert out.outputs[0].finish_reason == "stop"                  # ended with EOS
    assert out.outputs[0].token_ids[-1] in default_llm.engine.eos_token_ids
    assert "<|im_end|>" not in text and "<|im_start|>" not in out.outputs[0].text
    assert out.prompt.startswith("<|im_start|>") and out.prompt.endswith("<|im_start|>assistant\n")
    assert_engine_idle(default_llm)


@pytest.mark.parametrize("prompt", ["Once upon a time", "東京は日本の首都で、"])
def test_stream_pieces_join_to_the_generate_text(default_llm, prompt):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    pieces = list(default_llm.stream(prompt, params))
    text = default_llm.generate(prompt, params)[0].outputs[0].text
    assert len(pieces) > 3
    assert all(p and "\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text
    assert_engine_idle(default_llm)


def test_stop_strings_and_stop_tokens(default_llm):
    prompt = "The three primary colours are"
    full = default_llm.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0].outputs[0]
    assert len(full.token_ids) == 24 and full.finish_reason == "length"
    stop = full.text[8:11]
    assert stop.strip(), full.text
    out = default_llm.generate(prompt, SamplingParams(max_tokens=24, stop=[stop, "@@never@@"], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    assert stop not in out.text
    assert out.token_ids == full.token_ids[: len(out.token_ids)] and len(out.token_ids) < 24
    # a stop token id ends the output right after it (the token is kept, like EOS)
    stop_id = full.token_ids[5]
    first = full.token_ids.index(stop_id)
    out = default_llm.generate(prompt, SamplingParams(max_tokens=24, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]
    assert_engine_idle(default_llm)


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_gives_length(default_llm, max_tokens):
    out = default_llm.generate("Count: 1, 2, 3,", SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == max_tokens
    assert out.outputs[0].finish_reason == "length"
    assert out.finished and out.metrics.num_output_tokens == max_tokens


def test_metrics_are_positive_and_consistent(default_llm):
    prompts = ["Hello, my name is", "The weather today", "List three fruits:"]
    outs = default_llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    stats = default_llm.stats
    for o in outs:
        m = o.metrics
        assert m.num_prompt_tokens == len(o.prompt_token_ids) > 0
        assert m.num_output_tokens == len(o.outputs[0].token_ids) == 6
        assert 0 <= m.queue_s <= m.ttft_s <= m.e2e_s <= stats.wall_s
        assert m.ttft_s > 0 and m.tpot_s > 0
        assert len(m.itl_s) == 5 and all(x > 0 for x in m.itl_s)
        assert m.tpot_s == pytest.approx(sum(m.itl_s) / 5)
        assert m.ttft_s + sum(m.itl_s) <= m.e2e_s + 1e-9
    assert stats.num_output_tokens == 18
    assert stats.num_prompt_tokens == sum(len(o.prompt_token_ids) for o in outs)
    assert stats.output_tokens_per_s == pytest.approx(18 / stats.wall_s)
    assert stats.cost_per_million_tokens_usd == pytest.approx(stats.hourly_usd / 3600 * stats.wall_s / 18 * 1e6)
    assert stats.prefill_s > 0 and stats.decode_s > 0
    assert stats.prefill_s + stats.decode_s <= stats.wall_s
    summary = stats.summary()
    assert summary["output_tokens"] == 18 and summary["steps"] == len(stats.steps) == 6
    assert summary["device"] == default_llm.device


def test_peak_kv_bytes_of_a_single_request(default_llm):
    n_new = 5
    out = default_llm.generate({"prompt_token_ids": list(range(200, 240))},
                               SamplingParams(max_tokens=n_new, ignore_eos=True))[0]
    stats = default_llm.stats
    per_token = default_llm.model_config.kv_bytes_per_token(4)
    n = len(out.prompt_token_ids)
    # the fullest step is the last: prompt + every output token but the last is cached
    assert stats.peak_kv_bytes == per_token * (n + n_new - 1)
    assert [s.kind for s in stats.steps] == ["prefill"] + ["decode"] * (n_new - 1)
    assert [s.num_tokens for s in stats.steps] == [n] + [1] * (n_new - 1)
    assert [s.kv_bytes_used for s in stats.steps] == [per_token * (n + i) for i in range(n_new)]
    bm = default_llm.engine.block_manager
    reserved_blocks = bm.blocks_for(n + n_new)
    assert stats.peak_kv_reserved_bytes == per_token * bm.block_size * reserved_blocks
    assert_engine_idle(default_llm)

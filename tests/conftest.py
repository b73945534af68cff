"""Shared fixtures for the engine tests.

Loading the default model costs a few seconds and ~540 MB each time, so the engine
instances every test file needs are session-scoped and shared. Tests that change an
engine's settings restore them (monkeypatch) and leave no request behind.
"""

from __future__ import annotations

import os

import pytest
import torch


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    """The converted default model (converts once into MINILLM_CACHE / ~/.cache/minillm)."""
    from minillm import default_model_path

    return default_model_path(progress=False)


@pytest.fixture(scope="session")
def default_llm(default_model_dir):
    """LLM() on the default model, kv_cache on (the baseline engine)."""
    from minillm import LLM

    return LLM()


@pytest.fixture(scope="session")
def hf_default(default_model_dir):
    """The reference: transformers' own Llama on the same directory, fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    model.eval()
    return model


def assert_engine_idle(llm) -> None:
    """Nothing queued or running, and every KV block back in the pool."""
    engine = llm.engine
    assert not engine.has_unfinished(), (list(engine.scheduler.waiting), list(engine.scheduler.running))
    bm = engine.block_manager
    if bm is not None:
        assert bm.num_free_blocks == bm.num_blocks, f"{bm.num_blocks - bm.num_free_blocks} KV blocks leaked"
        assert bm.num_reserved_tokens == 0
        assert all(bm.is_free) and not any(bm.ref_count)
        bm.check()


@pytest.fixture
def idle_check():
    """Use as `idle_check(llm)` inside a test; also re-checked at teardown."""
    engines = []

    def check(llm):
        engines.append(llm)
        assert_engine_idle(llm)

    yield check
    for llm in engines:
        assert_engine_idle(llm)


def tokenizer_files(model_dir: str) -> list[str]:
    """Tokenizer files of a model directory (to give tiny test models a tokenizer)."""
    names = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
    return [os.path.join(model_dir, n) for n in names if os.path.isfile(os.path.join(model_dir, n))]

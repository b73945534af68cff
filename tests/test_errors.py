"""Bad input raises an error that names the value and the allowed range, and the engine
keeps serving afterwards with every KV block back in the pool."""

from __future__ import annotations

import re

import pytest
import torch

from conftest import assert_engine_idle

from minillm import LLM, EngineConfig, SamplingParams

GOOD = SamplingParams(max_tokens=3, ignore_eos=True)


@pytest.fixture
def llm(default_llm):
    """The shared engine; after every test it must still answer and hold no blocks."""
    assert_engine_idle(default_llm)
    yield default_llm
    assert_engine_idle(default_llm)
    out = default_llm.generate("Hello", GOOD)[0]
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
    assert_engine_idle(default_llm)


@pytest.fixture(scope="module")
def short_llm(default_model_dir):
    """The default model with a 64-token context."""
    return LLM(max_model_len=64)


# ---------------------------------------------------------------- prompts

def test_empty_string_prompt(llm):
    with pytest.raises(ValueError, match=r"prompt is empty \(''\)"):
        llm.generate("", GOOD)


def test_empty_token_list(llm):
    with pytest.raises(ValueError, match=r"empty \(0 tokens\).*at least 1 token"):
        llm.generate({"prompt_token_ids": []}, GOOD)


def test_token_ids_outside_the_vocabulary(llm):
    vocab = llm.model_config.vocab_size
    for bad in ([-1], [5, vocab], [vocab + 100]):
        with pytest.raises(ValueError, match=rf"\[0, {vocab - 1}\]") as info:
            llm.generate({"prompt_token_ids": bad}, GOOD)
        assert str([t for t in bad if not 0 <= t < vocab][0]) in str(info.value)


def test_prompt_of_the_wrong_type(llm):
    with pytest.raises(TypeError, match="int"):
        llm.generate([12345], GOOD)
    with pytest.raises(TypeError, match="list of ints"):
        llm.generate({"prompt_token_ids": "1 2 3"}, GOOD)


def test_one_bad_prompt_refuses_the_whole_batch(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["fine", "also fine", ""], GOOD)
    assert not llm.engine.has_unfinished()   # nothing of the batch was queued


def test_prompt_longer_than_the_context(short_llm, idle_check):
    assert short_llm.engine.max_model_len == 64
    for n in (64, 65, 300):
        with pytest.raises(ValueError, match=rf"prompt has {n} tokens.*max_model_len\) is 64.*at most 63 tokens"):
            short_llm.generate({"prompt_token_ids": [100] * n}, GOOD)
    idle_check(short_llm)
    # a long text prompt is refused the same way
    with pytest.raises(ValueError, match="max_model_len"):
        short_llm.generate("word " * 200, GOOD)
    # 63 tokens fit, and generation stops at the context with finish_reason 'length'
    out = short_llm.generate({"prompt_token_ids": [100] * 63}, SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.outputs[0].token_ids and len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"
    out = short_llm.generate({"prompt_token_ids": [100] * 60}, SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"
    idle_check(short_llm)


def test_max_model_len_beyond_the_model(default_model_dir):
    with pytest.raises(ValueError, match=r"max_model_len=100000 exceeds the model's context of 8192"):
        LLM(max_model_len=100_000)


def test_request_bigger_than_the_kv_pool(default_model_dir, idle_check):
    per_token = 2 * 30 * 3 * 64 * 4
    llm = LLM(max_model_len=256, kv_cache_bytes=per_token * 32)   # two blocks of 16 tokens
    assert llm.engine.block_manager.num_blocks == 2
    with pytest.raises(ValueError, match=r"prompt \(20 tokens\) \+ max_tokens \(20\) needs 40 KV slots; the pool holds 32"):
        llm.generate({"prompt_token_ids": [100] * 20}, SamplingParams(max_tokens=20))
    out = llm.generate({"prompt_token_ids": [100] * 20}, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 12
    # two requests that each fit but not together: paged starts both, then preempts one when
    # the pool runs dry; contiguous (max_model_len reserved per request) runs one after the other
    two = [{"prompt_token_ids": [100] * 10}] * 2
    outs = llm.generate(two, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert llm.stats.peak_running == 2 and llm.stats.num_preemptions >= 1
    idle_check(llm)
    contiguous = llm.with_levers(paged=False, max_model_len=32)
    outs = contiguous.generate(two, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 12]
    assert contiguous.stats.peak_running == 1 and contiguous.stats.num_preemptions == 0
    idle_check(contiguous)
    with pytest.raises(ValueError, match=rf"paged=False reserves max_model_len=256 tokens per request, but the KV "
                                         rf"pool of {per_token * 32} bytes holds 32 tokens"):
        llm.with_levers(paged=False)


# ---------------------------------------------------------------- sampling parameters

@pytest.mark.parametrize("kwargs,pattern", [
    ({"max_tokens": 0}, r"max_tokens=0 must be an integer >= 1"),
    ({"max_tokens": -3}, r"max_tokens=-3 must be an integer >= 1"),
    ({"max_tokens": 2.5}, r"max_tokens=2.5 must be an integer >= 1"),
    ({"temperature": -0.1}, r"temperature=-0.1 must be >= 0"),
    ({"temperature": float("nan")}, r"temperature=nan must be >= 0"),
    ({"top_p": 0}, r"top_p=0 must be in \(0, 1\]"),
    ({"top_p": 1.5}, r"top_p=1.5 must be in \(0, 1\]"),
    ({"top_p": -0.1}, r"top_p=-0.1 must be in \(0, 1\]"),
    ({"top_k": -2}, r"top_k=-2 must be -1 \(off\), 0 \(off\) or an integer >= 1"),
    ({"top_k": 2.0}, r"top_k=2.0 must be"),
    ({"seed": -1}, r"seed=-1 must be None or an integer >= 0"),
    ({"stop": [""]}, r"every stop string must be a non-empty str"),
    ({"stop_token_ids": [-4]}, r"stop_token_ids=\[-4\].*integers >= 0"),
])
def test_bad_sampling_params(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**kwargs)


def test_sampling_params_mutated_after_construction_are_checked_again(llm):
    p = SamplingParams(max_tokens=4)
    p.top_p = 1.5
    with pytest.raises(ValueError, match=r"top_p=1.5 must be in \(0, 1\]"):
        llm.generate("Hello", p)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate("Hello", {"max_tokens": 3})


def test_wrong_number_of_sampling_params(llm):
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.generate(["a", "b"], [GOOD])


# ---------------------------------------------------------------- engine options

def test_unknown_engine_option():
    with pytest.raises(TypeError, match=r"unknown engine option\(s\) \['kv_cahce'\].*kv_cache"):
        LLM(kv_cahce=False)


@pytest.mark.parametrize("kwargs,pattern", [
    ({"dtype": "float8"}, r"dtype='float8' is not one of"),
    ({"batching": "dynamic"}, r"batching='dynamic' is not one of \('continuous', 'static'\)"),
    ({"max_num_seqs": 0}, r"max_num_seqs=0 must be an integer in \[1, 4096\]"),
    ({"max_num_batched_tokens": 0}, r"max_num_batched_tokens=0 must be an integer >= 1"),
    ({"block_size": 0}, r"block_size=0 must be an integer in \[1, 1024\]"),
    ({"max_model_len": 0}, r"max_model_len=0 must be None or an integer >= 1"),
    ({"kv_cache_bytes": -1}, r"kv_cache_bytes=-1 must be None or a positive integer"),
    ({"kv_cache": "yes"}, r"kv_cache='yes' must be True or False"),
    ({"gpu_hourly_usd": -1.0}, r"gpu_hourly_usd=-1.0 must be >= 0"),
    ({"attention_backend": "cuda"}, r"attention_backend='cuda' is not one of"),
    ({"attention_backend": object()}, r"store_kv\(\) and attend\(\)"),
    ({"kv_cache_memory_fraction": 1.5}, r"kv_cache_memory_fraction=1.5 must be None or in \(0, 0.95\]"),
    ({"kv_cache_memory_fraction": 0.5, "kv_cache_bytes": 1 << 20}, r"give the KV pool size once"),
])
def test_bad_engine_options(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        LLM(**kwargs)   # refused before any model is loaded


# Every lever is built; the draft proposer's options are checked like the others.
@pytest.mark.parametrize("kwargs, pattern", [
    ({"speculative": "draft"}, r"speculative='draft' needs draft_model="),
    ({"draft_model": "random:tiny-llama"}, r"draft_model='random:tiny-llama' is only used with speculative='draft'"),
    ({"speculative": "draft", "draft_model": 3}, r"draft_model=3 must be None or a model path"),
])
def test_bad_draft_options(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        EngineConfig(**kwargs)
    with pytest.raises(ValueError, match=pattern):
        LLM(**kwargs)


def test_unknown_model_path(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=re.escape(f"model={str(missing)!r}: no such directory")):
        LLM(str(missing))
    with pytest.raises(FileNotFoundError, match="without config.json"):
        LLM(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2}')
    with pytest.raises(ValueError, match=r"model_type='gpt2' is not supported.*llama"):
        LLM(str(tmp_path))


# ---------------------------------------------------------------- failures during a run

class BrokenBackend:
    """An attention backend that fails on its nth call (as a learner's half-written one might)."""

    layout = "sequence"

    def __init__(self, fail_at: int):
        from minillm.layers.attention import TorchAttentionBackend

        self.ref, self.calls, self.fail_at = TorchAttentionBackend(), 0, fail_at

    def store_kv(self, *args):
        return self.ref.store_kv(*args)

    def attend(self, *args):
        self.calls += 1
        if self.calls >= self.fail_at:
            raise RuntimeError("attend() is not finished")
        return self.ref.attend(*args)


def test_failure_mid_generate_frees_everything(llm):
    expected = llm.generate(["Hello", "The sky is"], GOOD)
    llm.set_attention_backend(BrokenBackend(fail_at=200))   # fails in a decode step
    try:
        with pytest.raises(RuntimeError, match="attend\\(\\) is not finished"):
            llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=10))
        assert_engine_idle(llm)
    finally:
        llm.set_attention_backend("torch")
    again = llm.generate(["Hello", "The sky is"], GOOD)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]


def test_stream_closed_early_frees_its_blocks(llm):
    stream = llm.stream("Tell me a long story about a dragon.", SamplingParams(max_tokens=40, ignore_eos=True))
    first = next(stream)
    assert isinstance(first, str) and first
    assert llm.engine.block_manager.num_free_blocks < llm.engine.block_manager.num_blocks
    stream.close()
    assert_engine_idle(llm)

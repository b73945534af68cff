"""cuda_graphs=True: decode steps run on padded static buffers, one bucket per batch size.

Capture needs a GPU; the padded static-buffer path does not. Here it runs eagerly
(`enable_cuda_graphs(capture=False)`) with the Triton kernels in the interpreter, on a
tiny random GQA Llama (`random:tiny-llama`), and must give the plain path's tokens for
batches that need padding (3 -> bucket 4, 5 -> bucket 8). Random-weight presets are
tested here too, since these tests build on them.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():  # choose the interpreter before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import assert_engine_idle  # noqa: E402

from minillm import LLM, EngineConfig, SamplingParams  # noqa: E402
from minillm.engine.cuda_graph import DecodeGraphs, batch_buckets  # noqa: E402
from minillm.engine.sequence import Sequence  # noqa: E402
from minillm.models.presets import PRESETS, hf_config_dict, preset_config  # noqa: E402

TINY = "random:tiny-llama"
MAX_LEN = 256


def prompts_and_params(lengths, max_tokens, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=gen).tolist()} for n in lengths]
    return prompts, [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]


@pytest.fixture(scope="module")
def plain():
    return LLM(TINY, attention_backend="triton", max_num_seqs=8, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def padded(plain):
    llm = plain.with_levers()  # same weights, own KV pool
    llm.engine.runner.enable_cuda_graphs(8, MAX_LEN, capture=False)
    for k, v in zip(llm.engine.kv_cache.k, llm.engine.kv_cache.v):
        k.fill_(float("nan"))  # a padded row that leaked into a real one, or a read of an
        v.fill_(float("nan"))  # unwritten slot, would turn that row's logits into NaN
    return llm


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(16) == [1, 2, 4, 8, 16]
    assert batch_buckets(48) == [1, 2, 4, 8, 16, 32, 48]
    assert batch_buckets(256)[-1] == 256


@pytest.mark.parametrize("lengths,max_tokens", [
    ((15, 6, 1), (3, 2, 4)),                   # 3 sequences: bucket 4, then 2 and 1 as they finish; 15 -> block 2
    ((1, 16, 3, 32, 5), (3, 2, 3, 2, 3)),      # 5 sequences: bucket 8, then 3 in bucket 4; 16 and 32 start a block
])
def test_padded_decode_matches_plain_path(plain, padded, lengths, max_tokens):
    prompts, params = prompts_and_params(lengths, max_tokens, seed=len(lengths))
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    graphs = padded.engine.runner.graphs
    before = graphs.num_steps
    got = [o.outputs[0].token_ids for o in padded.generate(prompts, params)]
    assert got == want
    decode_steps = sum(s.kind == "decode" for s in padded.stats.steps)
    assert decode_steps > 0 and graphs.num_steps - before == decode_steps  # every decode step was padded
    kinds = {s.kind for s in padded.stats.steps}   # prompts ran eagerly: alone (prefill) or beside decodes (mixed)
    assert "decode" in kinds and kinds & {"prefill", "mixed"}, kinds
    assert_engine_idle(padded)


def test_padded_decode_matches_the_torch_backend(plain):
    prompts, params = prompts_and_params((5, 20, 9), (4, 3, 4), seed=7)
    ref = LLM(TINY, max_num_seqs=8, max_model_len=MAX_LEN)  # torch backend, its own copy of the same weights
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, params)]
    llm = plain.with_levers(paged=False)  # contiguous reservations have block tables too
    llm.engine.runner.enable_cuda_graphs(8, MAX_LEN, capture=False)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    assert llm.engine.runner.graphs.num_steps > 0


def test_load_pads_with_slot_minus_one_and_length_one():
    graphs = DecodeGraphs(model=None, context=None, device=torch.device("cpu"), block_size=4, max_num_seqs=8, max_model_len=32,
                          capture=False)
    assert graphs.max_bs == 8 and graphs.max_blocks == 8 and graphs.bucket(3) == 4 and graphs.bucket(5) == 8
    a = Sequence([10, 11, 12, 13, 14], SamplingParams())
    a.num_cached_tokens, a.block_table = 4, [6, 2]            # token 14 at position 4 -> block 2, slot 8
    b = Sequence([20, 21], SamplingParams())
    b.num_cached_tokens, b.block_table = 1, [5]               # token 21 at position 1 -> slot 21
    c = Sequence([30], SamplingParams())
    c.num_cached_tokens, c.block_table = 0, [3]
    assert graphs.can_run([a, b, c])
    graphs.load([a, b, c], 4)
    assert graphs.input_ids[:4].tolist() == [14, 21, 30, 0]
    assert graphs.positions[:4].tolist() == [4, 1, 0, 0]
    assert graphs.slot_mapping[:4].tolist() == [8, 21, 12, -1]   # -1: store_kv skips the padded row
    assert graphs.seq_lens[:4].tolist() == [5, 2, 1, 1]
    assert graphs.block_tables[:4, :2].tolist() == [[6, 2], [5, 0], [3, 0], [0, 0]]
    a.num_cached_tokens = 3                                       # two new tokens: not a decode step
    assert not graphs.can_run([a, b])
    assert not graphs.can_run([c] * 9)                            # more than the largest bucket


def test_contexts_longer_than_the_capture_limit_run_eagerly():
    graphs = DecodeGraphs(model=None, context=None, device=torch.device("cpu"), block_size=4, max_num_seqs=2, max_model_len=4096,
                          capture=False, max_capture_len=16)
    assert graphs.max_blocks == 4                                 # the decode grid is sized for 16 keys, not 4096
    long = Sequence(list(range(17)), SamplingParams())
    long.num_cached_tokens, long.block_table = 16, list(range(5))   # position 16: the 17th key
    assert not graphs.can_run([long])
    short = Sequence(list(range(6)), SamplingParams())
    short.num_cached_tokens, short.block_table = 5, [9, 8, 7, 6, 5, 4, 3, 2]  # a long contiguous reservation
    assert graphs.can_run([short])
    graphs.load([short], 1)
    assert graphs.block_tables[0].tolist() == [9, 8, 7, 6] and graphs.slot_mapping[0].item() == 8 * 4 + 1


def test_cuda_graphs_refused_on_cpu():
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs a CUDA device, but this engine runs on 'cpu'"):
        LLM(TINY, attention_backend="triton", cuda_graphs=True, device="cpu")


def test_cuda_graphs_needs_the_triton_backend_and_the_cache():
    with pytest.raises(ValueError, match=r"cuda_graphs=True needs attention_backend='triton' \(got 'auto'\)"):
        EngineConfig(cuda_graphs=True)
    with pytest.raises(ValueError, match=r"needs kv_cache=True"):
        EngineConfig(cuda_graphs=True, attention_backend="triton", kv_cache=False)
    with pytest.raises(ValueError, match=r"cuda_graphs='yes' must be True or False"):
        EngineConfig(cuda_graphs="yes", attention_backend="triton")
    EngineConfig(cuda_graphs=True, attention_backend="triton")  # the legal combination


# ---------------------------------------------------------------- random-weight presets

def test_presets_have_the_real_shapes():
    cfg = preset_config("random:llama-3-8b")
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 4096, 32, 8, 128)
    assert (cfg.intermediate_size, cfg.vocab_size, cfg.rope_theta) == (14336, 128256, 500000.0)
    assert cfg.rope_scaling["rope_type"] == "llama3" and not cfg.tie_word_embeddings
    assert 8.0e9 < cfg.num_params < 8.1e9
    small = PRESETS["smollm2-135m"]
    assert (small.num_layers, small.num_heads, small.num_kv_heads, small.vocab_size) == (30, 9, 3, 49152)
    assert 1.3e8 < small.num_params < 1.4e8


def test_presets_round_trip_through_a_transformers_config():
    from transformers import AutoConfig, LlamaConfig

    from minillm.models.config import ModelConfig

    for cfg in PRESETS.values():   # Mixtral / Qwen2-MoE presets through their own config classes
        assert ModelConfig.from_hf(AutoConfig.for_model(cfg.model_type, **hf_config_dict(cfg))) == cfg
        if not cfg.num_experts:
            assert ModelConfig.from_hf(LlamaConfig(**hf_config_dict(cfg))) == cfg


def test_random_weights_model_without_tokenizer():
    llm = LLM(TINY, max_model_len=64, dtype="bfloat16")
    assert llm.tokenizer is None and llm.dtype == torch.bfloat16
    assert next(llm.engine.model.parameters()).dtype == torch.bfloat16
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].text == ""
    with pytest.raises(ValueError, match="has no tokenizer"):
        llm.generate(["a text prompt"])
    with pytest.raises(ValueError, match=r"no preset 'nope'"):
        LLM("random:nope")

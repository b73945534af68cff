"""Parallel sampling (n > 1, best_of): the prompt is prefilled once, its KV blocks are shared by the
continuations (reference counts, copy-on-write of the partial last block), continuation i draws with seed + i,
and every block returns to the pool."""

from __future__ import annotations

import pytest
import torch

from conftest import assert_engine_idle
from minillm import SamplingParams
from minillm.engine.block_manager import BlockManager
from minillm.engine.kv_cache import KVCache
from minillm.models.config import ModelConfig

# ~70 tokens: four full 16-token blocks shared, and a partial last block that each continuation copies
PROMPT = ("Speculative decoding, paged attention and prefix caching are three levers of an inference engine. "
          "Explain in one paragraph which of them saves memory, which saves time, and why: ") * 2


def singles(llm, ids, params: SamplingParams) -> list[list[int]]:
    """What n requests with n = 1 and seeds seed, seed + 1, ... produce."""
    outs = llm.generate([{"prompt_token_ids": ids}] * params.n,
                        [SamplingParams(**{**params.__dict__, "n": 1, "best_of": None,
                                           "seed": params.seed + i}) for i in range(params.n)])
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompt_ids(default_llm):
    return default_llm.tokenizer.encode(PROMPT)


def test_validation_names_value_and_range(default_llm):
    for kwargs, words in (({"n": 0}, "n=0 must be an integer in [1, 128]"),
                          ({"n": True}, "n=True"),
                          ({"n": 3, "best_of": 2}, "best_of=2 must be None or an integer in [n=3, 128]")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            SamplingParams(**kwargs)
    with pytest.raises(ValueError, match=r"n=17 continuations run side by side, but max_num_seqs=16"):
        default_llm.generate("Hi", SamplingParams(n=17))


def test_n_shares_the_prompt_blocks_and_equals_seeded_singles(default_llm, prompt_ids):
    llm = default_llm
    engine, bm = llm.engine, llm.engine.block_manager
    params = SamplingParams(n=4, temperature=0.9, top_p=0.95, seed=11, max_tokens=12)
    seq = engine.add_request(prompt_ids, params)
    assert [s.index for s in seq.group] == [0, 1, 2, 3] and len(engine.scheduler.waiting) == 1
    engine.step()   # the prefill: all of the prompt but its last token, then the fork
    full = (len(prompt_ids) - 1) // bm.block_size
    assert full >= 3 and len(engine.scheduler.running) == 4
    tables = [s.block_table for s in seq.group]
    assert all(t == tables[0] for t in tables)
    assert [bm.ref_count[b] for b in tables[0]] == [4] * len(tables[0]), "the prompt's blocks are held once, by 4"
    used = bm.num_used_blocks
    engine.step()   # first decode: 3 of the 4 copy the partial last block, the last writes in place
    assert bm.num_used_blocks == used + 3
    assert [bm.ref_count[b] for b in tables[0][:full]] == [4] * full
    assert len({s.block_table[full] for s in seq.group}) == 4
    while engine.has_unfinished():
        engine.step()
    assert_engine_idle(llm)
    from minillm.outputs import RequestOutput

    out = RequestOutput.from_sequence(seq, llm.tokenizer)
    assert [c.index for c in out.outputs] == [0, 1, 2, 3] and out.finished
    assert [c.token_ids for c in out.outputs] == singles(llm, prompt_ids, params)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1, "four seeds drew four identical continuations"


def test_memory_saved_is_reported(default_llm, prompt_ids):
    llm = default_llm
    params = SamplingParams(n=4, temperature=0.8, seed=3, max_tokens=6)
    llm.generate({"prompt_token_ids": prompt_ids}, params)
    shared, used = llm.stats.peak_kv_shared_bytes, llm.stats.peak_kv_bytes
    per_block = llm.kv_bytes_per_token * llm.engine.block_manager.block_size
    full = (len(prompt_ids) - 1) // llm.engine.block_manager.block_size
    assert shared >= 3 * full * per_block, (shared, full, per_block)
    singles(llm, prompt_ids, params)
    assert llm.stats.peak_kv_shared_bytes == 0
    assert llm.stats.peak_kv_bytes - used >= 3 * full * per_block
    assert_engine_idle(llm)


@pytest.mark.parametrize("levers", [
    {"chunked_prefill": True, "max_num_batched_tokens": 24},
    {"prefix_caching": True},
    {"paged": False},                     # no sharing: each continuation holds its own reservation
    {"kv_cache_bytes": 8 * 16 * 46080},   # 8 blocks: continuations preempt each other and recompute
], ids=["chunked", "prefix-cache", "contiguous", "preemption"])
def test_n_with_other_levers(default_llm, prompt_ids, levers):
    llm = default_llm.with_levers(**levers)
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=16)
    out = llm.generate({"prompt_token_ids": prompt_ids}, params)
    preemptions = llm.stats.num_preemptions
    assert [c.token_ids for c in out[0].outputs] == singles(llm, prompt_ids, params)
    if "kv_cache_bytes" in levers:   # 5 shared blocks + 2 copies, then each continuation needs a 6th
        assert preemptions > 0, "the pool was meant to be too small for three continuations"
    assert_engine_idle(llm)


def test_n_with_speculative_greedy(default_llm, prompt_ids):
    llm = default_llm.with_levers(speculative="ngram")
    out = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(n=2, max_tokens=12))
    plain = default_llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(max_tokens=12))
    assert [c.token_ids for c in out[0].outputs] == [plain[0].outputs[0].token_ids] * 2
    assert_engine_idle(llm)


def test_best_of_returns_the_n_best_by_mean_logprob(default_llm, prompt_ids):
    llm = default_llm
    params = SamplingParams(n=2, best_of=4, temperature=1.0, seed=21, max_tokens=8, logprobs=0)
    out = llm.generate({"prompt_token_ids": prompt_ids}, params)[0].outputs
    assert [c.index for c in out] == [0, 1]
    all_four = llm.generate([{"prompt_token_ids": prompt_ids}] * 4,
                            [SamplingParams(temperature=1.0, seed=21 + i, max_tokens=8, logprobs=0) for i in range(4)])
    ranked = sorted((o.outputs[0] for o in all_four), key=lambda c: -c.cumulative_logprob / len(c.token_ids))
    assert [c.token_ids for c in out] == [c.token_ids for c in ranked[:2]]
    # without logprobs the ranking is the same (the engine records the sampled tokens' logprobs for it)
    quiet = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(n=2, best_of=4, temperature=1.0, seed=21,
                                                                          max_tokens=8))[0].outputs
    assert [c.token_ids for c in quiet] == [c.token_ids for c in out] and quiet[0].logprobs is None
    assert llm.stats.num_output_tokens == sum(len(o.outputs[0].token_ids) for o in all_four), \
        "the stats count every continuation's tokens, returned or not"
    assert_engine_idle(llm)


def test_abort_before_the_fork_frees_everything(default_llm, prompt_ids):
    engine = default_llm.engine
    seq = engine.add_request(prompt_ids, SamplingParams(n=3, temperature=1.0, max_tokens=5))
    engine.abort(seq, "abort", "the client went away")
    assert all(s.finish_reason == "abort" for s in seq.group)
    assert_engine_idle(default_llm)
    seq = engine.add_request(prompt_ids, SamplingParams(n=3, temperature=1.0, max_tokens=5))
    engine.step()
    engine.step()
    engine.abort(seq.group[2])   # one continuation's abort ends the request
    assert all(s.is_finished for s in seq.group)
    assert_engine_idle(default_llm)


def test_copy_on_write_block_manager():
    bm = BlockManager(8, 4, contiguous=False)
    table = bm.allocate(6)                 # 2 blocks, the second half full
    forks = [bm.share(table) for _ in range(2)]
    assert [bm.ref_count[b] for b in table] == [3, 3]
    assert bm.shared_blocks(forks[0], 5, 6) == 1 and bm.shared_blocks(forks[0], 8, 9) == 0
    pairs = bm.copy_on_write(forks[0], 5, 6)
    assert pairs == [(table[1], forks[0][1])] and forks[0][1] != table[1] and forks[0][0] == table[0]
    assert bm.ref_count[table[1]] == 2 and bm.ref_count[forks[0][1]] == 1
    bm.copy_on_write(forks[1], 5, 6)
    assert bm.copy_on_write(table, 5, 6) == [], "the last owner writes in place"
    for t in (table, *forks):
        bm.free(t)
    bm.check()
    assert bm.num_free_blocks == 8
    full = BlockManager(3, 4, contiguous=False)
    t = full.allocate(12)
    full.share(t)
    with pytest.raises(MemoryError, match="copy-on-write"):
        full.copy_on_write(t, 0, 12)


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_kv_copy_blocks(kv_dtype):
    cfg = ModelConfig("llama", vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                      max_position_embeddings=32, tie_word_embeddings=True, qkv_bias=False, o_bias=False,
                      mlp_bias=False, sliding_window=None, bos_token_id=None)
    cache = KVCache(cfg, 4, 2, torch.float32, torch.device("cpu"), kv_dtype)
    for t in cache.k + cache.v + [s for s in cache.k_scale + cache.v_scale if s is not None]:
        t.copy_(torch.randn(t.shape).to(t.dtype) if t.dtype.is_floating_point else torch.randint(-5, 5, t.shape, dtype=t.dtype))
    before = [t.clone() for t in cache.k + cache.v]
    cache.copy_blocks([(1, 3), (0, 2)])
    for old, new in zip(before, cache.k + cache.v):
        assert torch.equal(new[:, 6:8], old[:, 2:4]) and torch.equal(new[:, 4:6], old[:, 0:2])
        assert torch.equal(new[:, 0:4], old[:, 0:4])
    if kv_dtype:
        assert torch.equal(cache.k_scale[0][:, 6:8], cache.k_scale[0][:, 2:4])

"""prefix_caching=True: full blocks are keyed by a hash chain and shared between requests.

Greedy outputs with the cache on must equal those with it off, token for token: on a workload
with shared prefixes, under memory pressure that forces eviction, with concurrent requests
sharing blocks, with chunked prefill on and off, on the torch and Triton backends. Hit counts
are asserted exactly where they are predictable, and every block returns to the pool.
"""

from __future__ import annotations

import shutil

import pytest

import kernel_utils  # noqa: F401  first: picks the Triton interpreter before triton is imported
from conftest import assert_engine_idle, tokenizer_files
from test_models import BASE

from minillm import LLM, EngineConfig, SamplingParams
from minillm.engine.block_manager import BlockManager, block_hash

BS = 16


# ----------------------------------------------------------------------------- block manager
def test_block_hash_is_a_chain_over_parent_tokens_and_salt():
    k0 = block_hash(None, (1, 2, 3, 4), None)
    assert k0 == block_hash(None, [1, 2, 3, 4], None)            # stable, list or tuple
    assert len({k0, block_hash(None, (1, 2, 3, 5), None), block_hash(k0, (1, 2, 3, 4), None),
                block_hash(None, (1, 2, 3, 4), "a"), block_hash(None, (1, 2, 3, 4), "b")}) == 5
    # Stable across processes: SHA-256 of a fixed byte layout (Python's hash() of a str salt is not).
    assert block_hash(None, (1, 2), "x").hex()[:16] == block_hash(None, (1, 2), "x").hex()[:16]
    import hashlib
    assert block_hash(None, (1,), None) == hashlib.sha256(b"\0" * 32 + (1).to_bytes(8, "little")).digest()


def _cached_table(bm, tokens, salt=None):
    """Allocate `tokens` in fresh blocks and register every full block, as the scheduler does."""
    table = bm.allocate(len(tokens))
    parent_key = None
    for i in range(len(tokens) // bm.block_size):
        chunk = tokens[i * bm.block_size:(i + 1) * bm.block_size]
        key = bm.hash_block(parent_key, chunk, salt)
        bm.register(table[i], key, chunk, salt, table[i - 1] if i else None)
        parent_key = key
    return table


def _keys(bm, tokens, salt=None):
    keys, parent = [], None
    for i in range(len(tokens) // bm.block_size):
        parent = bm.hash_block(parent, tokens[i * bm.block_size:(i + 1) * bm.block_size], salt)
        keys.append(parent)
    return keys


def test_match_shares_revives_and_stops_at_the_first_difference():
    bm = BlockManager(8, 2, contiguous=False)
    a = _cached_table(bm, [1, 2, 3, 4, 5, 6])
    assert bm.num_cached_blocks == 3
    b_tokens = [1, 2, 3, 4, 9, 9]
    assert bm.match(b_tokens, _keys(bm, b_tokens), None) == a[:2]
    assert bm.match(b_tokens, _keys(bm, b_tokens, "s"), "s") == []          # another salt: nothing
    b = bm.allocate_cached(a[:2], 6)                                        # shared while a runs
    assert b[:2] == a[:2] and [bm.ref_count[x] for x in a] == [2, 2, 1] and bm.num_free_blocks == 4
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 3            # freed, still cached
    c = bm.allocate_cached(bm.match([1, 2, 3, 4, 5, 6, 7], _keys(bm, [1, 2, 3, 4, 5, 6]), None), 7)
    assert c[:3] == a and bm.num_free_blocks == 4 and all(bm.ref_count[x] == 1 for x in c)  # revived
    bm.free(c)
    bm.check()


def test_a_hash_collision_never_serves_another_prompts_blocks():
    """Every block at one depth gets the same key: the token comparison must refuse the match."""
    bm = BlockManager(8, 2, contiguous=False, hash_fn=lambda parent, tokens, salt: ("depth", parent))
    a = _cached_table(bm, [1, 2, 3, 4])
    other = [1, 2, 7, 8]                      # same first block, different second
    assert bm.match(other, _keys(bm, other), None) == a[:1]
    assert bm.match([5, 6, 3, 4], _keys(bm, [5, 6, 3, 4]), None) == []   # same second block, other parent
    assert bm.match([1, 2, 3, 4], _keys(bm, [1, 2, 3, 4]), None) == a
    # The colliding second prompt cannot take the key of a live block either.
    d = bm.allocate(4)
    assert not bm.register(d[0], bm.hash_block(None, (5, 6), None), (5, 6), None, None)
    bm.free(a)
    bm.free(d)
    bm.check()


def test_eviction_frees_tail_first_and_an_orphaned_child_is_never_matched():
    depth = lambda parent, tokens, salt: ("depth", parent)   # noqa: E731  collisions everywhere
    bm = BlockManager(3, 2, contiguous=False, hash_fn=depth)
    a = _cached_table(bm, [1, 2, 3, 4])       # blocks 0 (head), 1 (tail)
    bm.free(a)
    assert list(bm.evictable) == [1, 0]       # tail first
    x = bm.allocate(4)                        # block 2 (never cached), then evicts the tail (1)
    assert x == [2, 1] and bm.num_evictions == 1 and bm.block_key[1] is None and bm.num_cached_blocks == 1
    bm.free(x)
    bm.reset_prefix_cache()
    # An orphan: the tail stays cached (held), its head is evicted and re-cached with other tokens.
    a = _cached_table(bm, [1, 2, 3, 4])
    held = bm.share(a[1:])
    bm.free(a)
    assert list(bm.evictable) == [a[0]]
    y = bm.allocate(4)                        # the never-cached block, then evicts the head
    assert a[0] in y and bm.block_key[a[0]] is None
    bm.register(y[0], bm.hash_block(None, (5, 6), None), (5, 6), None, None)
    assert bm.match([5, 6, 3, 4], _keys(bm, [5, 6, 3, 4]), None) == [y[0]]   # not the orphan after [1, 2]
    # A new child for [5, 6, 3, 4] replaces the orphan's key (the orphan stays held, uncached).
    assert bm.register(y[1], bm.hash_block(bm.hash_block(None, (5, 6), None), (3, 4), None), (3, 4), None, y[0])
    assert bm.block_key[held[0]] is None and bm.match([5, 6, 3, 4], _keys(bm, [5, 6, 3, 4]), None) == y
    bm.free(y)
    bm.free(held)
    bm.check()
    assert bm.num_free_blocks == 3


def test_eviction_takes_never_cached_blocks_first_then_lru_tail_before_head():
    bm = BlockManager(8, 2, contiguous=False)
    a = _cached_table(bm, [1, 2, 3, 4, 5, 6])     # blocks 0, 1, 2
    b = _cached_table(bm, [7, 8, 9, 10])          # blocks 3, 4
    assert (a, b) == ([0, 1, 2], [3, 4])
    bm.free(b)                                    # b leaves first: its blocks are the oldest
    bm.free(a)
    assert list(bm.evictable) == [4, 3, 2, 1, 0]  # b tail, b head, a tail, ..., a head
    assert bm.allocate(6) == [5, 6, 7]            # never-cached free blocks first
    assert bm.num_cached_blocks == 5 and bm.num_evictions == 0
    assert bm.allocate(2) == [4] and bm.allocate(2) == [3] and bm.allocate(2) == [2]
    assert bm.num_evictions == 3 and bm.num_cached_blocks == 2
    assert bm.match([1, 2, 3, 4, 5, 6], _keys(bm, [1, 2, 3, 4, 5, 6]), None) == [0, 1]
    bm.check()


def test_freed_cached_blocks_count_as_free_and_reset_forgets_them():
    bm = BlockManager(4, 2, contiguous=False)
    a = _cached_table(bm, [1, 2, 3, 4, 5])
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.can_allocate(8) and bm.num_cached_blocks == 2
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and not bm.evictable and len(bm.free_ids) == 4
    bm.check()


# ----------------------------------------------------------------------------- configuration
def test_prefix_caching_needs_paged_blocks_and_the_cache():
    with pytest.raises(ValueError, match=r"prefix_caching=True needs kv_cache=True and paged=True "
                                         r"\(got kv_cache=True, paged=False\)"):
        EngineConfig(prefix_caching=True, paged=False)
    with pytest.raises(ValueError, match=r"got kv_cache=False, paged=True"):
        EngineConfig(prefix_caching=True, kv_cache=False)
    with pytest.raises(ValueError, match=r"prefix_caching='yes' must be True or False"):
        EngineConfig(prefix_caching="yes")
    assert EngineConfig(prefix_caching=True).prefix_caching


# ----------------------------------------------------------------------------- the default model
@pytest.fixture(scope="module")
def corpus_ids(default_llm):
    from minillm.bench.workloads import shipped_corpus

    return default_llm.tokenizer.encode(shipped_corpus(), add_special_tokens=False)


@pytest.fixture(scope="module")
def workload(corpus_ids):
    """A 5-block system prompt shared by several questions; an identical pair; prompts diverging
    in the middle of a block; an unrelated one."""
    system = corpus_ids[:5 * BS]
    q = [corpus_ids[400 + 13 * i: 400 + 13 * i + 5 + i] for i in range(4)]
    prompts = [system + q[0], system + q[1], system + q[2], system + q[0],
               system[:2 * BS + 7] + q[3] + system[2 * BS + 7:], system[:BS + 3] + q[1],
               corpus_ids[900:920], system + q[3] + q[2]]
    params = [SamplingParams(max_tokens=4 + i % 3, ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


@pytest.fixture(scope="module")
def reference(default_llm, workload):
    prompts, params = workload
    return [o.outputs[0].token_ids for o in default_llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def _track_sharing(llm):
    """Record the highest reference count seen after each step (blocks shared by running requests)."""
    sched, seen = llm.engine.scheduler, [0]
    orig = sched.postprocess

    def postprocess(*args, **kwargs):
        seen[0] = max(seen[0], max(llm.engine.block_manager.ref_count))
        return orig(*args, **kwargs)

    sched.postprocess = postprocess
    return seen


def _expected_hit(n):
    return (n - 1) // BS * BS


@pytest.mark.parametrize("chunked", [False, True], ids=["whole", "chunked"])
def test_shared_prefixes_match_the_plain_engine(default_llm, workload, reference, chunked):
    prompts, params = workload
    # A budget a little above one prompt admits one request per step: later requests find the
    # blocks of earlier, still running ones (concurrent sharing) inside one generate call.
    llm = default_llm.with_levers(prefix_caching=True, chunked_prefill=chunked, block_size=BS, max_model_len=512,
                                  max_num_batched_tokens=48 if chunked else 100, kv_cache_bytes=64 * BS * 46080)
    shared = _track_sharing(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    got = [o.outputs[0].token_ids for o in outs]
    assert got == reference
    assert shared[0] >= 2, "no block was shared by two running requests"
    # A shared block's tokens count once: the pool never holds more real tokens than it reserved.
    assert all(s.kv_bytes_used <= s.kv_bytes_reserved for s in llm.stats.steps)
    st = llm.stats
    assert st.prefix_cache_hits > 0 and st.prefix_cache_queries == sum(len(p) for p in prompts)
    assert st.num_cached_prompt_tokens == sum(o.metrics.num_cached_tokens for o in outs) == st.prefix_cache_hits
    assert st.prefix_cache_hit_rate == pytest.approx(st.prefix_cache_hits / st.prefix_cache_queries)
    assert outs[0].metrics.num_cached_tokens == 0                       # the first request finds nothing
    assert outs[3].metrics.num_cached_tokens == 5 * BS                  # its twin: the whole system prompt
    assert outs[6].metrics.num_cached_tokens == 0                       # unrelated
    assert outs[5].metrics.num_cached_tokens == BS                      # diverges inside block 1
    assert outs[4].metrics.num_cached_tokens == 2 * BS                  # diverges inside block 2
    assert_engine_idle(llm)

    # Sequentially now: an identical request hits floor((len - 1) / block_size) * block_size tokens.
    for i in (0, 3, 6, 7):
        out = llm.generate({"prompt_token_ids": prompts[i]}, params[i])[0]
        assert out.outputs[0].token_ids == reference[i]
        assert out.metrics.num_cached_tokens == _expected_hit(len(prompts[i])), i
        assert llm.stats.prefix_cache_hits == _expected_hit(len(prompts[i]))
        assert out.metrics.ttft_s is not None
    assert_engine_idle(llm)


def test_eviction_under_memory_pressure_keeps_outputs(default_llm, workload, reference):
    prompts, params = workload
    per_token = default_llm.kv_bytes_per_token
    # 14 blocks: two ~100-token requests at a time, so cached blocks are evicted all the time.
    llm = default_llm.with_levers(prefix_caching=True, block_size=BS, max_model_len=512,
                                  kv_cache_bytes=14 * BS * per_token)
    bm = llm.engine.block_manager
    assert bm.num_blocks == 14
    for _ in range(2):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in outs] == reference
        assert_engine_idle(llm)
    assert bm.num_evictions > 0
    assert llm.stats.prefix_cache_hits > 0


def test_generated_tokens_are_cached_for_the_next_turn(default_llm, corpus_ids):
    llm = default_llm.with_levers(prefix_caching=True, block_size=BS, max_model_len=512,
                                  kv_cache_bytes=64 * BS * 46080)
    prompt = corpus_ids[:40]
    first = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=30, ignore_eos=True))[0]
    answer = first.outputs[0].token_ids
    follow = prompt + answer + corpus_ids[2000:2010]
    out = llm.generate({"prompt_token_ids": follow}, SamplingParams(max_tokens=3, ignore_eos=True))[0]
    # The first request wrote K/V for its prompt and all outputs but the last: 40 + 29 = 69 tokens.
    assert out.metrics.num_cached_tokens == 69 // BS * BS == 64
    ref = default_llm.generate({"prompt_token_ids": follow}, SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert_engine_idle(llm)


def test_cache_salt_keeps_requests_apart(default_llm, corpus_ids):
    llm = default_llm.with_levers(prefix_caching=True, block_size=BS, max_model_len=512,
                                  kv_cache_bytes=64 * BS * 46080)
    prompt = corpus_ids[100:150]
    p = SamplingParams(max_tokens=2, ignore_eos=True)

    def hit(salt):
        req = {"prompt_token_ids": prompt} if salt is None else {"prompt_token_ids": prompt, "cache_salt": salt}
        return llm.generate(req, p)[0].metrics.num_cached_tokens

    assert hit("tenant-a") == 0
    assert hit("tenant-b") == 0
    assert hit(None) == 0
    assert hit("tenant-a") == hit("tenant-b") == hit(None) == 48
    with pytest.raises(ValueError, match=r"cache_salt=5 must be None or a str"):
        llm.generate({"prompt_token_ids": prompt, "cache_salt": 5}, p)
    assert_engine_idle(llm)


def test_a_colliding_hash_in_the_engine_serves_no_foreign_cache(default_llm, corpus_ids, monkeypatch):
    llm = default_llm.with_levers(prefix_caching=True, block_size=BS, max_model_len=512,
                                  kv_cache_bytes=64 * BS * 46080)
    # Every block at one depth collides: only the token comparison tells prompts apart.
    monkeypatch.setattr(llm.engine.block_manager, "hash_fn", lambda parent, tokens, salt: ("depth", parent))
    a, b = corpus_ids[:50], corpus_ids[300:350]
    p = SamplingParams(max_tokens=4, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in default_llm.generate([{"prompt_token_ids": x} for x in (a, b)], p)]
    outs = [llm.generate({"prompt_token_ids": x}, p)[0] for x in (a, b, a, b)]
    assert [o.outputs[0].token_ids for o in outs] == ref * 2
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 0, 48, 0]   # b's blocks never got a's keys
    assert_engine_idle(llm)


# ----------------------------------------------------------------------------- tiny model, both backends
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**{**BASE, "num_hidden_layers": 1, "num_key_value_heads": 2})
    torch.manual_seed(5)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tmp_path_factory.mktemp("prefix") / "llama_gqa_1layer"
    model.save_pretrained(path)
    for f in tokenizer_files(default_model_dir):
        shutil.copy(f, path)
    return str(path)


def _tiny_workload():
    import random

    rng = random.Random(7)
    system = [rng.randrange(3, 250) for _ in range(40)]
    prompts = [system + [rng.randrange(3, 250) for _ in range(n)] for n in (1, 5, 9, 3)]
    prompts += [prompts[1], system[:20] + [rng.randrange(3, 250) for _ in range(15)], system[:33],
                [rng.randrange(3, 250) for _ in range(17)]]
    params = [SamplingParams(max_tokens=8 + 3 * (i % 4), ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


# whole-prompt prefill through the Triton kernels in the interpreter (~30 s) runs with -m slow; the
# chunked case covers the same extend kernel over a cached prefix in CI.
@pytest.mark.parametrize("chunked, backend", [
    pytest.param(c, b, id=f"{'chunked' if c else 'whole'}-{b}",
                 marks=[pytest.mark.slow] if (c, b) == (False, "triton") else [])
    for c in (False, True) for b in ("torch", "triton")])
def test_tiny_model_both_backends(tiny_model, backend, chunked):
    prompts, params = _tiny_workload()
    reqs = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(tiny_model, attention_backend=backend, max_model_len=128, block_size=8)
    ref = [o.outputs[0].token_ids for o in plain.generate(reqs, params)]
    llm = plain.with_levers(prefix_caching=True, chunked_prefill=chunked,
                            max_num_batched_tokens=24 if chunked else 50, kv_cache_bytes=12 * 8 * plain.kv_bytes_per_token)
    assert llm.engine.block_manager.num_blocks == 12     # small: eviction and preemption happen
    preemptions = hits = 0
    for _ in range(2):
        outs = llm.generate(reqs, params)
        assert [o.outputs[0].token_ids for o in outs] == ref
        assert_engine_idle(llm)
        preemptions += llm.stats.num_preemptions
        hits += llm.stats.prefix_cache_hits
    assert hits > 0 and preemptions > 0
    assert llm.engine.block_manager.num_evictions > 0
    for i in (0, 4, 6):   # alone, twice: the second hits floor((len - 1) / 8) * 8 tokens
        for _ in range(2):
            out = llm.generate(reqs[i], params[i])[0]
            assert out.outputs[0].token_ids == ref[i]
        assert out.metrics.num_cached_tokens == (len(prompts[i]) - 1) // 8 * 8
    assert_engine_idle(llm)


# ----------------------------------------------------------------------------- the benchmark
def test_shared_prefix_benchmark_small(default_llm):
    from minillm.bench.prefix import compare_prefix_caching, format_prefix, shared_prefix_workload

    requests = shared_prefix_workload(default_llm.tokenizer, prefix_tokens=70, num_questions=3, max_tokens=2)
    ids = [r.prompt["prompt_token_ids"] for r in requests]
    assert all(p[:70] == ids[0][:70] for p in ids) and len({tuple(p[70:]) for p in ids}) == 3
    result = compare_prefix_caching(default_llm.with_levers(max_model_len=256), requests)
    off, on = result["off"], result["on"]
    assert result["identical"] == 3 and off.outputs == on.outputs
    assert off.cached_tokens == [0, 0, 0] and off.hits == 0
    assert on.cached_tokens == [0, 64, 64]           # the document's 4 full blocks; block 5 holds the question
    assert (on.hits, on.queries) == (128, on.prompt_tokens) and on.prompt_tokens == sum(len(p) for p in ids)
    text = format_prefix(result, 70)
    assert "greedy outputs identical: 3/3" in text and f"{on.hit_rate:.1%}" in text
    with pytest.raises(ValueError, match="prefix_tokens=100000: the corpus has only"):
        shared_prefix_workload(default_llm.tokenizer, prefix_tokens=100_000)

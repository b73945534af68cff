"""chunked_prefill=True: prompts are cut into chunks that share steps with running decodes.

Outputs must be the same as without chunking — greedy token for token, and seeded sampling
too (a chunk that stops short of its prompt's end samples nothing).
"""

import pytest

from minillm import SamplingParams

from conftest import assert_engine_idle

LONG = ("The history of computing is a story of machines that got smaller, faster and cheaper, "
        "and of people who found new uses for them at every step. ") * 4
PROMPTS = [LONG, "The capital of France is", "def add(a, b):", LONG + " In short,", "Water boils at",
           "Q: What is 7 times 6?\nA:", "List three colours:", "Once upon a time"]
MAX_TOKENS = [8, 6, 10, 5, 7, 4, 9, 12]


def greedy():
    return [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]


@pytest.fixture(scope="module")
def reference(default_llm):
    one = default_llm.with_levers(max_num_seqs=1)
    return [o.outputs[0].token_ids for o in one.generate(PROMPTS, greedy())]


@pytest.mark.parametrize("levers", [
    dict(chunked_prefill=True, max_num_batched_tokens=16),
    dict(chunked_prefill=True, max_num_batched_tokens=7, paged=True, block_size=4),
    dict(chunked_prefill=True, max_num_batched_tokens=33, paged=True, max_num_seqs=3),
    dict(chunked_prefill=True, max_num_batched_tokens=20, batching="static", max_num_seqs=4),
])
def test_chunked_prefill_matches_single_requests(default_llm, reference, levers):
    llm = default_llm.with_levers(**levers)
    outs = llm.generate(PROMPTS, greedy())
    for i, (out, want) in enumerate(zip(outs, reference)):
        assert out.outputs[0].token_ids == want, f"prompt {i} differs under {levers}"
    kinds = {s.kind for s in llm.stats.steps}
    budget = levers["max_num_batched_tokens"]
    assert all(s.num_tokens <= budget for s in llm.stats.steps), "a step went over the token budget"
    long_prompt_tokens = outs[0].metrics.num_prompt_tokens
    assert long_prompt_tokens > budget, "the long prompt must need several chunks"
    if levers.get("batching", "continuous") == "continuous":
        assert "mixed" in kinds, f"no step mixed prompt chunks with decodes: {kinds}"
    assert_engine_idle(llm)


def test_seeded_sampling_does_not_depend_on_chunking(default_llm):
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=100 + i) for i in range(len(PROMPTS))]
    whole = [o.outputs[0].token_ids for o in default_llm.generate(PROMPTS, params)]
    chunked = default_llm.with_levers(chunked_prefill=True, max_num_batched_tokens=9)
    assert [o.outputs[0].token_ids for o in chunked.generate(PROMPTS, params)] == whole


def test_chunked_prefill_needs_the_cache():
    from minillm import EngineConfig

    with pytest.raises(ValueError, match="chunked_prefill=True needs kv_cache=True"):
        EngineConfig(chunked_prefill=True, kv_cache=False)

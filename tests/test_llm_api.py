"""LLM conveniences the labs lean on: engines that share weights, plugged-in attention."""

from minillm import SamplingParams
from minillm.layers.attention import TorchAttentionBackend


def test_with_levers_shares_weights_and_keeps_its_own_cache(default_llm, idle_check):
    no_cache = default_llm.with_levers(kv_cache=False)
    assert no_cache.engine.model is default_llm.engine.model
    assert no_cache.config.kv_cache is False and default_llm.config.kv_cache is True
    prompts = ["Hello there", "The capital of France is"]
    params = SamplingParams(max_tokens=10)
    first = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params)]
    other = [o.outputs[0].token_ids for o in no_cache.generate(prompts, params)]
    again = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params)]
    assert first == other == again
    assert no_cache.stats.peak_kv_bytes == 0 and default_llm.stats.peak_kv_bytes > 0
    idle_check(default_llm)


def test_plugged_in_backend_is_called_and_can_be_removed(default_llm):
    calls = {"store": 0, "attend": 0}

    class Counting(TorchAttentionBackend):
        def store_kv(self, *args):
            calls["store"] += 1
            return super().store_kv(*args)

        def attend(self, *args):
            calls["attend"] += 1
            return super().attend(*args)

    params = SamplingParams(max_tokens=3)
    want = default_llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids
    default_llm.set_attention_backend(Counting())
    try:
        got = default_llm.generate(["Once upon a time"], params)[0].outputs[0].token_ids
    finally:
        default_llm.set_attention_backend("torch")
    layers = default_llm.model_config.num_layers
    assert got == want
    assert calls == {"store": 3 * layers, "attend": 3 * layers}  # 1 prefill + 2 decode steps, every layer
    default_llm.generate(["Once upon a time"], params)
    assert calls["attend"] == 3 * layers, "the built-in backend is back"


def test_kv_bytes_per_token_of_the_default_model(default_llm):
    # 2 (K and V) x 30 layers x 3 KV heads x 64 dims x 4 bytes (fp32 on the CPU)
    assert default_llm.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46080

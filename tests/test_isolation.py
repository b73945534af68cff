"""Two engines that share a model's weights (LLM.with_levers) share nothing else (DESIGN.md).

Each case builds a plain engine and, on the same weights, one with a different part inside the model (a quantized
matmul, a LoRA delta, an MoE router, another attention backend). Each engine's greedy tokens are taken alone first;
then both run their requests step by step, interleaved (one engine step, then the other's), and each must give
its own tokens again. The plugged engine's tokens differ from the plain one's, so a part that leaked from one
engine into the other would change the other's tokens. The MoE case also checks each engine's expert counts.
"""

from __future__ import annotations

import pytest
import torch

from minillm import LLM, SamplingParams
from minillm.lora import LoRARequest

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12, 13] * 7, list(range(30, 47))]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
LEVERS = dict(max_model_len=128, max_num_seqs=4, block_size=4, seed=0)


def _alone(llm, lora=None) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY,
                                                               lora_request=lora)]


def _interleaved(engines: list, loras: list) -> list[list[list[int]]]:
    """Every engine's requests, stepped one engine step at a time in turn until all finish."""
    seqs = [[llm.engine.add_request(p, GREEDY, lora_request=lora) for p in PROMPTS]
            for llm, lora in zip(engines, loras)]
    steps = 0
    while any(llm.engine.has_unfinished() for llm in engines):
        for llm in engines:
            if llm.engine.has_unfinished():
                llm.engine.step()
        steps += 1
    assert steps > len(PROMPTS), "the engines should take several interleaved steps"
    return [[list(s.output_token_ids) for s in group] for group in seqs]


def _check(plain, plugged, plain_lora=None, plugged_lora=None) -> None:
    assert plugged.engine.model is plain.engine.model, "the two engines share the weights"
    want_plain, want_plugged = _alone(plain, plain_lora), _alone(plugged, plugged_lora)
    assert want_plain != want_plugged, "the part changes the tokens (else the test could not see it leak)"
    got_plain, got_plugged = _interleaved([plain, plugged], [plain_lora, plugged_lora])
    assert got_plain == want_plain
    assert got_plugged == want_plugged
    # and the plain engine, alone again afterwards, is as it was
    assert _alone(plain, plain_lora) == want_plain


def test_a_quantized_matmul_stays_in_its_engine():
    plain = LLM("random:tiny-llama", weight_dtype="int8", **LEVERS)

    def doubled(x, layer):   # a wrong kernel on purpose: its engine's tokens change
        return 2.0 * layer.own_matmul(x)

    plugged = plain.with_levers(quantized_matmul=doubled)
    _check(plain, plugged)
    torch_ops = plain.with_levers(attention_backend="torch")   # and a third engine on the same weights
    assert _alone(torch_ops) == _alone(plain)


def test_a_lora_delta_stays_in_its_engine(tmp_path):
    from minillm.bench.lora import random_adapter
    from minillm.layers.lora import add_lora_delta, layer_shapes

    plain = LLM("random:tiny-llama", enable_lora=True, max_loras=2, max_lora_rank=8, **LEVERS)
    adapter = LoRARequest("a", 1, random_adapter(str(tmp_path / "a"), layer_shapes(plain.engine.model), rank=8,
                                                 seed=3, std=0.5))

    def tripled(x, a, b, batch):   # three times each token's own delta
        slots = batch.token_slots
        return 3.0 * torch.einsum("tr,tor->to", torch.einsum("ti,tri->tr", x, a[slots]), b[slots])

    plugged = plain.with_levers(lora_delta=tripled)
    assert plugged.engine.runner.lora is not plain.engine.runner.lora, "each engine has its own adapter slots"
    _check(plain, plugged, adapter, adapter)
    # the plain engine still adds the built-in delta: its adapter changes its tokens
    assert _alone(plain, adapter) != _alone(plain)
    assert add_lora_delta is not tripled


def test_an_moe_router_and_its_expert_counts_stay_in_their_engine():
    plain = LLM("random:tiny-mixtral", **LEVERS)

    def lowest(router_logits, top_k):   # the experts the built-in router likes least
        probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(-probs, top_k, dim=-1)
        weights = -weights
        return weights / weights.sum(dim=-1, keepdim=True), ids

    plugged = plain.with_levers(moe_router=lowest)
    _check(plain, plugged)
    counts = {}
    for name, llm in (("plain", plain), ("plugged", plugged)):
        _alone(llm)   # generate() starts the engine's stats afresh
        counts[name] = [s.expert_tokens for s in llm.stats.steps if s.expert_tokens is not None]
    plain.engine.reset_stats()
    plugged.engine.reset_stats()
    _interleaved([plain, plugged], [None, None])
    assert [s.expert_tokens for s in plain.stats.steps if s.expert_tokens is not None] == counts["plain"]
    assert [s.expert_tokens for s in plugged.stats.steps if s.expert_tokens is not None] == counts["plugged"]
    assert counts["plain"] != counts["plugged"]


def test_parts_that_the_levers_leave_unused_are_refused_or_dropped():
    base = LLM("random:tiny-llama", weight_dtype="int8", **LEVERS)
    plugged = base.with_levers(quantized_matmul=lambda x, layer: layer.own_matmul(x))
    assert plugged.with_levers(max_num_seqs=2).engine.runner.parts.quantized_matmul is not None   # carried over
    assert plugged.with_levers(weight_dtype="int4").engine.runner.parts.quantized_matmul is None  # another format
    assert base.engine.runner.parts.quantized_matmul is None
    with pytest.raises(ValueError, match="quantized_matmul= needs weight_dtype="):
        plugged.with_levers(weight_dtype=None, quantized_matmul=lambda x, layer: x)

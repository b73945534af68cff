"""Batched multi-LoRA (enable_lora, LoRARequest): the engine against transformers + peft, mixed batches against
requests run alone, the SGMV kernels against their torch reference, bad adapters, slot eviction, the server."""

from __future__ import annotations

import json
import os

import pytest
import torch

from kernel_utils import TOLERANCE, max_error  # first: picks the interpreter before triton is imported

from minillm import LLM, LoRARequest, SamplingParams
from minillm.kernels.lora import (lora_delta_reference, lora_shrink_reference, sgmv_expand, sgmv_shrink,
                                  token_slots_from_segments)

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate to German: good morning",
    "import numpy as np\nx =",
    "Water boils at",
    "List the planets of the solar system:",
    "Q: What is 12 times 7?\nA:",
    "Die Hauptstadt von Spanien ist",
    "Photosynthesis converts",
    "SELECT name FROM users WHERE",
]
NUM_TOKENS = 4

# (name, PEFT LoraConfig fields): different ranks and target modules, one with rsLoRA. peft picks an adapter's
# weights by its name inside parameter names: a name such as "poet" or "sql" would also pick up other adapters'.
ADAPTERS = {
    "sql": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "poet": dict(r=16, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"], use_rslora=True),
    "chef": dict(r=4, lora_alpha=12, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"]),
}


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def peft_model(default_model_dir, tmp_path_factory):
    """transformers' Llama (fp32) with the three adapters, random non-zero A and B, each saved as a PEFT directory.
    Returns (peft model, {name: directory})."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    root = tmp_path_factory.mktemp("adapters")
    model, dirs = None, {}
    gen = torch.Generator().manual_seed(1234)
    for name, fields in ADAPTERS.items():
        cfg = LoraConfig(init_lora_weights=False, **fields)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=name)
        else:
            model.add_adapter(name, cfg)
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if f".{name}." in param_name and "lora_" in param_name:   # lora_A.<name>.weight / lora_B.<name>.weight
                    param.copy_(torch.randn(param.shape, generator=gen) * 0.04)
        model.save_pretrained(str(root), selected_adapters=[name])
        dirs[name] = str(root / name) if name != "default" else str(root)
        assert os.path.isfile(os.path.join(dirs[name], "adapter_model.safetensors")), os.listdir(root)
    model.eval()
    return model, dirs


@pytest.fixture(scope="module")
def requests_by_name(peft_model):
    _model, dirs = peft_model
    return {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(dirs.items(), start=1)}


@pytest.fixture(scope="module")
def lora_llm(default_model_dir):
    return LLM(enable_lora=True, max_loras=3, max_lora_rank=16)


def hf_greedy(model, tokenizer, prompts: list[str], num_tokens: int) -> list[list[int]]:
    """Greedy tokens from transformers' own forward: a left-padded batch, argmax token by token (KV cached)."""
    ids = [tokenizer.encode(p, add_special_tokens=True) for p in prompts]
    width = max(len(i) for i in ids)
    input_ids = torch.tensor([[0] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out_tokens: list[list[int]] = [[] for _ in ids]
    past = None
    with torch.no_grad():
        for _ in range(num_tokens):
            out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions, past_key_values=past,
                        use_cache=True)
            past = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1)
            for row, token in enumerate(nxt.tolist()):
                out_tokens[row].append(token)
            input_ids = nxt[:, None]
            positions = positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(len(ids), 1, dtype=mask.dtype)], dim=1)
    return out_tokens


def greedy(max_tokens=NUM_TOKENS):
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


# ----------------------------------------------------------------------------- equivalence
def test_each_adapter_matches_transformers_peft_in_one_mixed_batch(lora_llm, peft_model, requests_by_name):
    """12 prompts x (base + 3 adapters) in one generate() call, one LoRARequest per prompt: chef request's greedy
    tokens equal transformers + peft running that adapter alone (fp32)."""
    model, _dirs = peft_model
    tokenizer = lora_llm.tokenizer
    variants = [None, *requests_by_name]
    prompts = [p for _ in variants for p in PROMPTS]
    loras = [requests_by_name[v] if v else None for v in variants for _ in PROMPTS]
    outs = lora_llm.generate(prompts, greedy(), lora_request=loras)
    got = {v: [o.outputs[0].token_ids for o in outs[i * len(PROMPTS):(i + 1) * len(PROMPTS)]]
           for i, v in enumerate(variants)}
    with model.disable_adapter():
        base_ref = hf_greedy(model, tokenizer, PROMPTS, NUM_TOKENS)
    assert got[None] == base_ref
    for name in requests_by_name:
        model.set_adapter(name)
        ref = hf_greedy(model, tokenizer, PROMPTS, NUM_TOKENS)
        for prompt, mine, want in zip(PROMPTS, got[name], ref):
            assert mine == want, f"adapter {name!r}, prompt {prompt!r}: engine {mine}, transformers+peft {want}"
        changed = sum(a != b for a, b in zip(ref, base_ref))
        assert changed >= 3, f"adapter {name!r} changes only {changed} of {len(PROMPTS)} answers: too weak to test"
    stats = lora_llm.engine.scheduler.lora_slots
    assert stats.refs == [0] * 4, f"slots still held after generate(): {stats.refs}"


def test_chat_and_stream_take_a_lora_request(lora_llm, requests_by_name):
    lora = requests_by_name["chef"]
    messages = [{"role": "user", "content": "Name a fruit."}]
    chat = lora_llm.chat(messages, greedy(5), lora_request=lora)[0].outputs[0].token_ids
    ids = lora_llm.chat_token_ids(messages)
    direct = lora_llm.generate({"prompt_token_ids": ids}, greedy(5), lora_request=lora)[0].outputs[0].token_ids
    assert chat == direct
    base = lora_llm.chat(messages, greedy(5))[0].outputs[0].token_ids
    streamed = "".join(lora_llm.stream("The capital of France is", greedy(5), lora_request=lora))
    alone = lora_llm.generate("The capital of France is", greedy(5), lora_request=lora)[0].outputs[0].text
    assert streamed == alone
    assert base != chat, "the adapter changes the chat answer"


def test_parallel_sampling_forks_keep_the_adapter(lora_llm, requests_by_name):
    """n = 3 on an adapter: the forked continuations share the prompt's blocks and its adapter slot; continuation i
    equals a single request seeded seed + i on the same adapter."""
    chef = requests_by_name["chef"]
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=4, ignore_eos=True)
    prompt = SHARED + "Invent a dish."
    outs = lora_llm.generate(prompt, params, lora_request=chef)[0].outputs
    singles = lora_llm.generate([prompt] * 3, [SamplingParams(temperature=0.9, seed=11 + i, max_tokens=4,
                                                              ignore_eos=True) for i in range(3)], lora_request=chef)
    assert [o.token_ids for o in outs] == [s.outputs[0].token_ids for s in singles]
    assert lora_llm.engine.scheduler.num_forks >= 2 and lora_llm.engine.scheduler.lora_slots.refs == [0] * 4


SHARED = ("You are a careful assistant. Answer in one short sentence, and do not add anything else. "
          "The question follows after this line.\n")


def test_mixed_batch_with_chunked_prefill_and_prefix_caching_equals_each_request_alone(lora_llm, requests_by_name):
    """Continuous batching, paged KV, chunked prefill (24-token budget), prefix caching, only 2 adapter slots for 3
    adapters: chef request's tokens equal the same request run alone on the plain LoRA engine."""
    busy = lora_llm.with_levers(chunked_prefill=True, prefix_caching=True, max_num_batched_tokens=24, max_num_seqs=5,
                                max_loras=2)
    names = [None, "sql", "poet", "chef"]
    prompts, loras = [], []
    for i, question in enumerate(["Why is the sky blue?", "What is 2 + 2?", "Who wrote Hamlet?", "Where is Peru?"]):
        for j in range(2):
            name = names[(i + j) % len(names)]
            prompts.append(SHARED + question)   # the same prompt on two adapters: cached blocks must not mix
            loras.append(requests_by_name[name] if name else None)
    outs = busy.generate(prompts, greedy(5), lora_request=loras)
    for prompt, lora, out in zip(prompts, loras, outs):
        alone = lora_llm.generate(prompt, greedy(5), lora_request=lora)[0].outputs[0].token_ids
        assert out.outputs[0].token_ids == alone, f"{lora and lora.lora_name}: {prompt[-20:]!r}"
    slots = busy.engine.scheduler.lora_slots
    assert slots.refs == [0, 0, 0] and slots.num_evictions >= 1, (slots.refs, slots.num_evictions)
    assert not busy.engine.scheduler.running and not busy.engine.scheduler.waiting


def test_prefix_cache_is_shared_within_an_adapter_never_across(lora_llm, requests_by_name):
    cached = lora_llm.with_levers(prefix_caching=True)
    prompt = SHARED * 3 + "What is the boiling point of water?"
    sql, poet = requests_by_name["sql"], requests_by_name["poet"]
    first = cached.generate(prompt, greedy(3), lora_request=sql)[0]
    again = cached.generate(prompt, greedy(3), lora_request=sql)[0]
    other = cached.generate(prompt, greedy(3), lora_request=poet)[0]
    base = cached.generate(prompt, greedy(3))[0]
    assert first.metrics.num_cached_tokens == 0
    assert again.metrics.num_cached_tokens >= 32, "the same adapter reuses its own cached blocks"
    assert other.metrics.num_cached_tokens == 0 and base.metrics.num_cached_tokens == 0, \
        "another adapter (or the base model) must never read this adapter's KV blocks"
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.outputs[0].token_ids == lora_llm.generate(prompt, greedy(3), lora_request=poet)[0].outputs[0].token_ids


# ----------------------------------------------------------------------------- slots
def test_lru_eviction_with_two_slots_and_three_adapters(lora_llm, requests_by_name):
    two = lora_llm.with_levers(max_loras=2)
    slots = two.engine.scheduler.lora_slots
    sql, poet, chef = (requests_by_name[n] for n in ("sql", "poet", "chef"))
    want = {r.lora_int_id: lora_llm.generate("Water boils at", greedy(3), lora_request=r)[0].outputs[0].token_ids
            for r in (sql, poet, chef)}

    def run(request):
        out = two.generate("Water boils at", greedy(3), lora_request=request)[0].outputs[0].token_ids
        assert out == want[request.lora_int_id], f"{request.lora_name} after the slots were {slots.resident}"

    run(sql)
    run(poet)
    assert slots.resident == {sql.lora_int_id: 1, poet.lora_int_id: 2} and slots.num_evictions == 0
    run(sql)                     # sql is now the most recently used: poet is the victim
    run(chef)
    assert slots.resident == {sql.lora_int_id: 1, chef.lora_int_id: 2} and slots.num_evictions == 1
    run(poet)                      # evicts sql (least recently used), into its slot
    assert slots.resident == {poet.lora_int_id: 1, chef.lora_int_id: 2} and slots.num_evictions == 2
    assert slots.refs == [0, 0, 0]
    assert two.engine.runner.lora.resident[1:] == [poet.lora_int_id, chef.lora_int_id]
    # three adapters at once in two slots: the third waits for a slot a finished request gives back
    outs = two.generate(["Water boils at"] * 3, greedy(3), lora_request=[sql, poet, chef])
    assert [o.outputs[0].token_ids for o in outs] == [want[r.lora_int_id] for r in (sql, poet, chef)]
    assert slots.refs == [0, 0, 0]


def test_slot_table_is_plain_bookkeeping():
    from minillm.lora import LoRASlots

    slots = LoRASlots(2)
    assert slots.acquire(7) == 1 and slots.acquire(8) == 2 and slots.acquire(7) == 1
    assert slots.acquire(9) is None, "both slots are held: a third adapter waits"
    slots.release(2)
    assert slots.acquire(9) == 2 and slots.num_evictions == 1 and slots.resident == {7: 1, 9: 2}
    slots.release(2)
    with pytest.raises(ValueError, match="slot 2 is not held"):
        slots.release(2)


# ----------------------------------------------------------------------------- kernels
def random_segments(lengths_and_slots, gen):
    starts, lens, slots = [], [], []
    start = 0
    for length, slot in lengths_and_slots:
        starts.append(start)
        lens.append(length)
        slots.append(slot)
        start += length
    as_i32 = lambda v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    return start, as_i32(starts), as_i32(lens), as_i32(slots)


SEGMENT_CASES = {
    "prefill": [(37, 2), (5, 0), (19, 1)],                          # long segments, a base-model one between
    "decode": [(1, 3), (1, 1), (1, 0), (1, 3), (1, 2), (1, 1)],     # one token per sequence
    "mixed": [(1, 1), (1, 2), (23, 3), (2, 0), (17, 1)],            # decodes then prompt chunks
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(SEGMENT_CASES))
@pytest.mark.parametrize("in_features,rank,out_features", [(80, 5, 70), (96, 24, 33), (64, 16, 128)])
def test_sgmv_shrink_and_expand_match_the_gather_bmm_reference(dtype, case, in_features, rank, out_features):
    gen = torch.Generator().manual_seed(hash((case, in_features, rank)) % 2**31)
    num_tokens, starts, lens, seg_slots = random_segments(SEGMENT_CASES[case], gen)
    num_slots = 4
    x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
    a = (torch.randn(num_slots, rank, in_features, generator=gen) / in_features ** 0.5).to(dtype)
    b = torch.randn(num_slots, out_features, rank, generator=gen).to(dtype)
    a[0] = 0
    b[0] = 0
    token_slots = token_slots_from_segments(num_tokens, starts, lens, seg_slots)
    mid = sgmv_shrink(x, a, starts, lens, seg_slots, int(lens.max()))
    adapted = token_slots != 0
    want_mid = lora_shrink_reference(x, a, token_slots)
    # shrink's output is fp32 whatever the input dtype: the input dtype's tolerance applies
    err, allowed = max_error(mid[adapted], want_mid[adapted], {torch.float32: TOLERANCE[dtype]})
    assert err <= allowed, f"shrink {case} {dtype}: error {err} > {allowed}"
    # expand into a column slice of a wider output, as a fused q|k|v layer does
    y0 = torch.randn(num_tokens, out_features + 11, generator=gen).to(dtype)
    y = y0.clone()
    sgmv_expand(mid, b, y[:, 7:7 + out_features], starts, lens, seg_slots, int(lens.max()))
    want = y0.float()
    want[:, 7:7 + out_features] += lora_delta_reference(x, a, b, token_slots)
    err, allowed = max_error(y, want.to(dtype))
    assert err <= allowed, f"expand {case} {dtype}: error {err} > {allowed}"
    assert torch.equal(y[~adapted], y0[~adapted]), "tokens without an adapter (slot 0) must be left untouched"
    assert torch.equal(y[:, :7], y0[:, :7]) and torch.equal(y[:, 7 + out_features:], y0[:, 7 + out_features:])


def test_sgmv_launchers_refuse_bad_shapes():
    x = torch.randn(4, 32)
    a = torch.zeros(2, 8, 33)
    seg = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(ValueError, match="A \\[num_slots, rank, 32\\]"):
        sgmv_shrink(x, a, seg, seg + 4, seg + 1, 4)
    with pytest.raises(ValueError, match="seg_lens must be a 1-D int32"):
        sgmv_shrink(x, torch.zeros(2, 8, 32), seg, torch.tensor([4]), seg + 1, 4)


def test_torch_and_triton_paths_agree_on_fused_layers():
    """add_lora_delta on q|k|v (three slices, different widths) with a batch built by the runner's build_batch:
    the torch path (per adapter) and the Triton path (SGMV) both equal the gather + bmm reference per slice."""
    from minillm.layers.lora import LoRABatch, add_lora_delta, build_batch

    gen = torch.Generator().manual_seed(5)
    hidden, widths, r_max, num_slots = 48, [48, 16, 16], 8, 3

    class Weights:   # LoRAWeights' shape for one layer with one fused attribute
        targets = [{"qkv_proj": (hidden, [("q_proj", 0, 48), ("k_proj", 48, 16), ("v_proj", 64, 16)])}]
        max_rank = r_max
        a = [{"qkv_proj": torch.randn(num_slots, 3 * r_max, hidden, generator=gen) * 0.2}]
        b = [{"qkv_proj": [torch.randn(num_slots, w, r_max, generator=gen) for w in widths]}]

    for t in (Weights.a[0]["qkv_proj"], *Weights.b[0]["qkv_proj"]):
        t[0] = 0
    slots, query_lens = [2, 0, 1, 2, 2, 1], [9, 3, 1, 1, 20, 1]   # two runs of slot 2 merge into one segment
    x = torch.randn(sum(query_lens), hidden, generator=gen)
    y0 = torch.randn(sum(query_lens), sum(widths), generator=gen)
    results = {}
    for use_triton in (False, True):
        batch: LoRABatch = build_batch(Weights, slots, query_lens, torch.device("cpu"), use_triton)
        results[use_triton] = add_lora_delta(x, y0.clone(), batch, 0, "qkv_proj")
    assert batch.seg_lens.tolist() == [9, 1, 21, 1] and batch.seg_slots.tolist() == [2, 1, 2, 1]
    token_slots = batch.token_slots
    want = y0.clone()
    for i, (offset, width) in enumerate([(0, 48), (48, 16), (64, 16)]):
        a = Weights.a[0]["qkv_proj"][:, i * r_max:(i + 1) * r_max]
        want[:, offset:offset + width] += lora_delta_reference(x, a, Weights.b[0]["qkv_proj"][i], token_slots)
    for use_triton, got in results.items():
        err = (got - want).abs().max().item()
        assert err < 1e-4, f"{'triton' if use_triton else 'torch'} path: error {err}"


# ----------------------------------------------------------------------------- a tiny model, the Triton path
def write_adapter(path, num_layers, shapes: dict[str, tuple[int, int]], rank, alpha, gen, extra_keys=(),
                  **config_fields):
    """A PEFT directory written by hand (the format peft saves): adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    tensors = {}
    for layer in range(num_layers):
        for module, (out_features, in_features) in shapes.items():
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=gen) * 0.3
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=gen) * 0.3
    for key, tensor in extra_keys:
        tensors[key] = tensor
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": sorted(shapes),
              "bias": "none", "modules_to_save": None, "use_rslora": False, **config_fields}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return str(path)


TINY_SHAPES = {"q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
               "gate_proj": (128, 64), "up_proj": (128, 64), "down_proj": (64, 128)}


@pytest.fixture(scope="module")
def tiny_adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_adapters")
    gen = torch.Generator().manual_seed(3)
    return {
        "wide": write_adapter(root / "wide", 2, TINY_SHAPES, 12, 24, gen),
        "sql": write_adapter(root / "sql", 2, {k: TINY_SHAPES[k] for k in ("q_proj", "v_proj")}, 5, 10, gen),
    }


def test_tiny_engine_triton_path_equals_torch_path(tiny_adapters):
    """random:tiny-llama, attention_backend="triton" (so the LoRA delta runs the SGMV kernels, here in the
    interpreter) gives the torch path's greedy tokens on a mixed batch of two adapters and the base model."""
    torch_llm = LLM("random:tiny-llama", enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128)
    triton_llm = torch_llm.with_levers(attention_backend="triton")
    loras = [LoRARequest("wide", 1, tiny_adapters["wide"]), None, LoRARequest("sql", 2, tiny_adapters["sql"])]
    prompts = [{"prompt_token_ids": [5 + i, 17, 300, 41 + i, 9, 99][: 3 + i]} for i in range(3)]
    want = [o.outputs[0].token_ids for o in torch_llm.generate(prompts, greedy(5), lora_request=loras)]
    got = [o.outputs[0].token_ids for o in triton_llm.generate(prompts, greedy(5), lora_request=loras)]
    assert got == want
    base = [o.outputs[0].token_ids for o in torch_llm.generate(prompts, greedy(5))]
    assert base[0] != want[0] and base[2] != want[2], "the adapters must change the answers for this test to bite"
    assert base[1] == want[1]


def test_a_quantized_copy_of_a_lora_model_applies_the_adapters(tiny_adapters):
    """with_levers(weight_dtype="int8") quantizes a shallow copy whose linear layers are new modules: the adapters
    act on them too (else they would silently do nothing)."""
    fp32 = LLM("random:tiny-llama", enable_lora=True, max_loras=2, max_lora_rank=16, max_model_len=128)
    int8 = fp32.with_levers(weight_dtype="int8")
    wide = LoRARequest("wide", 1, tiny_adapters["wide"])
    prompts = [{"prompt_token_ids": [5, 17, 300, 41 + i]} for i in range(3)]
    for llm in (fp32, int8):
        base = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(5))]
        adapted = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(5), lora_request=wide)]
        assert base != adapted, f"{llm.config.weight_dtype}: the adapter changed nothing"
    assert type(int8.engine.model.layers[0].qkv_proj).__name__ == "Int8Linear"


# ----------------------------------------------------------------------------- bad input
def test_bad_adapters_are_refused_with_their_reason_and_the_engine_keeps_serving(lora_llm, default_llm,
                                                                                 tiny_adapters, tmp_path,
                                                                                 requests_by_name):
    gen = torch.Generator().manual_seed(9)
    hidden, intermediate = lora_llm.model_config.hidden_size, lora_llm.model_config.intermediate_size
    cases = [
        (LoRARequest("tiny", 41, tiny_adapters["wide"]), ["layers.0.down_proj", "lora_A (12, 128)",
                                                           f"({hidden}, {intermediate})", "another base model"]),
        (LoRARequest("big", 42, write_adapter(tmp_path / "big", 1, {"q_proj": (hidden, hidden)}, 32, 32, gen)),
         ["r=32", "max_lora_rank=16"]),
        (LoRARequest("gone", 43, str(tmp_path / "nowhere")), ["does not exist", "nowhere"]),
        (LoRARequest("emb", 44, write_adapter(tmp_path / "emb", 1, {"q_proj": (hidden, hidden)}, 4, 8, gen,
                                              extra_keys=[("base_model.model.model.embed_tokens.lora_A.weight",
                                                           torch.zeros(4, 10))])),
         ["embed_tokens", "not a LoRA A/B matrix"]),
        (LoRARequest("head", 45, write_adapter(tmp_path / "head", 1, {"q_proj": (hidden, hidden)}, 4, 8, gen,
                                               target_modules=["q_proj", "lm_head"])), ["lm_head", "not supported"]),
        (LoRARequest("save", 46, write_adapter(tmp_path / "save", 1, {"q_proj": (hidden, hidden)}, 4, 8, gen,
                                               modules_to_save=["lm_head"])), ["modules_to_save"]),
    ]
    nofile = tmp_path / "nofile"
    nofile.mkdir()
    (nofile / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}))
    cases.append((LoRARequest("nofile", 47, str(nofile)), ["adapter_model.safetensors is missing"]))
    for request, words in cases:
        with pytest.raises(ValueError) as info:
            lora_llm.generate(["Hi", "Ho"], greedy(2), lora_request=[None, request])
        for word in words:
            assert word in str(info.value), f"{request.lora_name}: {word!r} not in {info.value}"
    assert not lora_llm.engine.has_unfinished(), "a refused batch queues nothing"
    with pytest.raises(ValueError, match="enable_lora=True"):
        default_llm.generate("Hi", greedy(2), lora_request=requests_by_name["sql"])
    with pytest.raises(ValueError, match="already adapter 'sql'"):
        lora_llm.generate("Hi", greedy(2), lora_request=LoRARequest("impostor", 1, tiny_adapters["sql"]))
    with pytest.raises(ValueError, match="3 lora_requests for 2 prompts"):
        lora_llm.generate(["a", "b"], greedy(2), lora_request=[None] * 3)
    with pytest.raises(ValueError, match="lora_int_id=0 must be an integer >= 1"):
        LoRARequest("zero", 0, "/tmp")
    # still serving, adapters included
    ok = lora_llm.generate("Water boils at", greedy(2), lora_request=requests_by_name["poet"])
    assert ok[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("levers,words", [
    (dict(max_loras=0), ["max_loras=0", "[1, 64]"]),
    (dict(max_lora_rank=1000), ["max_lora_rank=1000", "[1, 256]"]),
    (dict(enable_lora="yes"), ["enable_lora='yes'", "True or False"]),
    (dict(enable_lora=True, speculative="ngram"), ["enable_lora=True with speculative='ngram'"]),
])
def test_lora_levers_are_validated(levers, words):
    from minillm import EngineConfig

    with pytest.raises(ValueError) as info:
        EngineConfig(**levers)
    for word in words:
        assert word in str(info.value)


# ----------------------------------------------------------------------------- server
def test_server_selects_adapters_by_model_name(lora_llm, requests_by_name, peft_model):
    import httpx

    from minillm.serve import serve_in_thread

    _model, dirs = peft_model
    prompt = "The three primary colors are"
    want = {name: lora_llm.generate(prompt, greedy(4), lora_request=requests_by_name[name] if name else None)[0]
            .outputs[0].text for name in (None, "sql", "chef")}
    # ids 1, 2, 3 in order: the ones this engine already knows these adapters by
    modules = [f"{name}={dirs[name]}" for name in ("sql", "poet", "chef")]
    with serve_in_thread(lora_llm, model_name="smollm2", lora_modules=modules) as server:
        listed = httpx.get(server.base_url + "/models").json()["data"]
        assert [(m["id"], m["parent"]) for m in listed] == [("smollm2", None), ("sql", "smollm2"),
                                                              ("poet", "smollm2"), ("chef", "smollm2")]
        assert listed[1]["root"] == dirs["sql"]
        for model, name in (("smollm2", None), ("sql", "sql"), ("chef", "chef")):
            r = httpx.post(server.base_url + "/completions", timeout=60,
                           json={"model": model, "prompt": prompt, "max_tokens": 4, "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want[name], model
            assert r.json()["model"] == model
        r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                       json={"model": "nope", "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code in (400, 404)
        message = r.json()["error"]["message"]
        assert '"nope"' in message and "smollm2" in message and "sql" in message and "chef" in message
    with pytest.raises(ValueError, match="must be name=path"):
        serve_in_thread(lora_llm, lora_modules=["justaname"])


def test_serve_cli_has_lora_modules_flag(capsys, tmp_path):
    from minillm.serve.cli import build_parser, main

    args = build_parser().parse_args(["--lora-modules", "a=/x", "b=/y", "--max-loras", "2"])
    assert args.lora_modules == ["a=/x", "b=/y"] and args.max_loras == 2
    # a bad adapter stops the server before it listens, naming it (--lora-modules implies --enable-lora)
    assert main(["--model", "random:tiny-llama", "--lora-modules", f"bad={tmp_path / 'none'}", "--port", "0"]) == 2
    assert "LoRA adapter 'bad'" in capsys.readouterr().err
    assert main(["--model", "random:tiny-llama", "--lora-modules", "a=/x", "--no-enable-lora"]) == 2
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err

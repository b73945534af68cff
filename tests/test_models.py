"""Tiny random Llama / Qwen2 / Mistral checkpoints built in code (no network): minillm's
logits and greedy tokens against transformers' own implementation of each architecture."""

from __future__ import annotations

import shutil

import pytest
import torch

from conftest import assert_engine_idle, tokenizer_files

from minillm import LLM, SamplingParams

VOCAB = 1000
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=None)

# name -> (config class name, overrides, prompt lengths)
MODELS = {
    "llama_gqa": ("LlamaConfig", dict(num_key_value_heads=2, num_hidden_layers=3, tie_word_embeddings=True), (1, 7, 33)),
    "llama_mqa_headdim80_untied": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=1, head_dim=80,
                                                      tie_word_embeddings=False), (5, 19)),
    "llama3_rope_scaling": ("LlamaConfig", dict(num_key_value_heads=2, rope_parameters=LLAMA3_ROPE), (9, 150, 300)),
    "llama_linear_rope": ("LlamaConfig", dict(rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
                          (3, 120)),
    "llama_biases": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True, num_key_value_heads=2), (4, 25)),
    "qwen2": ("Qwen2Config", dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                                  tie_word_embeddings=True), (2, 40)),
    "mistral": ("Mistral" "Config", dict(num_key_value_heads=1, sliding_window=64, head_dim=16), (6, 30)),
}

NEW_TOKENS = 10


def build_checkpoint(name: str, root, tokenizer_src: str):
    import transformers

    cls_name, overrides, _ = MODELS[name]
    cfg = getattr(transformers, cls_name)(**{**BASE, **overrides})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # HF initialises biases to 0 and norm weights to 1: randomise them so they are tested
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    path = root / name
    model.save_pretrained(path)
    for f in tokenizer_src:
        shutil.copy(f, path)
    return str(path), model.eval()


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request, tmp_path_factory, default_model_dir):
    name = request.param
    path, hf = build_checkpoint(name, tmp_path_factory.mktemp("tiny"), tokenizer_files(default_model_dir))
    gen = torch.Generator().manual_seed(len(name))
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in MODELS[name][2]]
    return name, path, hf, prompts


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """Plain greedy loop over full forwards (no generation config, no EOS handling)."""
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


def engine_logits(llm, prompts: list[list[int]]) -> torch.Tensor:
    """Next-token logits of a batch of prompts, through the engine's own model runner."""
    eng = llm.engine
    seqs = [eng.add_request(p, SamplingParams(max_tokens=1)) for p in prompts]
    try:
        scheduled, is_prefill = eng.scheduler.schedule()
        assert is_prefill and scheduled == seqs
        return eng.runner.logits(scheduled)
    finally:
        for s in seqs:
            eng.abort(s)


def test_model_config_is_read_correctly(tiny):
    name, path, hf, _ = tiny
    llm = LLM(path)
    mc, hc = llm.model_config, hf.config
    assert mc.num_layers == hc.num_hidden_layers and mc.num_kv_heads == hc.num_key_value_heads
    assert mc.head_dim == getattr(hc, "head_dim", None) or hc.hidden_size // hc.num_attention_heads
    assert mc.tie_word_embeddings == hc.tie_word_embeddings
    assert mc.num_params == sum(p.numel() for p in hf.parameters())
    assert llm.weight_bytes == 4 * mc.num_params
    if name == "llama3_rope_scaling":
        assert mc.rope_scaling["rope_type"] == "llama3" and mc.rope_theta == 500000.0
    if name == "mistral":
        assert llm.engine.max_model_len == 64     # kept inside the sliding window
    if name == "qwen2":
        assert mc.qkv_bias


@pytest.mark.parametrize("kv_cache", [True, False], ids=["kv_on", "kv_off"])
def test_logits_and_greedy_match_transformers(tiny, kv_cache):
    name, path, hf, prompts = tiny
    llm = LLM(path, kv_cache=kv_cache)
    # prefill logits of a batch of prompts of different lengths
    mine = engine_logits(llm, prompts)
    with torch.inference_mode():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in prompts])
    err = float((mine - ref).abs().max() / ref.abs().max())
    assert err < 1e-4, f"{name}: relative logit error {err:.2e}"
    # greedy decoding, all prompts in one batch
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for p, o in zip(prompts, outs):
        ref_tokens = hf_greedy(hf, p, NEW_TOKENS)
        assert o.outputs[0].token_ids == ref_tokens, f"{name}: prompt of {len(p)} tokens"
        assert o.outputs[0].finish_reason == "length"
    if kv_cache:
        assert_engine_idle(llm)


def test_positions_past_the_original_context_matter():
    """The scaled rope tables really differ from plain rope beyond the original context."""
    from minillm.layers.rotary import rope_inv_freq

    plain, _ = rope_inv_freq(16, 500000.0, None)
    llama3, _ = rope_inv_freq(16, 500000.0, LLAMA3_ROPE)
    linear, _ = rope_inv_freq(16, 10000.0, {"rope_type": "linear", "factor": 4.0})
    assert not torch.allclose(plain, llama3)
    assert torch.equal(llama3[0], plain[0])                      # high frequencies kept
    assert torch.allclose(llama3[-1], plain[-1] / 8.0)           # low frequencies slowed by factor
    torch.testing.assert_close(linear, rope_inv_freq(16, 10000.0, None)[0] / 4.0)
    with pytest.raises(ValueError, match="rope scaling type 'yarn' is not supported"):
        rope_inv_freq(16, 10000.0, {"rope_type": "yarn", "factor": 2.0})


def test_bfloat16_smoke(tmp_path, default_model_dir):
    """bf16 runs, gives logits close to fp32 and mostly the same greedy tokens (not asserted exactly)."""
    path, hf = build_checkpoint("llama_gqa", tmp_path, tokenizer_files(default_model_dir))
    prompts = [[5, 17, 300, 42], [7] * 20, list(range(100, 160))]
    f32, bf16 = LLM(path), LLM(path, dtype="bfloat16")
    assert bf16.engine.dtype == torch.bfloat16
    assert bf16.model_config.kv_bytes_per_token(2) * 2 == f32.model_config.kv_bytes_per_token(4)
    assert bf16.weight_bytes * 2 == f32.weight_bytes
    a, b = engine_logits(f32, prompts), engine_logits(bf16, prompts)
    assert b.dtype == torch.float32 and torch.isfinite(b).all()
    err = float((a - b).abs().max() / a.abs().max())
    assert 0 < err < 0.1, err
    p = SamplingParams(max_tokens=8, ignore_eos=True)
    ta = [o.outputs[0].token_ids for o in f32.generate([{"prompt_token_ids": q} for q in prompts], p)]
    tb = [o.outputs[0].token_ids for o in bf16.generate([{"prompt_token_ids": q} for q in prompts], p)]
    assert all(len(t) == 8 and all(0 <= x < VOCAB for x in t) for t in tb)
    assert sum(x[0] == y[0] for x, y in zip(ta, tb)) >= 2    # first tokens mostly agree
    assert_engine_idle(bf16)

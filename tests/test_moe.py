"""Mixture of experts (Mixtral, Qwen2-MoE): the engine against transformers token for token, the fused-MoE
Triton kernel against its torch reference (interpreter, odd shapes), routing against transformers' routers,
expert statistics, quantized experts, and the bytes-per-step model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kernel_utils import TOLERANCE, max_error  # first: picks the interpreter before triton is imported
from conftest import assert_engine_idle, tokenizer_files

from minillm import LLM, SamplingParams
from minillm.layers.context import ForwardContext
from minillm.kernels import fused_moe as fm
from minillm.models.moe import decode_step_bytes, expected_experts_touched, route
from minillm.models.presets import preset_config
from minillm.quant import quantize_int8

VOCAB = 1000
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=None, tie_word_embeddings=False)
# name -> (config class, overrides): top-2 and top-1 Mixtral (GQA, MQA), Qwen2-MoE with a shared expert,
# top-k not renormalised and a dense layer (mlp_only_layers), and one renormalised with decoder_sparse_step 2.
MODELS = {
    "mixtral": ("MixtralConfig", dict(num_hidden_layers=2, intermediate_size=48, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "mixtral_top1_mqa": ("MixtralConfig", dict(num_hidden_layers=2, intermediate_size=40, num_local_experts=5,
                                               num_experts_per_tok=1, num_key_value_heads=1, hidden_size=48,
                                               num_attention_heads=3)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_hidden_layers=3, intermediate_size=96, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=56, num_experts=6, num_experts_per_tok=2,
                                         norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen2_moe_norm_step2": ("Qwen2MoeConfig", dict(num_hidden_layers=2, intermediate_size=80, moe_intermediate_size=24,
                                                    shared_expert_intermediate_size=32, num_experts=5,
                                                    num_experts_per_tok=3, norm_topk_prob=True, decoder_sparse_step=2)),
}
PROMPT_LENGTHS = (3, 9, 40)
NEW_TOKENS = 8


def build_checkpoint(name: str, root, tokenizer_src) -> tuple[str, torch.nn.Module]:
    import transformers

    cls_name, overrides = MODELS[name]
    cfg = getattr(transformers, cls_name)(**{**BASE, **overrides})
    torch.manual_seed(sum(map(ord, name)))
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():   # HF starts biases at 0 and norms at 1: randomise them so they are tested
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


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(n):
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, default_model_dir):
    """Every MODELS checkpoint (saved once), with transformers' model, prompts and its greedy continuations."""
    root, tok = tmp_path_factory.mktemp("moe"), tokenizer_files(default_model_dir)
    out = {}
    for name in MODELS:
        path, hf = build_checkpoint(name, root, tok)
        gen = torch.Generator().manual_seed(len(name))
        prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
        out[name] = (path, hf, prompts, [hf_greedy(hf, p, NEW_TOKENS) for p in prompts])
    return out


def generate(llm, prompts, n=NEW_TOKENS):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=n, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


# ---------------------------------------------------------------- the engine vs transformers
@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_matches_transformers(checkpoints, name):
    """fp32, torch dispatch: the batch of prompts decoded together (continuous batching, paged KV), then again
    with chunked prefill in chunks of 16 tokens; the parameter count and the prefill logits too."""
    path, hf, prompts, want = checkpoints[name]
    llm = LLM(path)
    assert llm.model_config.num_params == sum(p.numel() for p in hf.parameters())
    assert llm.weight_bytes == 4 * llm.model_config.num_params
    assert generate(llm, prompts) == want
    assert_engine_idle(llm)
    chunked = LLM(path, chunked_prefill=True, max_num_batched_tokens=16)
    assert generate(chunked, prompts) == want
    assert any(s.kind == "mixed" for s in chunked.engine.stats.steps), "no step mixed a prompt chunk with decodes"
    assert_engine_idle(chunked)


def test_triton_dispatch_in_the_engine_matches_transformers(checkpoints, monkeypatch):
    """attention_backend="triton" runs the MoE layers through the fused kernel (interpreter): same tokens."""
    path, hf, prompts, want = checkpoints["mixtral"]
    calls = []
    kernel = fm.fused_moe
    monkeypatch.setattr(fm, "fused_moe", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    llm = LLM(path, attention_backend="triton")
    assert generate(llm, prompts[:2], 4) == [w[:4] for w in want[:2]]
    assert calls, "the Triton engine did not call the fused-MoE kernel"


def test_stacked_expert_checkpoint_loads(checkpoints, tmp_path):
    """transformers 5 keeps experts stacked (experts.gate_up_proj [E, 2I, H]); a checkpoint saved that way
    loads to the same model."""
    from safetensors.torch import save_file

    path, hf, prompts, want = checkpoints["qwen2_moe"]
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in state)
    save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(f"{path}/config.json", tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{path}/{f}", tmp_path)
    assert generate(LLM(str(tmp_path)), prompts[:1]) == want[:1]


def test_unsupported_configs_are_refused(checkpoints, tmp_path):
    path = checkpoints["qwen2_moe"][0]
    for key, value, match in (("shared_expert_intermediate_size", 0, "shared_expert_intermediate_size=0"),
                              ("num_experts_per_tok", 7, r"num_experts_per_tok=7 must be in \[1, num_experts=6\]"),
                              ("mlp_only_layers", [5], r"mlp_only_layers=\[5\]")):
        bad = tmp_path / key
        shutil.copytree(path, bad)
        cfg = json.loads((bad / "config.json").read_text())
        cfg[key] = value
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=match):
            LLM(str(bad))
    with pytest.raises(ValueError, match="weight_calibration='awq' is not supported for mixture-of-experts"):
        LLM("random:tiny-mixtral", weight_dtype="int8", weight_calibration="awq")


# ---------------------------------------------------------------- routing
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen2_moe_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routing_matches_transformers_router(family, dtype):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    gen = torch.Generator().manual_seed(7)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=40, num_local_experts=7, num_experts_per_tok=3)
        router, normalize, in_logits_dtype = MixtralTopKRouter(cfg), True, False
    else:
        cfg = transformers.Qwen2MoeConfig(hidden_size=40, num_experts=7, num_experts_per_tok=3,
                                          norm_topk_prob=family == "qwen2_moe_norm")
        router, normalize, in_logits_dtype = Qwen2MoeTopKRouter(cfg), family == "qwen2_moe_norm", True
    with torch.no_grad():
        router.weight.copy_(0.1 * torch.randn(7, 40, generator=gen))
    router = router.to(dtype)
    x = torch.randn(53, 40, generator=gen).to(dtype)
    _, want_w, want_ids = router(x)
    got_w, got_ids = route(torch.nn.functional.linear(x, router.weight), 3, normalize, in_logits_dtype)
    assert torch.equal(got_ids, want_ids)
    assert got_w.dtype == want_w.dtype == (dtype if in_logits_dtype else torch.float32)
    torch.testing.assert_close(got_w, want_w, rtol=0, atol=0)
    sums = got_w.float().sum(-1)
    if normalize:
        torch.testing.assert_close(sums, torch.ones_like(sums), rtol=0, atol=1e-2)
    else:   # the top 3 of 7 probabilities, as they are
        assert (sums < 0.999).all(), sums.max()


# ---------------------------------------------------------------- the kernel
def _moe_inputs(num_tokens, num_experts, top_k, hidden, inter, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter ** -0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    weights, ids = route(logits, top_k, True, False)
    return x, w13, w2, weights, ids


# (tokens, experts, top_k, hidden, intermediate): none a multiple of a tile; 1 token; more experts than pairs;
# 150 tokens take BLOCK_M 64; the first case routes nothing to some experts.
KERNEL_SHAPES = [(1, 5, 1, 33, 17), (7, 3, 2, 40, 24), (37, 7, 3, 72, 56), (13, 9, 2, 48, 40), (150, 3, 2, 24, 20)]


@pytest.mark.parametrize("shape", KERNEL_SHAPES, ids=lambda s: "T{}-E{}-k{}-H{}-I{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fused_moe_matches_reference(shape, dtype):
    x, w13, w2, weights, ids = _moe_inputs(*shape, dtype, seed=sum(shape))
    got = fm.fused_moe(x, w13, w2, weights, ids)
    want = fm.fused_moe_reference(x, w13, w2, weights, ids)
    err, allowed = max_error(got, want, {**TOLERANCE, torch.float32: 1e-5})
    assert got.dtype == dtype and err <= allowed, f"fused_moe {shape} {dtype}: max error {err} > {allowed}"


@pytest.mark.parametrize("shape", KERNEL_SHAPES[1:4], ids=lambda s: "T{}-E{}-k{}-H{}-I{}".format(*s))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_int8_experts_match_reference(shape, dtype):
    x, w13, w2, weights, ids = _moe_inputs(*shape, torch.float32, seed=sum(shape) + 1)
    parts13 = [quantize_int8(w) for w in w13]
    parts2 = [quantize_int8(w) for w in w2]
    q13, s13 = torch.stack([q for q, _ in parts13]), torch.stack([s for _, s in parts13])
    q2, s2 = torch.stack([q for q, _ in parts2]), torch.stack([s for _, s in parts2])
    x = x.to(dtype)
    got = fm.fused_moe(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    want = fm.fused_moe_reference(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    err, allowed = max_error(got, want, {**TOLERANCE, torch.float32: 1e-5})
    assert err <= allowed, f"int8 fused_moe {shape} {dtype}: max error {err} > {allowed}"


@pytest.mark.parametrize("shape,group", [(KERNEL_SHAPES[1], 16), (KERNEL_SHAPES[2], 32), (KERNEL_SHAPES[3], 32)],
                         ids=["T7-E3-k2-H40-I24-g16", "T37-E7-k3-H72-I56-g32", "T13-E9-k2-H48-I40-g32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_int4_experts_match_reference(shape, group, dtype):
    """int4 experts in groups (H and I padded up to the group where they are not multiples of it)."""
    from minillm.quant import pack_int4, quantize_int4

    x, w13, w2, weights, ids = _moe_inputs(*shape, torch.float32, seed=sum(shape) + 2)

    def int4(w):
        parts = [quantize_int4(torch.nn.functional.pad(m, (0, (-m.shape[1]) % group)), group) for m in w]
        return fm.ExpertWeights(torch.stack([pack_int4(q) for q, _, _ in parts]), torch.stack([s for _, s, _ in parts]),
                                torch.stack([z for _, _, z in parts]), group)

    x = x.to(dtype)
    got = fm.fused_moe(x, int4(w13), int4(w2), weights, ids)
    want = fm.fused_moe_reference(x, int4(w13), int4(w2), weights, ids)
    err, allowed = max_error(got, want, {**TOLERANCE, torch.float32: 1e-5})
    assert err <= allowed, f"int4 fused_moe {shape} g{group} {dtype}: max error {err} > {allowed}"
    with pytest.raises(ValueError, match="must be padded to a multiple of group_size"):
        fm.fused_moe(x, int4(w13)._replace(group_size=group // 2 + 1), int4(w2), weights, ids)


def test_moe_align_groups_pairs_by_expert():
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_experts, top_k, block_m = 29, 6, 2, 16
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    ids[ids == 4] = 0   # expert 4 gets nothing
    ids[:, 1] = torch.where(ids[:, 0] == 0, 1, ids[:, 1])   # keep each token's two experts distinct
    sorted_ids, tiles, counts = fm.moe_align(ids, num_experts, block_m)
    num_pairs = num_tokens * top_k
    assert counts.tolist() == torch.bincount(ids.flatten(), minlength=num_experts).tolist()
    assert sorted(sorted_ids[sorted_ids < num_pairs].tolist()) == list(range(num_pairs))   # every pair once
    flat = ids.flatten()
    for t, expert in enumerate(tiles.tolist()):
        tile = sorted_ids[t * block_m:(t + 1) * block_m]
        real = tile[tile < num_pairs].long()
        if expert < 0:
            assert real.numel() == 0, f"tile {t} past the last run holds pairs"
        else:
            assert real.numel() > 0 and (flat[real] == expert).all(), f"tile {t} mixes experts"
    assert (tiles >= 0).sum().item() == sum(-(-c // block_m) for c in counts.tolist())


def test_fused_moe_rejects_bad_inputs():
    x, w13, w2, weights, ids = _moe_inputs(4, 3, 2, 16, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="do not match"):
        fm.fused_moe(x[:, :15], w13, w2, weights, ids)
    with pytest.raises(ValueError, match=r"int8 w13 \[E, 16, 16\] needs its scale \[E, 16\]"):
        fm.fused_moe(x, w13.to(torch.int8), w2.to(torch.int8), weights, ids)
    with pytest.raises(ValueError, match="must both be"):
        fm.fused_moe(x, w13, w2, weights[:, :1], ids)


# ---------------------------------------------------------------- statistics and bytes
def test_expert_stats_sum_to_routed_tokens():
    cfg = preset_config("random:tiny-mixtral")
    llm = LLM("random:tiny-mixtral", max_num_seqs=8)
    prompts = [list(range(3 + i, 10 + 2 * i)) for i in range(5)] + [[7]]
    generate(llm, prompts, 6)
    stats = llm.engine.stats
    assert stats.steps and all(s.expert_tokens is not None for s in stats.steps)
    for step in stats.steps:
        assert len(step.expert_tokens) == cfg.num_moe_layers
        for layer in step.expert_tokens:   # every token fed chose top_k experts in every MoE layer
            assert len(layer) == cfg.num_experts and sum(layer) == step.num_tokens * cfg.num_experts_per_tok
        touched = step.experts_touched
        assert all(min(cfg.num_experts_per_tok, 1) <= n <= min(cfg.num_experts, step.num_tokens * 2) for n in touched)
        if step.num_tokens == 1:   # one token reads exactly its top_k distinct experts
            assert touched == [cfg.num_experts_per_tok] * cfg.num_moe_layers
    total = stats.expert_tokens_total()
    assert sum(map(sum, total)) == sum(s.num_tokens for s in stats.steps) * cfg.num_moe_layers * cfg.num_experts_per_tok
    decode = [s for s in stats.steps if s.kind == "decode"]
    assert stats.mean_experts_touched("decode") == pytest.approx(
        sum(sum(s.experts_touched) / len(s.experts_touched) for s in decode) / len(decode))
    dense = LLM("random:tiny-llama")
    generate(dense, [[5, 6, 7]], 2)
    assert all(s.expert_tokens is None for s in dense.engine.stats.steps)


def test_expected_experts_touched_and_decode_bytes():
    # the formula against sampling top-k of E without replacement
    gen = torch.Generator().manual_seed(0)
    for experts, top_k, batch in ((8, 2, 1), (8, 2, 4), (8, 2, 16), (60, 4, 8)):
        picks = torch.rand(4000, batch, experts, generator=gen).argsort(-1)[..., :top_k]
        hit = torch.zeros(4000, experts, dtype=torch.bool).scatter_(1, picks.reshape(4000, -1), True)
        measured = hit.sum(1).float().mean().item()
        assert expected_experts_touched(experts, top_k, batch) == pytest.approx(measured, rel=0.02)
    assert expected_experts_touched(8, 2, 1) == 2 and expected_experts_touched(8, 2, 256) == pytest.approx(8)
    with pytest.raises(ValueError, match="top_k=9"):
        expected_experts_touched(8, 9, 1)
    cfg = preset_config("mixtral-8x7b")
    assert cfg.num_params == pytest.approx(46.7e9, rel=0.01) and cfg.num_active_params == pytest.approx(12.9e9, rel=0.01)
    embed = cfg.vocab_size * cfg.hidden_size   # an untied table: decode reads the batch's rows only
    one = decode_step_bytes(cfg, 1, bytes_per_param=2)
    assert one["total"] == 2 * (cfg.num_active_params - embed + cfg.hidden_size)
    full = decode_step_bytes(cfg, 1, bytes_per_param=2, experts_touched=cfg.num_experts)
    assert full["total"] == 2 * (cfg.num_params - embed + cfg.hidden_size)
    big = decode_step_bytes(cfg, 64, context_len=100, bytes_per_param=2)
    assert big["experts_touched_per_layer"] > 7.99 and big["kv"] == 64 * 100 * cfg.kv_bytes_per_token(2)
    dense = decode_step_bytes(preset_config("llama-3-8b"), 4)
    assert dense["experts"] == 0 and dense["experts_touched_per_layer"] == 0


# ---------------------------------------------------------------- quantized experts
# Relative error of a MoE block's output (routed experts + the shared expert) with its experts quantized,
# on random hidden states: per-channel int8 rounds each weight by at most 1/254 of its row's largest, which
# measures ~1% through the two matmuls; int4 in groups of 32, 1/30 of each group's range: ~14%.
BLOCK_ERROR = {"int8": 0.02, "int4": 0.2}


@pytest.mark.parametrize("weight_dtype", ["int8", "int4"])
def test_quantized_experts_stay_close_to_fp32(checkpoints, weight_dtype):
    from minillm.models.moe import QuantizedExperts

    path, hf, prompts, want = checkpoints["qwen2_moe"]
    fp32 = LLM(path)
    quant = fp32.with_levers(weight_dtype=weight_dtype, weight_group_size=32)
    assert quant.weight_bytes < fp32.weight_bytes / 2
    x = torch.randn(64, fp32.model_config.hidden_size, generator=torch.Generator().manual_seed(0))
    pairs = [(a.moe, b.moe) for a, b in zip(fp32.engine.runner.model.layers, quant.engine.runner.model.layers)
             if a.moe is not None]
    assert len(pairs) == 2
    for float_block, block in pairs:
        assert isinstance(block.experts, QuantizedExperts) and block.experts.weight_dtype == weight_dtype
        for e in range(block.num_experts):   # each dequantized matrix within half a quantization step
            for got, ref in zip(block.experts.expert(e, torch.float32), float_block.experts.expert(e, torch.float32)):
                if weight_dtype == "int8":
                    step = ref.abs().amax(dim=1, keepdim=True) / 127
                else:
                    groups = ref.reshape(ref.shape[0], -1, 32) if ref.shape[1] % 32 == 0 else None
                    step = (groups.amax(-1) - groups.amin(-1)).repeat_interleave(32, 1) / 15 if groups is not None \
                        else (ref.amax(1, True).clamp(min=0) - ref.amin(1, True).clamp(max=0)) / 15   # zero-padded group
                assert ((got - ref).abs() <= step / 2 + 1e-6).all(), f"expert {e}: an element off by more than half a step"
        want_out, got_out = float_block(x), block(x)
        err = float((got_out - want_out).norm() / want_out.norm())
        assert 0 < err < BLOCK_ERROR[weight_dtype], f"{weight_dtype} MoE block: relative error {err:.4f}"
        # the Triton kernel reads the experts as stored (interpreter): the same as dequantizing them
        triton_ops = ForwardContext(meta=None, ops="triton")
        torch.testing.assert_close(block(x, triton_ops), got_out, rtol=1e-4, atol=1e-5)
    outs = generate(quant, prompts, 4)   # and the engine runs it
    assert all(len(o) == 4 for o in outs)
    if weight_dtype == "int8":   # next-token log-probabilities of the whole int8 model within 0.1 of fp32
        seqs = [{"prompt_token_ids": p} for p in prompts]
        a = [o.outputs[0].logprobs[0] for o in fp32.generate(seqs, SamplingParams(max_tokens=1, logprobs=20))]
        b = [o.outputs[0].logprobs[0] for o in quant.generate(seqs, SamplingParams(max_tokens=1, logprobs=20))]
        diffs = [abs(x[t].logprob - y[t].logprob) for x, y in zip(a, b) for t in x if t in y]
        assert len(diffs) >= 30 and 0 < max(diffs) < 0.1, f"int8: log-probabilities moved by up to {max(diffs):.4f}"


# ---------------------------------------------------------------- the benchmark
def test_bench_moe_tables():
    """python -m minillm.bench.moe's numbers: at batch 1 the MoE reads what a dense model of its active size
    reads, from batch 32 on what one of its total size reads; the CPU run counts top_k experts at batch 1."""
    from minillm.bench import moe as bench

    rows = {r["batch"]: r for r in bench.model_h100(batches=(1, 4, 32))}
    assert rows[1]["moe_tok_s"] == pytest.approx(rows[1]["dense_active_tok_s"])
    assert rows[1]["moe_tok_s"] / rows[1]["dense_total_tok_s"] == pytest.approx(3.6, abs=0.1)
    assert rows[32]["moe_tok_s"] == pytest.approx(rows[32]["dense_total_tok_s"], rel=1e-3)
    assert rows[1]["moe_tok_s"] < rows[4]["moe_tok_s"] < rows[32]["moe_tok_s"]
    measured = {r["batch"]: r for r in bench.measure_cpu(batches=(1, 6), prompt_len=4, tokens=3)}
    assert measured[1]["experts_touched"] == 2 and measured[1]["steps"] == 2
    assert 2 < measured[6]["experts_touched"] <= 8 and measured[6]["bytes"] > measured[1]["bytes"]

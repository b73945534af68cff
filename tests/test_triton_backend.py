"""attention_backend="triton": the engine runs store_kv + paged decode / extend attention
kernels, and the model's RMSNorm (residual add fused), rotary and SiLU-and-mul as Triton
kernels (in Triton's interpreter on a CPU), and must produce the torch backend's tokens."""

from collections import Counter

import pytest

import kernel_utils  # noqa: F401  first: picks the interpreter before triton is imported
from conftest import assert_engine_idle, tokenizer_files
from test_models import build_checkpoint

from minillm import LLM, SamplingParams
from minillm.kernels import activation, rmsnorm, rotary

PROMPTS = [[5, 17, 99, 3, 250, 42, 7] * 5, [11], [300, 301, 302, 303, 304], list(range(100, 160))]
PARAMS = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 9, 4, 7)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, default_model_dir):
    path, _ = build_checkpoint("llama_gqa", tmp_path_factory.mktemp("tiny"), tokenizer_files(default_model_dir))
    return path


@pytest.fixture(scope="module")
def torch_tokens(tiny_model):
    llm = LLM(tiny_model, max_num_seqs=1)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)]


@pytest.fixture
def launches(monkeypatch):
    """Counts the calls of the model's Triton op launchers: rmsnorm (and with a residual), rotary, silu_and_mul."""
    counts = Counter()

    def counting(module, name, key):
        launcher = getattr(module, name)

        def wrapped(*args, **kwargs):
            counts[key] += 1
            if key == "rmsnorm" and kwargs.get("residual") is not None:
                counts["rmsnorm+residual"] += 1
            return launcher(*args, **kwargs)

        monkeypatch.setattr(module, name, wrapped)

    counting(rmsnorm, "rmsnorm", "rmsnorm")
    counting(rotary, "rotary_embedding", "rotary")
    counting(activation, "silu_and_mul", "silu_and_mul")
    return counts


def assert_model_ops_ran_as_triton(counts: Counter, num_layers: int) -> None:
    """Every forward: one rotary and one SiLU-and-mul per layer, two norms per layer plus the final
    one, all of them but the first layer's input norm with the residual add fused."""
    forwards = counts["rotary"] // num_layers
    assert forwards > 0, f"the Triton rotary kernel never ran: {dict(counts)}"
    assert counts == Counter({"rotary": forwards * num_layers, "silu_and_mul": forwards * num_layers,
                              "rmsnorm": forwards * (2 * num_layers + 1),
                              "rmsnorm+residual": forwards * 2 * num_layers}), dict(counts)


@pytest.mark.parametrize("levers", [
    dict(),
    dict(paged=True, block_size=16),
    dict(paged=True, block_size=32, chunked_prefill=True, max_num_batched_tokens=24),
    dict(paged=False, chunked_prefill=True, max_num_batched_tokens=13, batching="static", max_num_seqs=2),
])
def test_triton_backend_matches_torch_backend(tiny_model, torch_tokens, launches, levers):
    llm = LLM(tiny_model, attention_backend="triton", **levers)
    assert llm.engine.runner.backend.name == "triton"
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == torch_tokens
    assert_model_ops_ran_as_triton(launches, llm.engine.model.cfg.num_layers)
    kinds = {s.kind for s in llm.stats.steps}
    assert "decode" in kinds and kinds & {"prefill", "mixed"}, kinds  # both kernels ran
    assert_engine_idle(llm)


def test_torch_backend_uses_no_triton_op_even_after_a_triton_engine(tiny_model, torch_tokens, launches):
    """Engines sharing one model's weights: each runs its own ops (they come with each pass's ForwardContext)."""
    triton_llm = LLM(tiny_model, attention_backend="triton")
    torch_llm = triton_llm.with_levers(attention_backend="torch")
    prompts, params = [{"prompt_token_ids": PROMPTS[1]}], [PARAMS[1]]
    assert triton_llm.generate(prompts, params)[0].outputs[0].token_ids == torch_tokens[1]
    assert launches["rotary"] > 0
    launches.clear()
    assert torch_llm.generate(prompts, params)[0].outputs[0].token_ids == torch_tokens[1]
    assert not launches, f"the torch backend ran Triton ops: {dict(launches)}"
    assert triton_llm.generate(prompts, params)[0].outputs[0].token_ids == torch_tokens[1]
    assert_model_ops_ran_as_triton(launches, triton_llm.engine.model.cfg.num_layers)


def test_triton_backend_needs_the_cache():
    from minillm import EngineConfig

    with pytest.raises(ValueError, match="attention_backend='triton' needs kv_cache=True"):
        EngineConfig(attention_backend="triton", kv_cache=False)


def test_a_rotated_norm_rotates_the_triton_kernels_output_too():
    """RMSNorm.rotation (weight_calibration="gptq", test_rotate.py) applies on both paths."""
    import torch

    from minillm.layers.norm import RMSNorm
    from minillm.quant.rotate import hadamard

    g = torch.Generator().manual_seed(5)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64, generator=g)
    norm.rotation = hadamard(32)
    x, residual = torch.randn(3, 64, generator=g), torch.randn(3, 64, generator=g)
    want = norm(x), *norm.add_and_norm(x, residual.clone())
    got = norm(x, "triton"), *norm.add_and_norm(x, residual.clone(), "triton")
    for a, b in zip(got, want):
        assert torch.allclose(a, b, atol=1e-5)
    norm.rotation = None
    assert not torch.allclose(norm(x), want[0], atol=1e-2)

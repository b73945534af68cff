"""attention_backend="triton": the engine runs store_kv + paged decode / extend attention
kernels (in Triton's interpreter on a CPU) and must produce the torch backend's tokens."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # choose the interpreter before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import assert_engine_idle, tokenizer_files  # noqa: E402
from test_models import build_checkpoint  # noqa: E402

from minillm import LLM, SamplingParams  # noqa: E402

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


@pytest.mark.parametrize("levers", [
    dict(),
    dict(paged=True, block_size=16),
    dict(paged=True, block_size=32, chunked_prefill=True, max_num_batched_tokens=24),
    dict(paged=False, chunked_prefill=True, max_num_batched_tokens=13, batching="static", max_num_seqs=2),
])
def test_triton_backend_matches_torch_backend(tiny_model, torch_tokens, levers):
    llm = LLM(tiny_model, attention_backend="triton", **levers)
    assert llm.engine.runner.backend.name == "triton"
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    assert [o.outputs[0].token_ids for o in outs] == torch_tokens
    kinds = {s.kind for s in llm.stats.steps}
    assert "decode" in kinds and kinds & {"prefill", "mixed"}, kinds  # both kernels ran
    assert_engine_idle(llm)


def test_triton_backend_needs_the_cache():
    from minillm import EngineConfig

    with pytest.raises(ValueError, match="attention_backend='triton' needs kv_cache=True"):
        EngineConfig(attention_backend="triton", kv_cache=False)

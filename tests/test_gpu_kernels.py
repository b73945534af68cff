"""On a CUDA GPU: every Triton kernel against its torch reference at real model shapes, and the
engine end to end (the Triton backend's greedy tokens are the torch backend's; CUDA graphs on
give the tokens of graphs off).

    pytest -m gpu                                  # on a machine with a GPU: Llama-3-8B, SmolLM2-135M and
                                                   # an MQA head_dim-80 model's shapes, fp32 / bf16 / fp16
    MINILLM_GPU_SHAPES=quick pytest -m gpu         # Llama-3-8B's shapes only
    MINILLM_GPU_TESTS_INTERPRET=1 pytest tests/test_gpu_kernels.py   # no GPU: tiny shapes, Triton's interpreter

Every test here but the last is marked gpu, and conftest.py skips them without CUDA (with the
reason), so the CPU suite only lists them; the last checks, on any machine, that each kernel
module has a case. A case the card cannot run (bf16 below sm_80, fp8 KV below sm_89, the fp8 matmuls below
sm_90) is skipped with minillm.hardware.GPU_FEATURES' reason. The cases (inputs, references,
tolerances) live in kernel_utils.py; scripts/gpu_check.py runs this file as its check section and
prints the rows (kernel, dtype, shape, max error, bound) in its report.
"""

from pathlib import Path

import pytest
import torch

import kernel_utils as ku  # first: picks the interpreter before triton is imported

gpu = pytest.mark.gpu
SHAPE_SET_NAME, SHAPES = ku.gpu_shape_set()
KERNELS_DIR = Path(__file__).resolve().parent.parent / "minillm" / "kernels"


def describe(record_property, kernel: str, dtype: str, shape: str) -> str:
    """The row scripts/gpu_check.py prints for this test (record_property lands in its JUnit XML)."""
    for name, value in (("kernel", kernel), ("dtype", dtype), ("shape", shape)):
        record_property(name, value)
    return f"{kernel} {dtype} {shape}"


# ---------------------------------------------------------------- kernels vs references
@gpu
@pytest.mark.parametrize("model", SHAPES.models)
@pytest.mark.parametrize("dtype", SHAPES.dtypes)
@pytest.mark.parametrize("kernel", list(ku.GPU_KERNEL_CASES))
def test_kernel_matches_reference(kernel, dtype, model, record_property):
    case = ku.GPU_KERNEL_CASES[kernel]
    shape = ku.GPU_MODEL_SHAPES[model]
    what = describe(record_property, kernel, dtype, ku.shape_label(case, shape, SHAPES.seq_len))
    ku.skip_unless_gpu_has(*case.needs, *(("bf16",) if dtype == "bf16" else ()))
    gen = torch.Generator().manual_seed(sum(map(ord, f"{kernel}/{dtype}/{model}")))  # fresh per case, reproducible
    result = case.run(shape, ku.GPU_DTYPES[dtype], SHAPES.seq_len, ku.DEVICE, gen)
    ku.assert_compared(result, what, record_property)


QUANT_CASES = [pytest.param(kind, m, id=f"{kind.replace(' ', '')}-M{m}")
               for m in SHAPES.matmul_rows for kind in ku.QUANT_MATMUL_KINDS
               if kind != "fp8 x fp8" or m > 16]   # W8A8 runs the GEMM: its rows only


@gpu
@pytest.mark.parametrize("model", SHAPES.models)
@pytest.mark.parametrize("dtype", SHAPES.dtypes)
@pytest.mark.parametrize("kind, m", QUANT_CASES)
def test_quant_matmul_matches_reference(kind, m, dtype, model, record_property):
    """int8 / int4 / fp8 weights: the GEMV (M <= 16, split-K) and the GEMM on the model's MLP width."""
    n, k = ku.quant_matmul_layer(ku.GPU_MODEL_SHAPES[model])
    what = describe(record_property, ku.quant_matmul_name(kind, SHAPES.int4_group), dtype, f"M{m} N{n} K{k}")
    ku.skip_unless_gpu_has(*ku.QUANT_MATMUL_NEEDS[kind], *(("bf16",) if dtype == "bf16" else ()))
    result = ku.case_quant_matmul(kind, m, model, ku.GPU_DTYPES[dtype], SHAPES.int4_group, ku.DEVICE)
    ku.assert_compared(result, what, record_property)


@gpu
@pytest.mark.parametrize("model", SHAPES.models)
def test_store_then_decode_reproduces_the_prefill(model, record_property):
    """The three attention kernels as the engine chains them: a prompt stored and prefilled (extend),
    then one more token stored and decoded, against causal SDPA over all keys in fp32."""
    from minillm.kernels.extend_attention import extend_attention
    from minillm.kernels.paged_decode import paged_decode_attention
    from minillm.kernels.store_kv import store_kv

    shape = ku.GPU_MODEL_SHAPES[model]
    h, hkv, hd = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    total, block, dev = SHAPES.seq_len // 3 + 1, ku.BLOCK_SIZE, ku.DEVICE
    what = describe(record_property, "store_kv+extend+paged_decode", "fp32", f"H{h}/{hkv} D{hd} L{total}")
    gen = torch.Generator().manual_seed(total)
    q, k, v = (torch.randn(total, n, hd, generator=gen) for n in (h, hkv, hkv))
    blocks = -(-total // block)
    table = torch.randperm(2 * blocks, generator=gen)[:blocks].int()   # scattered in a pool twice the size
    positions = torch.arange(total)
    slots = table[positions // block].long() * block + positions % block
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(h // hkv, 0),
        v.transpose(0, 1).repeat_interleave(h // hkv, 0), is_causal=True, scale=hd ** -0.5).transpose(0, 1)
    q, k, v, slots, table = (t.to(dev) for t in (q, k, v, slots, table[None]))
    k_cache = torch.full((hkv, 2 * blocks * block, hd), float("nan"), device=dev)
    v_cache = torch.full_like(k_cache, float("nan"))
    prompt = total - 1
    store_kv(k_cache, v_cache, k[:prompt], v[:prompt], slots[:prompt])
    got_prefill = extend_attention(q[:prompt], k_cache, v_cache, table, torch.tensor([0, prompt], dtype=torch.int32,
                                   device=dev), torch.tensor([prompt], dtype=torch.int32, device=dev), hd ** -0.5, block)
    store_kv(k_cache, v_cache, k[prompt:], v[prompt:], slots[prompt:])
    got_decode = paged_decode_attention(q[prompt:], k_cache, v_cache, table,
                                        torch.tensor([total], dtype=torch.int32, device=dev), hd ** -0.5, block)
    ku.assert_compared(ku.Compared(torch.cat([got_prefill, got_decode]).cpu(), want), what, record_property)


# ---------------------------------------------------------------- the engine on the device
TINY = "random:tiny-llama"
MAX_LEN = 256


def generate_tokens(llm, lengths, max_tokens, seed):
    """Greedy tokens of random prompts (ids drawn by seed) of the given lengths."""
    from minillm import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompts = [{"prompt_token_ids": torch.randint(3, 512, (n,), generator=gen).tolist()} for n in lengths]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def tiny_graphs():
    """random:tiny-llama in fp32 on the Triton backend with cuda_graphs=True. In the interpreter (no
    GPU) the same padded static-buffer path runs without capture."""
    from minillm import LLM

    levers = dict(attention_backend="triton", dtype="float32", max_num_seqs=8, max_model_len=MAX_LEN)
    if ku.DEVICE == "cuda":
        return LLM(TINY, cuda_graphs=True, **levers)
    llm = LLM(TINY, **levers)
    llm.engine.runner.enable_cuda_graphs(8, MAX_LEN, capture=False)
    return llm


ENGINE_BATCHES = [  # prompt lengths, output lengths: prompts across block boundaries (16), uneven ends
    pytest.param((5,), (8,), id="batch1"),
    pytest.param((15, 6, 1), (6, 4, 7), id="batch3-bucket4"),
    pytest.param((1, 16, 3, 40, 5), (5, 3, 6, 4, 6), id="batch5-bucket8"),
]
if SHAPE_SET_NAME == "tiny":  # the interpreter takes seconds per batch: the padded one alone
    ENGINE_BATCHES = ENGINE_BATCHES[1:2]


@pytest.fixture(scope="module")
def eager_tokens(tiny_graphs):
    """Tokens of the Triton backend without graphs, per batch (both engine tests compare with them)."""
    eager, cache = tiny_graphs.with_levers(cuda_graphs=False), {}   # the same weights, its own KV pool

    def tokens(lengths, max_tokens):
        if (lengths, max_tokens) not in cache:
            cache[lengths, max_tokens] = generate_tokens(eager, lengths, max_tokens, seed=len(lengths))
        return cache[lengths, max_tokens]

    return tokens


@gpu
@pytest.mark.parametrize("lengths, max_tokens", ENGINE_BATCHES)
def test_engine_triton_backend_gives_the_torch_backend_s_tokens(tiny_graphs, eager_tokens, lengths, max_tokens,
                                                                 record_property):
    """fp32: the kernels' sums differ from torch's in the last bits, far below the gap between a
    random model's two most likely tokens."""
    describe(record_property, "engine: triton == torch backend", "fp32", f"{TINY} batch {len(lengths)}")
    torch_backend = tiny_graphs.with_levers(attention_backend="torch", cuda_graphs=False)
    assert torch_backend.engine.device_label == tiny_graphs.engine.device_label
    want = generate_tokens(torch_backend, lengths, max_tokens, seed=len(lengths))
    assert eager_tokens(lengths, max_tokens) == want


@gpu
@pytest.mark.parametrize("lengths, max_tokens", ENGINE_BATCHES)
def test_engine_cuda_graphs_give_eager_tokens(tiny_graphs, eager_tokens, lengths, max_tokens, record_property):
    """Every decode step replays the batch's bucket (padded rows write to slot -1), with eager's tokens."""
    describe(record_property, "engine: cuda_graphs on == off", "fp32", f"{TINY} batch {len(lengths)}")
    graphs = tiny_graphs.engine.runner.graphs
    before = graphs.num_steps
    got = generate_tokens(tiny_graphs, lengths, max_tokens, seed=len(lengths))
    decode_steps = sum(s.kind == "decode" for s in tiny_graphs.stats.steps)
    assert decode_steps > 0 and graphs.num_steps - before == decode_steps, "a decode step did not take the graph path"
    if ku.DEVICE == "cuda":
        assert set(graphs.graphs) == set(graphs.buckets), "not every batch bucket was captured"
    assert got == eager_tokens(lengths, max_tokens)


# ---------------------------------------------------------------- coverage (runs on any machine)
def test_every_kernel_module_has_a_gpu_case(record_property):
    """A file in minillm/kernels with a @triton.jit kernel and a torch reference has a case above
    (softmax.py holds the attention kernels' shared online-softmax step, checked through them).
    Not marked gpu: it reads files only, and CI runs it."""
    describe(record_property, "every kernel module has a case", "-", "minillm/kernels/*.py")
    covered = {case.module for case in ku.GPU_KERNEL_CASES.values()} | {  # the quant_matmul cases run these three
        "channel_matmul", "int4_matmul", "split_k_reduce"}
    kernel_files = {path.stem for path in KERNELS_DIR.glob("*.py")
                    if "@triton.jit" in path.read_text() and "_reference(" in path.read_text()}
    assert not covered - kernel_files, f"cases for modules that are gone: {sorted(covered - kernel_files)}"
    missing = sorted(kernel_files - covered)
    assert not missing, f"kernel modules without a GPU case in tests/kernel_utils.py: {missing}"

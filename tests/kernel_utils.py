"""Shared setup of the Triton kernel tests: the interpreter, dtypes, tolerances, device.

Import it before anything that imports triton (`from kernel_utils import ...` first): without
a GPU the kernels run in Triton's interpreter, which must be chosen before triton decorates
them (importing torch does not import triton). pytest puts tests/ on sys.path (rootdir
conftest), so the plain `from kernel_utils import ...` works from every test file.

The second half holds the GPU checks' cases (tests/test_gpu_kernels.py, scripts/gpu_check.py).
"""

import functools
import os
from typing import NamedTuple

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Max error allowed, relative to max(1, largest reference magnitude): fp32 kernels accumulate in
# another order than torch; bf16 / fp16 round once at the end where torch rounds after each op.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def assert_compiles_for_gpus(path, jobs, ccs=(80, 90)) -> None:
    """Compile kernels of the module file `path` ahead of time for each CUDA capability in `ccs`, without a GPU and
    outside the interpreter: what the interpreter forgives (types, shapes, a Python int where a tensor belongs)
    fails here. jobs: [(kernel name, signature, constexprs)], all compiled in one fresh process. Each learner
    kernel's test calls it on the solution."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import importlib.util
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        spec = importlib.util.spec_from_file_location("aot_module", {str(path)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for name, signature, constexprs in {list(jobs)!r}:
            for cc in {tuple(ccs)!r}:
                triton.compile(ASTSource(fn=getattr(module, name), signature=signature, constexprs=constexprs),
                               target=GPUTarget("cuda", cc, 32))
        print("compiled")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


def max_error(got: torch.Tensor, want: torch.Tensor, tolerance: dict = TOLERANCE) -> tuple[float, float]:
    """(max abs error, the error allowed for want's dtype and magnitude)."""
    err = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    scale = want.float().abs().max().item() if want.numel() else 0.0
    return err, tolerance[want.dtype] * max(1.0, scale)


def scattered_pool(seq_lens, num_kv_heads, head_dim, block_size, gen, spare_blocks=3):
    """A NaN-poisoned K/V pool [num_kv_heads, slots, head_dim] (fp32, CPU) in which each sequence's
    blocks sit at random places, its first seq_len slots filled with random keys and values.
    Returns (block_tables [num_seqs, max_blocks] int32 padded with block 0, k_cache, v_cache)."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32)
    k_cache = torch.full((num_kv_heads, num_blocks * block_size, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    start = 0
    for seq, (seq_len, count) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_tables[seq, :count] = order[start:start + count].int()
        start += count
        positions = torch.arange(seq_len)
        slots = block_tables[seq, positions // block_size].long() * block_size + positions % block_size
        k_cache[:, slots] = torch.randn(num_kv_heads, seq_len, head_dim, generator=gen)
        v_cache[:, slots] = torch.randn(num_kv_heads, seq_len, head_dim, generator=gen)
    return block_tables, k_cache, v_cache


def quantized_pools(k_cache, v_cache, kv_dtype, gen):
    """Quantize a NaN-poisoned fp32 pool (scattered_pool's): owned slots quantized, unowned slots random
    bytes with NaN scales (so a kernel that reads a slot it does not own returns NaN).
    Returns k_q, k_scale, v_q, v_scale (CPU)."""
    from minillm.kernels.kv_quant import quantize_kv

    owned = ~k_cache[..., 0].isnan()                                    # [heads, slots]
    out = []
    for pool in (k_cache, v_cache):
        q, scale = quantize_kv(torch.nan_to_num(pool, nan=0.0), kv_dtype)
        junk = torch.randint(-100, 100, q.shape, generator=gen).to(q.dtype)
        q = torch.where(owned[..., None], q.view(torch.uint8), junk.view(torch.uint8)).view(q.dtype)
        out += [q, scale.masked_fill(~owned, float("nan"))]
    return out


# ================================================================ the GPU checks
# tests/test_gpu_kernels.py runs every Triton kernel at real model shapes on a CUDA GPU against its
# torch reference (tests marked `gpu`: skipped without CUDA, see conftest.py), and
# scripts/gpu_check.py runs that file as its check section. The cases live here, once.

GPU_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Long rows on a GPU (contexts of 3000 keys, K = 4096): its sums run in another order than torch's,
# so fp32 gets 1e-4 where the short CPU cases above keep 1e-5.
GPU_TOLERANCE = {**TOLERANCE, torch.float32: 1e-4}
# Attention and MLP shapes of the models the engine serves (hidden, inter: the MLP's widths).
GPU_MODEL_SHAPES = {
    "llama-3-8b": dict(num_heads=32, num_kv_heads=8, head_dim=128, hidden=4096, inter=14336),
    "smollm2-135m": dict(num_heads=9, num_kv_heads=3, head_dim=64, hidden=576, inter=1536),
    "mqa-d80": dict(num_heads=8, num_kv_heads=1, head_dim=80, hidden=640, inter=1720),  # head_dim padded to 128
    "tiny": dict(num_heads=4, num_kv_heads=2, head_dim=16, hidden=64, inter=96),
}


class GpuShapeSet(NamedTuple):
    models: tuple[str, ...]         # keys of GPU_MODEL_SHAPES
    seq_len: int                    # the longest context of the attention cases
    dtypes: tuple[str, ...]         # keys of GPU_DTYPES
    int4_group: int
    matmul_rows: tuple[int, ...]    # M of the low-bit matmuls: up to 16 the GEMV, more the GEMM


# MINILLM_GPU_SHAPES picks one (scripts/gpu_check.py: full, --quick, --dry-run's tiny).
GPU_SHAPE_SETS = {
    "full": GpuShapeSet(("llama-3-8b", "smollm2-135m", "mqa-d80"), 3000, ("fp32", "bf16", "fp16"), 128,
                        (1, 5, 16, 300)),
    "quick": GpuShapeSet(("llama-3-8b",), 1500, ("fp32", "bf16", "fp16"), 128, (1, 5, 16, 300)),
    "tiny": GpuShapeSet(("tiny",), 70, ("fp32", "bf16"), 32, (1, 37)),
}
# MINILLM_GPU_TESTS_INTERPRET=1 runs the gpu tests without a GPU, the kernels in Triton's interpreter
# (scripts/gpu_check.py --dry-run: every case's code on tiny shapes).
# Without it they are skipped there (conftest.py).
GPU_TESTS_INTERPRET = os.environ.get("MINILLM_GPU_TESTS_INTERPRET") == "1"


def gpu_shape_set() -> tuple[str, GpuShapeSet]:
    """(name, shapes) from MINILLM_GPU_SHAPES; by default "full", "tiny" in the interpreter."""
    default = "tiny" if DEVICE == "cpu" and GPU_TESTS_INTERPRET else "full"
    name = os.environ.get("MINILLM_GPU_SHAPES") or default
    if name not in GPU_SHAPE_SETS:
        raise ValueError(f"MINILLM_GPU_SHAPES={name!r} is not one of {sorted(GPU_SHAPE_SETS)}")
    return name, GPU_SHAPE_SETS[name]


def skip_unless_gpu_has(*features: str) -> None:
    """pytest.skip with the reason (minillm.hardware.GPU_FEATURES) when this GPU lacks a feature;
    the interpreter has them all. Call it inside a test: it reads the device's capability."""
    if DEVICE != "cuda":
        return
    import pytest

    from minillm.hardware import gpu_capability, missing_gpu_feature, sm_name

    capability = gpu_capability(torch.device("cuda"))
    for feature in features:
        why = missing_gpu_feature(capability, feature)
        if why:
            pytest.skip(f"{sm_name(capability)}: {why}")


class Compared(NamedTuple):
    """A kernel's output and its reference's; tol: the absolute error allowed, None for
    GPU_TOLERANCE[want.dtype] * max(1, max |want|)."""
    got: torch.Tensor
    want: torch.Tensor
    tol: float | None = None


def assert_compared(result: Compared, what: str, record=None) -> tuple[float, float]:
    """Fail with the worst element, or return (max error, bound); record(name, value) gets both."""
    got, want = result.got, result.want
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, the reference's {tuple(want.shape)}"
    assert not want.isnan().any(), f"{what}: NaN in the reference (the case read a poisoned slot: its block tables are wrong)"
    if result.tol is None:
        err, tol = max_error(got, want, GPU_TOLERANCE)
    else:
        err, tol = ((got.float() - want.float()).abs().max().item() if want.numel() else 0.0), result.tol
    if record is not None:
        record("max_err", err)
        record("tol", tol)
    nan = got.isnan().nonzero()
    assert nan.numel() == 0, (f"{what}: NaN at index {nan[0].tolist()} ({len(nan)} elements): an output element "
                              "never written, or a read past a sequence / of a slot it does not own")
    if not err <= tol:
        diff = (got.float() - want.float()).abs()
        worst = tuple(i.item() for i in torch.unravel_index(diff.argmax(), diff.shape))
        raise AssertionError(f"{what}: max error {err:.3g} > {tol:.3g} at index {list(worst)}: got "
                             f"{got[worst].float().item():.5g}, expected {want[worst].float().item():.5g}")
    return err, tol


# ---------------------------------------------------------------- one case per kernel
# Each takes (shape: a GPU_MODEL_SHAPES entry, dtype, seq_len, device, a seeded CPU generator) and
# returns Compared. Inputs are drawn on the CPU (seeded) and moved; pools are scattered_pool's,
# NaN-poisoned outside each sequence, and outputs start as NaN: every element must be written.
BLOCK_SIZE = 16


def _draw(gen, *shape, dtype, device, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen)).to(dtype).to(device)


def case_store_kv(shape, dtype, seq_len, device, gen, kv_dtype=None):
    """37 new tokens (every 5th a padding slot of -1, written nowhere) into a pool; int8 / fp8 pools
    get codes and per-token scales."""
    from minillm.kernels.store_kv import store_kv, store_kv_reference
    from minillm.kernels.kv_quant import KV_STORAGE

    hkv, hd = shape["num_kv_heads"], shape["head_dim"]
    num_slots, num_tokens = 32 * BLOCK_SIZE, 37
    # k and v as strided views of one fused tensor, magnitudes spread per token and head, an all-zero head
    fused = torch.randn(num_tokens, 2, hkv, hd, generator=gen) * torch.exp(torch.randn(num_tokens, 2, hkv, 1, generator=gen))
    fused[1, 0, 0] = 0.0
    fused = fused.to(dtype).to(device)
    k, v = fused[:, 0], fused[:, 1]
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[::5] = -1
    kept = slots[slots >= 0].to(device)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    untouched, slots = untouched.to(device), slots.to(device)
    if kv_dtype is None:
        pool = torch.randn(2, hkv, num_slots, hd, generator=gen).to(dtype).to(device)
        got, want = pool.clone(), pool.clone()
        store_kv(got[0], got[1], k, v, slots)
        store_kv_reference(want[0], want[1], k, v, slots)
        return Compared(got, want, tol=0.0)  # a copy: the same bits
    storage = KV_STORAGE[kv_dtype]
    pool = torch.randint(-100, 100, (2, hkv, num_slots, hd), generator=gen).to(storage).to(device)
    scales = torch.full((2, hkv, num_slots), float("nan"), device=device)
    got, got_s, want, want_s = pool.clone(), scales.clone(), pool.clone(), scales.clone()
    store_kv(got[0], got[1], k, v, slots, k_scale=got_s[0], v_scale=got_s[1])
    store_kv_reference(want[0], want[1], k, v, slots, k_scale=want_s[0], v_scale=want_s[1])
    bits = got.view(torch.uint8)  # fp8 tensors are indexed through their bytes
    assert torch.equal(bits[:, :, untouched], pool.view(torch.uint8)[:, :, untouched]), \
        f"store_kv {kv_dtype}: a slot of -1 (padding) was written"
    assert got_s[:, :, untouched].isnan().all(), f"store_kv {kv_dtype}: a padding slot's scale was written"
    torch.testing.assert_close(got_s[:, :, kept], want_s[:, :, kept], rtol=1e-6, atol=0,
                               msg=lambda m: f"store_kv {kv_dtype}: the per-token scales differ: {m}")
    # The codes: a GPU's fp32 reciprocal may be an ulp off torch's, which moves a rounding tie by one
    # step (int8: 1; e4m3: at most 32, its spacing near 448).
    codes = [t.view(torch.uint8)[:, :, kept].view(storage).float() for t in (got, want)]
    return Compared(*codes, tol=1.0 if kv_dtype == "int8" else 32.0)


def _pools_on(device, dtype, k_cache, v_cache, kv_dtype, gen):
    """The fp32 scattered pools in the model dtype, or quantized; (k, v, {k_scale, v_scale})."""
    if kv_dtype is None:
        return k_cache.to(dtype).to(device), v_cache.to(dtype).to(device), {}
    k_q, k_scale, v_q, v_scale = quantized_pools(k_cache, v_cache, kv_dtype, gen)
    return k_q.to(device), v_q.to(device), dict(k_scale=k_scale.to(device), v_scale=v_scale.to(device))


def case_paged_decode(shape, dtype, seq_len, device, gen, kv_dtype=None):
    """One decode token per sequence over contexts of 1, 17, seq_len, seq_len / 3 and two blocks + 1."""
    from minillm.kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference

    h, hkv, hd = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    lens = [1, 17, seq_len, max(1, seq_len // 3), 2 * BLOCK_SIZE + 1]
    tables, k_cache, v_cache = scattered_pool(lens, hkv, hd, BLOCK_SIZE, gen)
    k, v, scales = _pools_on(device, dtype, k_cache, v_cache, kv_dtype, gen)
    q = _draw(gen, len(lens), h, hd, dtype=dtype, device=device)
    args = (q, k, v, tables.to(device), torch.tensor(lens, dtype=torch.int32, device=device), hd ** -0.5, BLOCK_SIZE)
    got = paged_decode_attention(*args, out=torch.full_like(q, float("nan")), **scales)
    return Compared(got, paged_decode_attention_reference(*args, **scales))


def case_extend_attention(shape, dtype, seq_len, device, gen, kv_dtype=None):
    """A prefill of seq_len / 2, one token after 5 cached, 33 after seq_len / 2 cached, a prefill of 70."""
    from minillm.kernels.extend_attention import extend_attention, extend_attention_reference

    h, hkv, hd = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    cached, new = [0, 5, seq_len // 2, 0], [seq_len // 2, 1, 33, 70]
    lens = [c + n for c, n in zip(cached, new)]
    tables, k_cache, v_cache = scattered_pool(lens, hkv, hd, BLOCK_SIZE, gen)
    k, v, scales = _pools_on(device, dtype, k_cache, v_cache, kv_dtype, gen)
    q = _draw(gen, sum(new), h, hd, dtype=dtype, device=device)
    starts = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device=device)
    args = (q, k, v, tables.to(device), starts, torch.tensor(lens, dtype=torch.int32, device=device), hd ** -0.5,
            BLOCK_SIZE)
    got = extend_attention(*args, max_query_len=max(new), out=torch.full_like(q, float("nan")), **scales)
    return Compared(got, extend_attention_reference(*args, **scales))


def case_rmsnorm(shape, dtype, seq_len, device, gen, residual=False):
    """29 tokens of the hidden width; with residual, the stream is updated in place to x + residual."""
    from minillm.kernels.rmsnorm import rmsnorm, rmsnorm_reference

    hidden = shape["hidden"]
    x = _draw(gen, 29, hidden, dtype=dtype, device=device)
    w = _draw(gen, hidden, dtype=dtype, device=device, scale=0.2) + 1
    r = _draw(gen, 29, hidden, dtype=dtype, device=device) if residual else None
    r_ref = r.clone() if residual else None
    got = rmsnorm(x, w, 1e-5, residual=r)
    want = rmsnorm_reference(x, w, 1e-5, residual=r_ref)
    if residual:
        return Compared(torch.cat([got, r]), torch.cat([want, r_ref]))
    return Compared(got, want)


def case_rotary(shape, dtype, seq_len, device, gen):
    """41 tokens at scattered positions; q and k strided views of a fused projection, as in the model."""
    from minillm.kernels.rotary import rotary_embedding, rotary_embedding_reference
    from minillm.layers.rotary import RotaryEmbedding

    h, hkv, hd = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    table = RotaryEmbedding(hd, 4096, 500000.0, None, dtype)
    cos, sin = table.cos.to(device), table.sin.to(device)
    t = 41
    positions = torch.randint(0, 4096, (t,), generator=gen).to(device)
    qkv = _draw(gen, t, (h + 2 * hkv) * hd, dtype=dtype, device=device)
    q = qkv[:, : h * hd].view(t, h, hd)
    k = qkv[:, h * hd: (h + hkv) * hd].view(t, hkv, hd)
    want_q, want_k = rotary_embedding_reference(positions, q.clone(), k.clone(), cos, sin)
    got_q, got_k = rotary_embedding(positions, q, k, cos, sin)
    return Compared(torch.cat([got_q.flatten(), got_k.flatten()]), torch.cat([want_q.flatten(), want_k.flatten()]))


def case_silu_and_mul(shape, dtype, seq_len, device, gen):
    """23 tokens of the MLP's width, gates large enough to overflow a naive silu."""
    from minillm.kernels.activation import silu_and_mul, silu_and_mul_reference

    inter = shape["inter"]
    gate_up = _draw(gen, 23, 2 * inter, dtype=dtype, device=device, scale=4.0)
    out = torch.full((23, inter), float("nan"), dtype=dtype, device=device)
    return Compared(silu_and_mul(gate_up, out=out), silu_and_mul_reference(gate_up))


def case_fused_moe(shape, dtype, seq_len, device, gen, int8=False, int4=False):
    """37 tokens routed top-2 of 8 experts of width inter / 8 (fine-grained experts; a layer's weights
    stay small to draw), float, int8 or int4 (groups of 32) experts: the grouped-matmul kernel vs the loop
    over experts."""
    from minillm.kernels.fused_moe import ExpertWeights, fused_moe, fused_moe_reference
    from minillm.quant import pack_int4, quantize_int4, quantize_int8

    hidden, inter, experts, tokens = shape["hidden"], max(16, shape["inter"] // 8), 8, 37
    x = _draw(gen, tokens, hidden, dtype=dtype, device=device)
    w13 = _draw(gen, experts, 2 * inter, hidden, dtype=torch.float32, device=device, scale=hidden ** -0.5)
    w2 = _draw(gen, experts, hidden, inter, dtype=torch.float32, device=device, scale=inter ** -0.5)
    weights, ids = torch.softmax(torch.randn(tokens, experts, generator=gen), -1).topk(2, dim=-1)
    weights, ids = (weights / weights.sum(-1, keepdim=True)).to(device), ids.to(device)
    if int8:
        (q13, s13), (q2, s2) = [[torch.stack(t) for t in zip(*(quantize_int8(m) for m in w))] for w in (w13, w2)]
        args, scales = (x, q13, q2, weights, ids), dict(w13_scale=s13, w2_scale=s2)
    elif int4:
        def pack(w):
            parts = [quantize_int4(torch.nn.functional.pad(m, (0, (-m.shape[1]) % 32)), 32) for m in w]
            return ExpertWeights(*(torch.stack(t) for t in zip(*((pack_int4(q), s, z) for q, s, z in parts))), 32)

        args, scales = (x, pack(w13), pack(w2), weights, ids), {}
    else:
        args, scales = (x, w13.to(dtype), w2.to(dtype), weights, ids), {}
    # the reference in fp32 on the same inputs and weights (the kernel accumulates in fp32; a bf16 loop
    # rounds after every op and drifts further from both)
    exact = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    return Compared(fused_moe(*args, **scales), fused_moe_reference(*exact, **scales).to(dtype))


def case_lora(shape, dtype, seq_len, device, gen, decode=False):
    """Batched multi-LoRA on a fused q|k|v-like layer of width 3 x hidden, 4 adapters of rank 16 (slot 0: none):
    SGMV shrink then expand per slice, on three prompt segments (one without an adapter) or 32 decode tokens,
    against the gather + bmm reference (fp32 on the same inputs)."""
    from minillm.kernels.lora import lora_delta_reference, sgmv_expand, sgmv_shrink, token_slots_from_segments

    hidden, rank, slots = shape["hidden"], 16, 5
    runs = [(1, 1 + i % 4) for i in range(32)] if decode else [(seq_len // 2, 2), (7, 0), (seq_len // 3, 4)]
    starts = torch.tensor([sum(n for n, _ in runs[:i]) for i in range(len(runs))], dtype=torch.int32)
    lens = torch.tensor([n for n, _ in runs], dtype=torch.int32)
    seg_slots = torch.tensor([s for _, s in runs], dtype=torch.int32)
    tokens = int(lens.sum())
    x = _draw(gen, tokens, hidden, dtype=dtype, device=device)
    a = _draw(gen, slots, 3 * rank, hidden, dtype=dtype, device=device, scale=hidden ** -0.5)
    b = _draw(gen, slots, 3 * hidden, rank, dtype=dtype, device=device, scale=0.25)
    a[0], b[0] = 0, 0
    y0 = _draw(gen, tokens, 3 * hidden, dtype=dtype, device=device)
    starts, lens, seg_slots = starts.to(device), lens.to(device), seg_slots.to(device)
    mid = sgmv_shrink(x, a, starts, lens, seg_slots, int(lens.max()))
    got = y0.clone()
    want = y0.float()
    token_slots = token_slots_from_segments(tokens, starts, lens, seg_slots)
    for i in range(3):   # q, k, v: slice i of the rank and of the output
        cols = slice(i * hidden, (i + 1) * hidden)
        b_slice = b[:, cols].contiguous()
        sgmv_expand(mid[:, i * rank:(i + 1) * rank], b_slice, got[:, cols], starts, lens, seg_slots, int(lens.max()))
        want[:, cols] += lora_delta_reference(x, a[:, i * rank:(i + 1) * rank], b_slice, token_slots)
    return Compared(got, want.to(dtype))


class KernelCase(NamedTuple):
    run: object               # (shape, dtype, seq_len, device, gen) -> Compared
    module: str               # its file in minillm/kernels
    needs: tuple[str, ...]    # minillm.hardware.GPU_FEATURES the card must have (bf16 is the dtype's)
    label: str                # the shape column: "attn" (heads, head_dim), "hidden" or "inter"


def _partial(fn, **kw):
    return lambda *args: fn(*args, **kw)


GPU_KERNEL_CASES = {
    "store_kv": KernelCase(case_store_kv, "store_kv", (), "attn"),
    "store_kv int8": KernelCase(_partial(case_store_kv, kv_dtype="int8"), "store_kv", (), "attn"),
    "store_kv fp8": KernelCase(_partial(case_store_kv, kv_dtype="fp8"), "store_kv", ("fp8",), "attn"),
    "paged_decode": KernelCase(case_paged_decode, "paged_decode", (), "attn+len"),
    "paged_decode int8 kv": KernelCase(_partial(case_paged_decode, kv_dtype="int8"), "paged_decode", (), "attn+len"),
    "paged_decode fp8 kv": KernelCase(_partial(case_paged_decode, kv_dtype="fp8"), "paged_decode", ("fp8",), "attn+len"),
    "extend_attention": KernelCase(case_extend_attention, "extend_attention", (), "attn+len"),
    "extend_attention int8 kv": KernelCase(_partial(case_extend_attention, kv_dtype="int8"), "extend_attention", (),
                                           "attn+len"),
    "extend_attention fp8 kv": KernelCase(_partial(case_extend_attention, kv_dtype="fp8"), "extend_attention",
                                          ("fp8",), "attn+len"),
    "rmsnorm": KernelCase(case_rmsnorm, "rmsnorm", (), "hidden"),
    "rmsnorm+residual": KernelCase(_partial(case_rmsnorm, residual=True), "rmsnorm", (), "hidden"),
    "rotary": KernelCase(case_rotary, "rotary", (), "attn"),
    "silu_and_mul": KernelCase(case_silu_and_mul, "activation", (), "inter"),
    "fused_moe": KernelCase(case_fused_moe, "fused_moe", (), "inter"),
    "fused_moe int8": KernelCase(_partial(case_fused_moe, int8=True), "fused_moe", (), "inter"),
    "fused_moe int4": KernelCase(_partial(case_fused_moe, int4=True), "fused_moe", (), "inter"),
    "lora sgmv prefill": KernelCase(case_lora, "lora", (), "hidden"),
    "lora sgmv decode": KernelCase(_partial(case_lora, decode=True), "lora", (), "hidden"),
}


def shape_label(case: KernelCase, shape: dict, seq_len: int) -> str:
    """The table's shape column: "H32/8 D128 L3000", "hidden 4096", "inter 14336"."""
    if case.label.startswith("attn"):
        text = f"H{shape['num_heads']}/{shape['num_kv_heads']} D{shape['head_dim']}"
        return text + (f" L{seq_len}" if case.label.endswith("+len") else "")
    return f"{case.label} {shape[case.label]}"


# ---------------------------------------------------------------- low-bit matmuls
QUANT_MATMUL_KINDS = ("int8", "int4", "fp8", "fp8 x fp8")  # fp8 x fp8: W8A8 through the GEMM (M > 16 here)
QUANT_MATMUL_NEEDS = {"int8": (), "int4": (), "fp8": ("fp8_matmul",), "fp8 x fp8": ("fp8_matmul",)}


def quant_matmul_layer(shape: dict) -> tuple[int, int]:
    """(N, K) of the layer the matmul cases use: N = inter + 3, K = hidden - 8 (neither a multiple of a
    block; int4 pads K to its group size)."""
    return shape["inter"] + 3, shape["hidden"] - 8


@functools.lru_cache(maxsize=3)
def quantized_weights(model: str, group: int, device: str) -> dict:
    """The layer's random weights (drawn on the device: 58M values for Llama's shapes) quantized to int8,
    int4 (packed, bf16 scales and zeros as QuantizedLinear stores them) and fp8; cached per model."""
    from minillm.quant import pack_int4, quantize_fp8, quantize_int4, quantize_int8

    n, k = quant_matmul_layer(GPU_MODEL_SHAPES[model])
    w = torch.randn(n, k, generator=torch.Generator(device=device).manual_seed(n + k), device=device) * 0.05
    q4, s4, z4 = quantize_int4(torch.nn.functional.pad(w, (0, (-k) % group)), group)
    return {"int8": quantize_int8(w), "int4": (pack_int4(q4), s4.to(torch.bfloat16), z4.to(torch.bfloat16)),
            "fp8": quantize_fp8(w)}


def quant_matmul_name(kind: str, group: int) -> str:
    return {"int8": "int8_matmul", "int4": f"int4_matmul g{group}", "fp8": "fp8_matmul",
            "fp8 x fp8": "fp8_matmul fp8 x fp8"}[kind]


def case_quant_matmul(kind: str, m: int, model: str, dtype, group: int, device) -> Compared:
    """x [m, K] (fresh, seeded by m) times the model's quantized layer: kernel vs reference."""
    from minillm.kernels.channel_matmul import fp8_matmul, fp8_matmul_reference, int8_matmul, int8_matmul_reference
    from minillm.kernels.int4_matmul import int4_matmul, int4_matmul_reference

    tensors = quantized_weights(model, group, str(device))
    x = _draw(torch.Generator().manual_seed(50 + m), m, quant_matmul_layer(GPU_MODEL_SHAPES[model])[1],
              dtype=dtype, device=device)
    if kind == "int8":
        return Compared(int8_matmul(x, *tensors["int8"]), int8_matmul_reference(x, *tensors["int8"]))
    if kind == "int4":
        return Compared(int4_matmul(x, *tensors["int4"], group), int4_matmul_reference(x, *tensors["int4"], group))
    w8a8 = kind == "fp8 x fp8"
    return Compared(fp8_matmul(x, *tensors["fp8"], fp8_activations=w8a8),
                    fp8_matmul_reference(x, *tensors["fp8"], fp8_activations=w8a8))

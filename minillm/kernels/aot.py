"""Compile every Triton kernel ahead of time for the GPUs learners have — no GPU needed.

Triton ships ptxas, so `triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))`
runs on a CPU-only machine and catches what the interpreter forgives (a `tl.dot` with a
dimension under 16, an unsupported dtype on one architecture, register spills). Targets:
sm_75 (T4), sm_80 (A100), sm_86 (A10, RTX 30xx), sm_89 (L4, RTX 40xx), sm_90 (H100, H200).
A configuration a card never launches (bf16 on sm_75, fp8 below sm_89, the fp8 weight kernels
below sm_90: see hardware.GPU_FEATURES) is skipped with the reason.

Run it in a process *without* TRITON_INTERPRET=1:

    python -m minillm.kernels.aot                    # every configuration on every target
    python -m minillm.kernels.aot --representative   # each kernel family on each target, every
                                                     # dtype / head_dim / group / format at least once
    python -m minillm.kernels.aot --jobs 2           # compile in 2 processes
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

from ..hardware import GPU_TARGETS, missing_gpu_feature

CAPABILITIES = tuple(GPU_TARGETS)
# (kernel name, kernel, signature, constexprs[, compile options]) for every configuration the
# engine launches. Options carry the launch's num_warps, so register pressure is checked as launched,
# and "needs": the hardware.GPU_FEATURES the launch needs (a target without one skips it).
_FLOAT_TYPES = ("fp32", "bf16", "fp16")
_HEAD_DIMS = (64, 80, 128)       # 80 is padded to BLOCK_D 128 and masked
_QUERY_GROUP_SIZES = (1, 3, 8)   # num_heads // num_kv_heads: MHA, SmolLM2-135M (9/3), Llama-3-8B (32/8)
# block_size (16/32) and partition_size are runtime arguments of the paged kernels: no variant each.
# extend_attention takes the GQA group size at run time too: one variant per dtype and head_dim.


# Hidden sizes the model's RMSNorm sees: SmolLM2-135M's 576 (BLOCK 1024), Llama-3-8B's 4096 (BLOCK 4096),
# and 8192 for the wider Llamas. The SiLU-and-mul and rotary launches have no size-dependent constants.
_HIDDEN_SIZES = (576, 4096, 8192)


def _needs(dtype: str, *features: str | None) -> tuple[str, ...]:
    """The GPU features a launch in model dtype `dtype` needs (bf16 models need bf16; plus `features`)."""
    return tuple(f for f in (("bf16" if dtype == "bf16" else None), *features) if f)


def configurations():
    yield from _pointwise_configurations()
    yield from _paged_configurations()
    yield from _quant_matmul_configurations()
    yield from _fused_moe_configurations()
    yield from _lora_configurations()


def _pointwise_configurations():
    import triton

    from . import activation, rotary
    from .rmsnorm import rmsnorm_kernel

    for dtype in _FLOAT_TYPES:
        for has_residual in (False, True):
            for hidden in _HIDDEN_SIZES:
                block = triton.next_power_of_2(hidden)
                sig = {"x_ptr": f"*{dtype}", "residual_ptr": f"*{dtype}", "weight_ptr": f"*{dtype}",
                       "out_ptr": f"*{dtype}", "stride_x": "i32", "stride_r": "i32", "stride_o": "i32",
                       "hidden": "i32", "eps": "fp32", "HAS_RESIDUAL": "constexpr", "BLOCK": "constexpr"}
                yield (f"rmsnorm[{dtype},residual={has_residual},BLOCK={block}]", rmsnorm_kernel, sig,
                       {"HAS_RESIDUAL": has_residual, "BLOCK": block}, {"needs": _needs(dtype)})

        # intermediate (1536, 14336, ...) is a runtime argument: one variant per dtype.
        sig = {"gate_up_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "stride_in": "i32", "stride_out": "i32",
               "intermediate": "i32", "BLOCK": "constexpr"}
        yield (f"silu_and_mul[{dtype}]", activation.silu_and_mul_kernel, sig, {"BLOCK": activation.SILU_BLOCK},
               {"num_warps": activation.SILU_NUM_WARPS, "needs": _needs(dtype)})

        # Head counts are runtime arguments; the cos/sin tables share the model dtype, positions are int64.
        for head_dim in _HEAD_DIMS:
            block_h, block_half = rotary.rotary_blocks(head_dim)
            sig = {"q_ptr": f"*{dtype}", "k_ptr": f"*{dtype}", "q_out_ptr": f"*{dtype}", "k_out_ptr": f"*{dtype}",
                   "cos_ptr": f"*{dtype}", "sin_ptr": f"*{dtype}", "positions_ptr": "*i64",
                   "stride_q_token": "i32", "stride_q_head": "i32", "stride_k_token": "i32", "stride_k_head": "i32",
                   "stride_qo_token": "i32", "stride_qo_head": "i32", "stride_ko_token": "i32",
                   "stride_ko_head": "i32", "stride_table": "i32", "num_q_heads": "i32", "num_kv_heads": "i32",
                   "half": "i32", "BLOCK_H": "constexpr", "BLOCK_HALF": "constexpr"}
            yield (f"rotary[{dtype},head_dim={head_dim}]", rotary.rotary_kernel, sig,
                   {"BLOCK_H": block_h, "BLOCK_HALF": block_half},
                   {"num_warps": rotary.ROTARY_NUM_WARPS, "needs": _needs(dtype)})


def _paged_configurations():
    import torch
    import triton

    from . import extend_attention, paged_decode
    from .store_kv import store_kv_kernel

    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    # KV pool formats (kv_dtype): the model dtype (KV_QUANT 0), int8 (1) and fp8 e4m3 (2), the latter
    # two with fp32 scale pools. The scale pointers of KV_QUANT 0 are never read (typed fp32 here).
    kv_formats = (("", None, 0), ("kv=int8", "i8", 1), ("kv=fp8", "fp8e4nv", 2))
    for dtype in _FLOAT_TYPES:
        for head_dim in _HEAD_DIMS:
            block_d = triton.next_power_of_2(head_dim)
            sig = {"out_ptr": f"*{dtype}", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                   "seq_lens_ptr": "*i32", "stride_o_seq": "i32", "stride_o_head": "i32", "num_heads": "i32",
                   "head_dim": "i32", "partition_size": "i32", "max_num_partitions": "i32", "BLOCK_D": "constexpr"}
            yield (f"paged_decode_reduce[{dtype},head_dim={head_dim}]", paged_decode.paged_decode_reduce_kernel,
                   sig, {"BLOCK_D": block_d}, {"num_warps": paged_decode.REDUCE_NUM_WARPS, "needs": _needs(dtype)})

            for kv_name, kv_type, kv_quant in kv_formats:
                cache = f"*{kv_type or dtype}"
                tag = f",{kv_name}" if kv_name else ""
                # fp8 e4m3 (fp8e4nv) is an Ada / Hopper type: Triton refuses it below sm_89.
                needs = {"needs": _needs(dtype, "fp8" if kv_quant == 2 else None)}
                sig = {"k_ptr": f"*{dtype}", "v_ptr": f"*{dtype}", "k_cache_ptr": cache, "v_cache_ptr": cache,
                       "slot_mapping_ptr": "*i64", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                       "stride_k_token": "i32", "stride_k_head": "i32", "stride_v_token": "i32", "stride_v_head": "i32",
                       "stride_cache_head": "i32", "stride_cache_slot": "i32", "stride_scale_head": "i32",
                       "head_dim": "i32", "BLOCK_D": "constexpr", "KV_QUANT": "constexpr"}
                yield (f"store_kv[{dtype},head_dim={head_dim}{tag}]", store_kv_kernel, sig,
                       {"BLOCK_D": block_d, "KV_QUANT": kv_quant}, {"num_warps": 1, **needs})

                for group in _QUERY_GROUP_SIZES:
                    sig = {"q_ptr": f"*{dtype}", "k_cache_ptr": cache, "v_cache_ptr": cache,
                           "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "part_out_ptr": "*fp32",
                           "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32", "k_scale_ptr": "*fp32",
                           "v_scale_ptr": "*fp32", "stride_q_seq": "i32", "stride_q_head": "i32",
                           "stride_cache_head": "i32", "stride_cache_slot": "i32", "stride_bt": "i32",
                           "stride_scale_head": "i32", "scale_log2": "fp32", "num_heads": "i32", "head_dim": "i32",
                           "block_size": "i32", "partition_size": "i32", "max_num_partitions": "i32",
                           "QUERY_GROUP_SIZE": "constexpr", "GROUP_ROWS": "constexpr", "BLOCK_D": "constexpr",
                           "TILE_N": "constexpr", "DOT_IN_FP32": "constexpr", "KV_QUANT": "constexpr"}
                    constexprs = {"QUERY_GROUP_SIZE": group, "GROUP_ROWS": paged_decode.padded_group_rows(group),
                                  "BLOCK_D": block_d, "TILE_N": paged_decode.TILE_N,
                                  "DOT_IN_FP32": dtype == "fp32",  # on a GPU only fp32 computes its dots in fp32
                                  "KV_QUANT": kv_quant}
                    yield (f"paged_decode[{dtype},head_dim={head_dim},group={group}{tag}]",
                           paged_decode.paged_decode_partition_kernel, sig, constexprs,
                           {"num_warps": paged_decode.DECODE_NUM_WARPS, **needs})

                block_m, block_n, num_warps, num_stages = extend_attention.EXTEND_LAUNCH[torch_dtypes[dtype]]
                sig = {"q_ptr": f"*{dtype}", "k_cache_ptr": cache, "v_cache_ptr": cache,
                       "block_tables_ptr": "*i32", "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
                       "out_ptr": f"*{dtype}", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32",
                       "stride_q_token": "i32", "stride_q_head": "i32", "stride_cache_head": "i32",
                       "stride_cache_slot": "i32", "stride_bt": "i32", "stride_o_token": "i32",
                       "stride_o_head": "i32", "stride_scale_head": "i32", "scale_log2": "fp32", "head_dim": "i32",
                       "block_size": "i32", "query_group_size": "i32", "BLOCK_M": "constexpr",
                       "BLOCK_N": "constexpr", "BLOCK_D": "constexpr", "DOT_IN_FP32": "constexpr",
                       "KV_QUANT": "constexpr"}
                constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_D": block_d,
                              "DOT_IN_FP32": dtype == "fp32",  # on a GPU only fp32 computes its dots in fp32
                              "KV_QUANT": kv_quant}
                yield (f"extend_attention[{dtype},head_dim={head_dim}{tag}]",
                       extend_attention.extend_attention_kernel, sig, constexprs,
                       {"num_warps": num_warps, "num_stages": num_stages, **needs})


def _quant_matmul_configurations():
    """QuantizedLinear's "triton" path: int8 / int4 / fp8 GEMV (BLOCK_M 1..16; output in fp32 partial
    sums when K is split, else in the activation dtype), the split-K reduction, and the GEMM. int4
    scales and zeros are stored in bf16 (loads and stores only: fine on sm_75), int8 / fp8 scales in fp32.
    The fp8 kernels run on sm_90+ only (QuantizedLinear dequantizes fp8 weights below): "fp8_matmul".
    Pointers, K and the row strides are declared multiples of 16, as the JIT specializes them for
    every model minillm ships (K = hidden or intermediate size): without that hint loads are scalar,
    nothing is pipelined, and the register counts checked here would not be the launched ones."""
    import torch

    from . import channel_matmul, int4_matmul, quant_launch, split_k_reduce

    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    aligned = ("x_ptr", "x_scale_ptr", "w_ptr", "packed_ptr", "scale_ptr", "zero_ptr", "out_ptr", "K", "Kp",
               "group_size", "stride_xm", "stride_wn", "stride_pn", "stride_sn", "stride_os", "stride_om", "k_per_split")
    weights = (("int8", "*i8", ()), ("fp8", "*fp8e4nv", ("fp8_matmul",)))
    for dtype in _FLOAT_TYPES:
        for block_m in sorted(quant_launch.GEMV_BLOCKS):
            block_n, block_k = quant_launch.GEMV_BLOCKS[block_m]
            constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
            for out_type in sorted({"fp32", dtype}):  # split K: fp32 partial sums; one slice: x's dtype
                tag = "" if out_type == dtype else ",split"
                for kind, w_type, features in weights:
                    sig = {"x_ptr": f"*{dtype}", "w_ptr": w_type, "scale_ptr": "*fp32", "out_ptr": f"*{out_type}",
                           "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
                           "stride_os": "i32", "stride_om": "i32", "k_per_split": "i32",
                           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
                    yield (f"{kind}_gemv[{dtype},BLOCK_M={block_m}{tag}]", channel_matmul.channel_gemv_kernel, sig,
                           constexprs, {"num_warps": quant_launch.GEMV_NUM_WARPS, "divisible_by_16": aligned,
                                        "needs": _needs(dtype, *features)})
                sig = {"x_ptr": f"*{dtype}", "packed_ptr": "*u8", "scale_ptr": "*bf16", "zero_ptr": "*bf16",
                       "out_ptr": f"*{out_type}", "M": "i32", "N": "i32", "K": "i32", "Kp": "i32", "group_size": "i32",
                       "stride_xm": "i32", "stride_pn": "i32", "stride_sn": "i32", "stride_os": "i32",
                       "stride_om": "i32", "k_per_split": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                       "BLOCK_K": "constexpr"}
                yield (f"int4_gemv[{dtype},BLOCK_M={block_m}{tag}]", int4_matmul.int4_gemv_kernel, sig, constexprs,
                       {"num_warps": quant_launch.GEMV_NUM_WARPS, "divisible_by_16": aligned, "needs": _needs(dtype)})
        sig = {"partial_ptr": "*fp32", "out_ptr": f"*{dtype}", "M": "i32", "N": "i32", "split_k": "i32",
               "stride_om": "i32", "BLOCK": "constexpr"}
        yield (f"split_k_reduce[{dtype}]", split_k_reduce.split_k_reduce_kernel, sig,
               {"BLOCK": split_k_reduce.REDUCE_BLOCK},
               {"num_warps": split_k_reduce.REDUCE_NUM_WARPS,
                "divisible_by_16": ("partial_ptr", "out_ptr", "stride_om"), "needs": _needs(dtype)})

        block_m, block_n, block_k, num_warps, num_stages = quant_launch.GEMM_LAUNCH[torch_dtypes[dtype]]
        launch = {"num_warps": num_warps, "num_stages": num_stages, "divisible_by_16": aligned, "needs": _needs(dtype)}
        # fp8_activations=True: x quantized to e4m3 per row, fp8 x fp8 tl.dot (sm_90), output in `dtype`
        fp8 = {"needs": _needs(dtype, "fp8_matmul")}
        for kind, x_type, w_type, fp8_act, extra in (("int8", dtype, "*i8", False, {}),
                                                     ("fp8", dtype, "*fp8e4nv", False, fp8),
                                                     ("fp8_act", "fp8e4nv", "*fp8e4nv", True, fp8)):
            sig = {"x_ptr": f"*{x_type}", "x_scale_ptr": "*fp32", "w_ptr": w_type, "scale_ptr": "*fp32",
                   "out_ptr": f"*{dtype}", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32",
                   "stride_wn": "i32", "stride_om": "i32", "BLOCK_M": "constexpr", "BLOCK_N": "constexpr",
                   "BLOCK_K": "constexpr", "DOT_IN_FP32": "constexpr", "FP8_ACT": "constexpr"}
            constexprs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": max(block_k, 64) if fp8_act else block_k,
                          "DOT_IN_FP32": dtype == "fp32" and not fp8_act, "FP8_ACT": fp8_act}
            yield f"{kind}_gemm[{dtype}]", channel_matmul.channel_gemm_kernel, sig, constexprs, {**launch, **extra}
        sig = {"x_ptr": f"*{dtype}", "packed_ptr": "*u8", "scale_ptr": "*bf16", "zero_ptr": "*bf16",
               "out_ptr": f"*{dtype}", "M": "i32", "N": "i32", "K": "i32", "Kp": "i32", "group_size": "i32",
               "stride_xm": "i32", "stride_pn": "i32", "stride_sn": "i32", "stride_om": "i32",
               "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "DOT_IN_FP32": "constexpr"}
        yield (f"int4_gemm[{dtype}]", int4_matmul.int4_gemm_kernel, sig,
               {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "DOT_IN_FP32": dtype == "fp32"}, launch)


def _fused_moe_configurations():
    """The fused-MoE grouped matmul (kernels/fused_moe.py): the gate/up launch (GATED, SwiGLU fused) and the
    down launch (routing weights applied), float, int8 or int4 experts, BLOCK_M 16 (decode) and 64, per dtype.
    E, N, K, the group size and the pair count are runtime arguments."""
    import torch

    from . import fused_moe

    torch_dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    for dtype in _FLOAT_TYPES:
        block_n, block_k, num_warps, num_stages = fused_moe.MOE_LAUNCH[torch_dtypes[dtype]]
        for weights, w_type, fmt in (("float", f"*{dtype}", 0), ("int8", "*i8", 1), ("int4", "*u8", 2)):
            for stage, gated in (("gate_up", True), ("down", False)):
                for block_m in fused_moe.MOE_BLOCK_MS:
                    sig = {"a_ptr": f"*{dtype}", "b_ptr": w_type, "b_scale_ptr": "*fp32", "b_zero_ptr": "*fp32",
                           "c_ptr": f"*{dtype}", "topk_weights_ptr": "*fp32", "sorted_ids_ptr": "*i32",
                           "tile_experts_ptr": "*i32", "N": "i32", "K": "i32", "Kp": "i32", "group_size": "i32",
                           "num_pairs": "i32", "stride_am": "i32", "stride_be": "i32", "stride_bn": "i32",
                           "stride_cm": "i32", "stride_se": "i32", "stride_sn": "i32",
                           "A_ROWS_PER": "constexpr", "GATED": "constexpr", "MUL_ROUTED_WEIGHT": "constexpr",
                           "WEIGHT_FORMAT": "constexpr", "DOT_IN_FP32": "constexpr", "BLOCK_M": "constexpr",
                           "BLOCK_N": "constexpr", "BLOCK_K": "constexpr"}
                    constexprs = {"A_ROWS_PER": 2 if gated else 1, "GATED": gated, "MUL_ROUTED_WEIGHT": not gated,
                                  "WEIGHT_FORMAT": fmt, "DOT_IN_FP32": dtype == "fp32",
                                  "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
                    yield (f"fused_moe[{dtype},{stage},{weights},BLOCK_M={block_m}]", fused_moe.fused_moe_kernel, sig,
                           constexprs, {"num_warps": num_warps, "num_stages": num_stages, "needs": _needs(dtype)})


def _lora_configurations():
    """Batched multi-LoRA: SGMV shrink (x A^T into fp32) and expand (y += (.) B^T). BLOCK_R is the rank padded to a
    power of 2 (at least 16): 16 / 32 / 64 cover max_lora_rank 16 with up to 3 fused slices (q|k|v shrinks at 3 r);
    sizes and strides are runtime arguments."""
    from . import lora

    for dtype in _FLOAT_TYPES:
        for block_r in (16, 32, 64):
            sig = {"x_ptr": f"*{dtype}", "a_ptr": f"*{dtype}", "out_ptr": "*fp32", "seg_start_ptr": "*i32",
                   "seg_len_ptr": "*i32", "seg_slot_ptr": "*i32", "stride_xt": "i32", "stride_as": "i32",
                   "stride_ar": "i32", "stride_ot": "i32", "in_features": "i32", "rank": "i32",
                   "BLOCK_M": "constexpr", "BLOCK_R": "constexpr", "BLOCK_K": "constexpr", "DOT_IN_FP32": "constexpr"}
            yield (f"lora_shrink[{dtype},BLOCK_R={block_r}]", lora.sgmv_shrink_kernel, sig,
                   {"BLOCK_M": lora.LORA_BLOCK_M, "BLOCK_R": block_r, "BLOCK_K": lora.SHRINK_BLOCK_K,
                    "DOT_IN_FP32": dtype == "fp32"}, {"num_warps": lora.LORA_NUM_WARPS, "needs": _needs(dtype)})
            sig = {"inp_ptr": "*fp32", "b_ptr": f"*{dtype}", "y_ptr": f"*{dtype}", "seg_start_ptr": "*i32",
                   "seg_len_ptr": "*i32", "seg_slot_ptr": "*i32", "stride_it": "i32", "stride_bs": "i32",
                   "stride_bn": "i32", "stride_yt": "i32", "out_features": "i32", "rank": "i32",
                   "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_R": "constexpr", "DOT_IN_FP32": "constexpr"}
            yield (f"lora_expand[{dtype},BLOCK_R={block_r}]", lora.sgmv_expand_kernel, sig,
                   {"BLOCK_M": lora.LORA_BLOCK_M, "BLOCK_N": lora.EXPAND_BLOCK_N, "BLOCK_R": block_r,
                    "DOT_IN_FP32": dtype == "fp32"}, {"num_warps": lora.LORA_NUM_WARPS, "needs": _needs(dtype)})


def skip_reason(options: dict, capability: int) -> str | None:
    """Why a target never launches a configuration (the first GPU feature it lacks), or None."""
    for feature in options.get("needs", ()):
        why = missing_gpu_feature(capability, feature)
        if why:
            return why
    return None


def family(name: str) -> str:
    """"paged_decode[bf16,head_dim=64,group=3]" -> "paged_decode"."""
    return name.split("[", 1)[0]


def _values(name: str) -> set[str]:
    """The settings a configuration's name lists ("bf16", "head_dim=64", ...)."""
    return set(name[len(family(name)) + 1:-1].split(",")) if "[" in name else set()


def representative(capabilities=CAPABILITIES) -> list[tuple[str, int]]:
    """(configuration, capability) pairs that cover, for each kernel family, every target and every value each
    setting takes (dtype, head_dim, group, KV format, BLOCK_M, ...), chosen greedily among the launched pairs.
    A few dozen compiles instead of every pair; the full grid runs with -m slow."""
    by_family: dict[str, list[tuple[str, dict]]] = {}
    for name, _kernel, _sig, _constexprs, *options in configurations():
        by_family.setdefault(family(name), []).append((name, options[0] if options else {}))
    chosen = []
    for members in by_family.values():
        pairs = [(name, cc) for name, options in members for cc in capabilities if skip_reason(options, cc) is None]
        covers = {pair: _values(pair[0]) | {f"sm_{pair[1]}"} for pair in pairs}
        uncovered = set().union(*covers.values())
        while uncovered:
            best = max(pairs, key=lambda pair: len(covers[pair] & uncovered))  # first of the best: deterministic
            chosen.append(best)
            uncovered -= covers[best]
    return chosen


_CONFIGURATIONS: dict | None = None


def _compile_one(job: tuple[str, int]) -> tuple[str, int, bool, str]:
    """Compile one (configuration, capability); runs in a worker process too."""
    global _CONFIGURATIONS
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if _CONFIGURATIONS is None:
        _CONFIGURATIONS = {name: rest for name, *rest in configurations()}
    name, cc = job
    kernel, sig, constexprs, *options = _CONFIGURATIONS[name]
    options = dict(options[0]) if options else {}
    why = skip_reason(options, cc)
    if why:
        return name, cc, True, f"skipped: {why}"
    options.pop("needs", None)
    # arguments the JIT would specialize as multiples of 16 (aligned pointers, K, strides)
    attrs = {(list(sig).index(arg),): [["tt.divisibility", 16]]
             for arg in options.pop("divisible_by_16", ()) if arg in sig}
    try:
        compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs or None),
                                  target=GPUTarget("cuda", cc, 32), options=options or None)
        return name, cc, True, f"{len(compiled.asm['cubin'])} bytes of cubin"
    except Exception as exc:  # report every failure, not only the first
        return name, cc, False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def compile_all(capabilities=CAPABILITIES, representative_only: bool = False,
                jobs: int = 1) -> list[tuple[str, int, bool, str]]:
    """Compile every configuration for every capability (or the representative pairs) in `jobs`
    processes; one (name, capability, ok, message) per pair, skipped pairs included, in order."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("ahead-of-time compilation needs TRITON_INTERPRET unset (the interpreter replaces @triton.jit)")
    if representative_only:
        todo = representative(capabilities)
    else:
        todo = [(name, cc) for name, *_ in configurations() for cc in capabilities]
    if jobs <= 1:
        return [_compile_one(job) for job in todo]
    # spawn: a fresh interpreter per worker (no forked Triton or torch state); chunks keep the order.
    with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        return list(pool.map(_compile_one, todo, chunksize=max(1, len(todo) // (4 * jobs))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minillm.kernels.aot", description=__doc__.split("\n")[0])
    parser.add_argument("--representative", action="store_true",
                        help="each kernel family on each target, every setting's value at least once")
    parser.add_argument("--jobs", type=int, default=1, help="compile in this many processes (default 1)")
    parser.add_argument("--capabilities", type=int, nargs="+", default=list(CAPABILITIES), metavar="CC",
                        help=f"targets (default: {' '.join(map(str, CAPABILITIES))})")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = compile_all(tuple(args.capabilities), args.representative, args.jobs)
    for name, cc, ok, msg in results:
        print(f"{('skip' if msg.startswith('skipped') else 'ok ') if ok else 'BAD'} sm_{cc} {name}: {msg}")
    bad = sum(not ok for *_, ok, _ in results)
    skipped = sum(ok and msg.startswith("skipped") for *_, ok, msg in results)
    targets = ", ".join(f"sm_{cc} ({GPU_TARGETS.get(cc, '?')})" for cc in args.capabilities)
    print(f"{len(results) - bad - skipped} compiled, {skipped} skipped, {bad} failed "
          f"for {targets} in {time.perf_counter() - start:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

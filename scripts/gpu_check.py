#!/usr/bin/env python
"""minillm on a GPU: correctness of every Triton kernel and of the engine, attention speed, engine speed.

    python scripts/gpu_check.py            # full run, within its 450 s budget on one H100/H200
    python scripts/gpu_check.py --quick    # fewer shapes and shorter outputs
    python scripts/gpu_check.py --dry-run  # tiny shapes; on a CPU under the Triton interpreter

Sections, each guarded (a failure is reported in its table and the JSON, the rest still run):
  kernels   the gpu tests, tests/test_gpu_kernels.py run by pytest (its cases live in
            tests/kernel_utils.py): every Triton kernel in minillm/kernels against its torch
            reference at real model shapes in fp32/bf16/fp16 (int8 / fp8 KV, int8 / int4 / fp8
            weights included), and the engine's triton == torch and cuda_graphs on == off tokens;
            one row per test (`pytest -m gpu` runs the same tests alone)
  decode    paged decode attention: KV bytes read / time, against a device-to-device copy
  prefill   extend (prefill) attention TFLOP/s against torch scaled_dot_product_attention
  engine    decode tokens/s at batch 1/16/64/256, cuda_graphs on (and off at batch 1),
            random-weight llama-3-8b and smollm2-135m shapes in bf16
  hf        the same workload through transformers' generate (same weights, same prompt ids,
            same output length) at a couple of batch sizes
  quant     low-bit weights: achieved bandwidth (weight bytes read / time) of the int8 / int4 /
            fp8 matrix-vector kernels at batch 1 on Llama-3-8B's layer shapes against a
            device-to-device copy, and batch-1 decode tokens/s of random:llama-3-8b in bf16 vs
            int8 vs int4 (`--sections quant` runs it alone)

Needs only the repository and pytest (random weights, no network, no model files). Writes every number
to $OUT/gpu_check.json when OUT is set (or --json PATH).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:  # the Triton interpreter must be chosen before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's minillm, installed or not
sys.path.insert(1, str(ROOT / "tests"))  # kernel_utils: the shapes and tolerances the gpu tests use

import kernel_utils as ku  # noqa: E402
import triton  # noqa: E402

GPU_TESTS = ROOT / "tests" / "test_gpu_kernels.py"
LLAMA_8B_ATTN = {k: ku.GPU_MODEL_SHAPES["llama-3-8b"][k] for k in ("num_heads", "num_kv_heads", "head_dim")}


# ----------------------------------------------------------------------------- helpers
class Clock:
    """The run's time budget: every section prints where it stands."""

    def __init__(self, budget_s: float):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    @property
    def left(self) -> float:
        return self.budget_s - self.elapsed

    def line(self, what: str) -> str:
        return f"[{self.elapsed:6.1f} s of {self.budget_s:.0f} s budget, {max(self.left, 0):.0f} s left] {what}"


def sync() -> None:
    if HAS_CUDA:
        torch.cuda.synchronize()


def bench_ms(fn, quick: bool = False) -> float:
    """Median milliseconds per call: triton's do_bench on a GPU (L2 flushed between calls), a
    few perf_counter repeats on a CPU."""
    if HAS_CUDA:
        return float(triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100,
                                             return_mode="median"))
    fn()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[len(times) // 2]


def max_error(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max abs error, allowed error for want's dtype and magnitude): the gpu tests' bound."""
    return ku.max_error(got, want, ku.GPU_TOLERANCE)


def print_table(title: str, rows: list[dict], columns: list[str] | None = None) -> None:
    print(f"\n== {title}")
    if not rows:
        print("  (no rows)")
        return
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))

    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return "" if v is None else str(v)

    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  " + " | ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  " + "-+-".join("-" * w for w in widths))
    for row in cells:
        print("  " + " | ".join(v.ljust(w) for v, w in zip(row, widths)))


def free_memory() -> None:
    gc.collect()
    if HAS_CUDA:
        torch.cuda.empty_cache()


def randn(shape, dtype, dev, seed: int) -> torch.Tensor:
    """Standard normal drawn on the device itself (GBs of test data would take long on the host)."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    return torch.randn(shape, generator=gen, device=dev, dtype=dtype)


def paged_pool(num_seqs: int, seq_len: int, num_kv_heads: int, head_dim: int, block_size: int, dtype, dev,
               gen: torch.Generator, spare_blocks: int = 3):
    """K/V pools holding num_seqs sequences of seq_len tokens in shuffled blocks, and their tables."""
    blocks_per_seq = -(-seq_len // block_size)
    num_blocks = num_seqs * blocks_per_seq + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)[: num_seqs * blocks_per_seq]
    tables = perm.view(num_seqs, blocks_per_seq).to(torch.int32).to(dev)
    shape = (num_kv_heads, num_blocks * block_size, head_dim)
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    return randn(shape, dtype, dev, seed), randn(shape, dtype, dev, seed + 1), tables


# ----------------------------------------------------------------------------- (a) kernels
def junit_rows(xml_path: Path) -> list[dict]:
    """One row per test of pytest's JUnit XML (xunit1): the kernel, dtype and shape each test records
    (record_property), max error and bound, ok / the failure's message / the skip's reason."""
    rows = []
    for case in ET.parse(xml_path).getroot().iter("testcase"):
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        row = {"kernel": props.get("kernel") or case.get("name"), "dtype": props.get("dtype", "-"),
               "shape": props.get("shape", "-"), "ok": True}
        for key in ("max_err", "tol"):
            if key in props:
                row[key] = float(props[key])
        row["s"] = round(float(case.get("time") or 0), 2)
        bad = next((e for e in (case.find("failure"), case.find("error")) if e is not None), None)
        skipped = case.find("skipped")
        if bad is not None:
            text = (bad.get("message") or bad.text or "failed").strip()
            row.update(ok=False, error=" ".join(text.split())[:300])
        elif skipped is not None:
            row.update(ok=None, note="skipped: " + (skipped.get("message") or "").strip()[:300])
        rows.append(row)
    return rows


def pytest_workers() -> int:
    """xdist workers for the GPU run: Triton compiles on the CPU, one kernel variant at a time per process."""
    if not HAS_CUDA or importlib.util.find_spec("xdist") is None:
        return 0
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def section_kernels(args, clock: Clock, wanted: list[str]) -> list[dict]:
    """tests/test_gpu_kernels.py through pytest (a process of its own: a kernel fault cannot take this
    one's CUDA context down), its rows from the JUnit XML. Gets the budget the later sections leave."""
    shapes = "tiny" if args.dry_run else ("quick" if args.quick else "full")
    env = dict(os.environ, MINILLM_GPU_SHAPES=shapes, PYTHONUNBUFFERED="1")
    if not HAS_CUDA:  # --dry-run: the same tests on tiny shapes, kernels in the Triton interpreter
        env.update(MINILLM_GPU_TESTS_INTERPRET="1", TRITON_INTERPRET="1")
    later = sum(MIN_SECONDS[s] for s in wanted if s != "kernels")
    timeout = 600.0 if args.dry_run else max(60.0, clock.left - later)
    workers = pytest_workers()
    with tempfile.TemporaryDirectory() as tmp:
        xml_path = Path(tmp) / "gpu_tests.xml"
        cmd = [sys.executable, "-m", "pytest", str(GPU_TESTS), "-q", "-p", "no:cacheprovider", "-o",
               "junit_family=xunit1", f"--junitxml={xml_path}"] + (["-n", str(workers)] if workers else [])
        print(clock.line(f"{' '.join(cmd[2:])} (MINILLM_GPU_SHAPES={shapes}, at most {timeout:.0f} s)"), flush=True)
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # its own group: a timeout ends the xdist workers too
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            raise RuntimeError(f"pytest did not finish within {timeout:.0f} s: {' '.join(output.splitlines()[-5:])}")
        tail = "\n".join(output.rstrip().splitlines()[-12:])
        print("  " + tail.replace("\n", "\n  "))
        rows = junit_rows(xml_path) if xml_path.exists() else []
    if proc.returncode not in (0, 1) or not rows:  # 1: some tests failed, and their rows say which
        rows.append({"kernel": "pytest", "ok": False, "error": f"exit status {proc.returncode}: {tail[-300:]}"})
    return rows


# ----------------------------------------------------------------------------- (b) decode bandwidth
def copy_bandwidth(dev, nbytes: int, quick: bool) -> float:
    """Device-to-device copy: bytes read + written per second."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), quick)
    return 2 * nbytes / (ms * 1e-3)


def section_decode(args, dev, results: dict) -> list[dict]:
    from minillm.kernels.paged_decode import paged_decode_attention

    if args.dry_run:
        dtype, shape, points = torch.float32, dict(num_heads=4, num_kv_heads=2, head_dim=16), [(1, 100), (3, 70)]
        copy_bytes = 64 << 20
    else:
        dtype, shape = torch.bfloat16, LLAMA_8B_ATTN
        points = [(1, 8192), (16, 4096), (64, 2048), (256, 1024)]
        if not args.quick:
            points += [(1, 32768), (16, 512), (256, 4096)]
        copy_bytes = 1 << 30
    copy_bw = copy_bandwidth(dev, copy_bytes, args.quick)
    results["copy_bandwidth_GBps"] = copy_bw / 1e9
    rows = [{"batch": "-", "seq_len": "-", "what": f"D2D copy of {copy_bytes >> 20} MiB", "GB/s": copy_bw / 1e9,
             "% of copy": 100.0}]
    h, hkv, hd = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    gen = torch.Generator().manual_seed(1)
    elt = torch.finfo(dtype).bits // 8
    for batch, seq_len in points:
        row = {"batch": batch, "seq_len": seq_len, "what": f"paged decode H{h}/{hkv} D{hd} {str(dtype)[6:]}"}
        try:
            k, v, tables = paged_pool(batch, seq_len, hkv, hd, 16, dtype, dev, gen, spare_blocks=0)
            q = randn((batch, h, hd), dtype, dev, 10)
            lens = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
            out = torch.empty_like(q)
            ms = bench_ms(lambda: paged_decode_attention(q, k, v, tables, lens, hd ** -0.5, 16, out=out), args.quick)
            kv_bytes = 2 * batch * seq_len * hkv * hd * elt
            bw = kv_bytes / (ms * 1e-3)
            row.update({"KV MiB": kv_bytes / 2**20, "us": ms * 1e3, "GB/s": bw / 1e9, "% of copy": 100 * bw / copy_bw})
            del k, v, tables, q, out
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        free_memory()
    return rows


# ----------------------------------------------------------------------------- (c) prefill attention
def attention_flops(cached: int, new: int, num_heads: int, head_dim: int) -> float:
    """Causal: query i (of `new`, after `cached`) sees cached + i + 1 keys; QK^T and PV, 2 FLOPs per MAC."""
    keys = new * cached + new * (new + 1) / 2
    return 4.0 * num_heads * head_dim * keys


def section_prefill(args, dev) -> list[dict]:
    import torch.nn.functional as F

    from minillm.kernels.extend_attention import extend_attention

    if args.dry_run:
        dtype, shape, points = torch.float32, dict(num_heads=4, num_kv_heads=2, head_dim=16), [(1, 0, 40), (2, 0, 24), (1, 30, 9)]
    else:
        dtype, shape = torch.bfloat16, LLAMA_8B_ATTN
        points = [(1, 0, 4096), (4, 0, 2048), (1, 3584, 512)]  # (batch, cached, new): prefill, prefill, a chunk
        if not args.quick:
            points += [(16, 0, 512), (1, 0, 16384)]
    h, hkv, hd = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    scale = hd ** -0.5
    block = 16
    rows = []
    for batch, cached, new in points:
        total = cached + new
        row = {"batch": batch, "cached": cached, "new": new, "shape": f"H{h}/{hkv} D{hd} {str(dtype)[6:]}"}
        try:
            q = randn((batch, h, new, hd), dtype, dev, 20)
            k = randn((batch, hkv, total, hd), dtype, dev, 21)
            v = randn((batch, hkv, total, hd), dtype, dev, 22)
            # The same keys in a paged pool (identity block tables: sequence b owns a run of blocks).
            blocks_per_seq = -(-total // block)
            slots = blocks_per_seq * block
            k_cache = torch.zeros(hkv, batch * slots, hd, dtype=dtype, device=dev)
            v_cache = torch.zeros_like(k_cache)
            for b in range(batch):
                k_cache[:, b * slots: b * slots + total] = k[b]
                v_cache[:, b * slots: b * slots + total] = v[b]
            tables = torch.arange(batch * blocks_per_seq, dtype=torch.int32, device=dev).view(batch, blocks_per_seq)
            q_flat = q.permute(0, 2, 1, 3).reshape(batch * new, h, hd).contiguous()
            starts = torch.arange(0, batch * new + 1, new, dtype=torch.int32, device=dev)
            lens = torch.full((batch,), total, dtype=torch.int32, device=dev)
            out = torch.empty_like(q_flat)

            def ours():
                return extend_attention(q_flat, k_cache, v_cache, tables, starts, lens, scale, block,
                                        max_query_len=new, out=out)

            if cached:  # bottom-right aligned causal mask: query i sees keys <= cached + i
                mask = (torch.arange(total, device=dev)[None, :] <= cached + torch.arange(new, device=dev)[:, None])
                sdpa_kw = dict(attn_mask=mask)
            else:
                sdpa_kw = dict(is_causal=True)
            k_rep, v_rep = k.repeat_interleave(h // hkv, dim=1), v.repeat_interleave(h // hkv, dim=1)

            def sdpa_gqa():
                return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True, **sdpa_kw)

            def sdpa_rep():
                return F.scaled_dot_product_attention(q, k_rep, v_rep, scale=scale, **sdpa_kw)

            got = ours()
            want = sdpa_rep().permute(0, 2, 1, 3).reshape(batch * new, h, hd)
            err, tol = max_error(got, want)
            flops = batch * attention_flops(cached, new, h, hd)
            ms = bench_ms(ours, args.quick)
            row.update({"ok": bool(err <= tol), "max_err": err, "ours ms": ms, "ours TFLOP/s": flops / ms / 1e9})
            best, which = float("inf"), None
            for name, fn in (("gqa", sdpa_gqa), ("repeat_kv", sdpa_rep)):
                try:
                    t = bench_ms(fn, args.quick)
                    if t < best:
                        best, which = t, name
                except Exception as exc:  # noqa: BLE001 - e.g. enable_gqa unsupported by a backend
                    row[f"sdpa_{name}_error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
            if which is not None:
                row.update({"sdpa ms": best, "sdpa TFLOP/s": flops / best / 1e9, "sdpa variant": which,
                            "ours / sdpa": best / ms})
            del q, k, v, k_cache, v_cache, k_rep, v_rep, out
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        free_memory()
    return rows


# ----------------------------------------------------------------------------- (d) engine decode
def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=gen).tolist()


def run_engine(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    from minillm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sync()
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    sync()
    wall = time.perf_counter() - t
    steps = [s for s in llm.stats.steps if s.kind == "decode"]
    decode_s = sum(s.duration_s for s in steps)
    decode_tokens = sum(s.num_seqs for s in steps)
    full = [s.duration_s for s in steps if s.num_seqs == len(prompts)]
    return {
        "tokens": [o.outputs[0].token_ids for o in outs],
        "decode_steps": len(steps),
        "wall_s": wall,
        "output_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / wall,
        "decode_tok_s": decode_tokens / decode_s if decode_s else float("nan"),
        "step_ms": 1e3 * sorted(full)[len(full) // 2] if full else float("nan"),  # median full-batch step
    }


def engine_models(args) -> list[str]:
    if args.dry_run:
        return ["tiny-llama"]
    return ["llama-3-8b", "smollm2-135m"]


def workload(args) -> tuple[list[int], int, int]:
    """(batch sizes, prompt length, output tokens)."""
    if args.dry_run:
        return [1, 3], 8, 2
    if args.quick:
        return [1, 16, 64, 256], 128, 64
    return [1, 16, 64, 256], 256, 128


def build_engine(model: str, max_num_seqs: int, max_model_len: int, graphs: bool, dry_run: bool):
    from minillm import LLM
    from minillm.models.presets import preset_config

    cfg = preset_config(model)
    dtype = "bfloat16" if HAS_CUDA else "float32"
    per_token = cfg.kv_bytes_per_token(2 if HAS_CUDA else 4)
    kv_bytes = per_token * (max_num_seqs + 1) * (max_model_len + 16)
    use_graphs = graphs and HAS_CUDA
    llm = LLM(f"random:{model}", attention_backend="triton", dtype=dtype, cuda_graphs=use_graphs,
              max_num_seqs=max_num_seqs, max_model_len=max_model_len, kv_cache_bytes=kv_bytes,
              max_num_batched_tokens=max(8192, max_model_len))
    if graphs and not HAS_CUDA:  # no capture on a CPU: run the padded static-buffer path eagerly
        llm.engine.runner.enable_cuda_graphs(max_num_seqs, max_model_len, capture=False)
    return llm


def section_engine(args, clock: Clock, results: dict) -> list[dict]:
    batches, prompt_len, out_len = workload(args)
    max_len = prompt_len + out_len + 16
    rows = []
    for model in engine_models(args):
        if clock.left < 30 and not args.dry_run:
            rows.append({"model": model, "error": "skipped: time budget"})
            continue
        llm = eager = None
        try:
            t = time.perf_counter()
            llm = build_engine(model, triton.next_power_of_2(max(batches)), max_len, graphs=True,
                               dry_run=args.dry_run)
            build_s = time.perf_counter() - t
            vocab = llm.model_config.vocab_size
            t = time.perf_counter()
            if not args.dry_run:
                run_engine(llm, random_prompts(2, prompt_len, vocab, 0), 2)  # warm-up: capture, compile
            graphs = llm.engine.runner.graphs
            warm_s = time.perf_counter() - t
            weight_gb = llm.weight_bytes / 1e9
            print(clock.line(f"engine {model}: built in {build_s:.1f} s, warm-up (graph capture {graphs.capture_s:.1f} s) "
                             f"{warm_s:.1f} s, {weight_gb:.2f} GB of weights"))
            mode = "graphs" if graphs.capture else "padded-eager (CPU: no capture)"
            for batch in batches:
                if clock.left < 15 and not args.dry_run:
                    rows.append({"model": model, "batch": batch, "error": "skipped: time budget"})
                    continue
                replays = graphs.num_steps
                r = run_engine(llm, random_prompts(batch, prompt_len, vocab, batch), out_len)
                row = {"model": model, "batch": batch, "cuda_graphs": mode, "decode tok/s": r["decode_tok_s"],
                       "step ms": r["step_ms"], "output tok/s": r["output_tok_s"], "wall s": r["wall_s"],
                       "graph steps": f"{graphs.num_steps - replays}/{r['decode_steps']}"}  # all decode steps replayed
                if batch == 1:  # weights (+ a little KV) read once per step
                    row["weights GB/s"] = weight_gb / (r["step_ms"] * 1e-3)
                rows.append(row)
            eager = llm.with_levers(cuda_graphs=False, max_num_seqs=4,
                                    kv_cache_bytes=llm.engine.kv_bytes_per_token * 5 * (max_len + 16))
            if not args.dry_run:
                run_engine(eager, random_prompts(1, prompt_len, vocab, 0), 2)
            prompt1 = random_prompts(1, prompt_len, vocab, 1)
            r = run_engine(eager, prompt1, out_len)
            graphs_row = next((x for x in rows if x.get("model") == model and x.get("batch") == 1
                               and "decode tok/s" in x), None)
            row = {"model": model, "batch": 1, "cuda_graphs": "off (eager)", "decode tok/s": r["decode_tok_s"],
                   "step ms": r["step_ms"], "output tok/s": r["output_tok_s"], "wall s": r["wall_s"]}
            if graphs_row:
                row["graphs speedup"] = graphs_row["decode tok/s"] / r["decode_tok_s"]
            # Graph replay must give eager's tokens: batch 1 (bucket 1, no padding) and batch 3
            # (bucket 4, one padded row). Padding changes matmul row counts, which may change bf16
            # rounding on a GPU, so batch 3 is reported rather than required.
            row["same tokens as graphs"] = f"{int(run_engine(llm, prompt1, out_len)['tokens'] == r['tokens'])}/1"
            rows.append(row)
            prompts3 = random_prompts(3, prompt_len, vocab, 3)
            want, got = run_engine(eager, prompts3, out_len)["tokens"], run_engine(llm, prompts3, out_len)["tokens"]
            rows.append({"model": model, "batch": 3, "cuda_graphs": "bucket 4 vs eager",
                         "same tokens as graphs": f"{sum(a == b for a, b in zip(want, got))}/3"})
        except Exception as exc:  # noqa: BLE001
            rows.append({"model": model, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            traceback.print_exc()
        finally:
            del llm, eager
            free_memory()
    return rows


# ----------------------------------------------------------------------------- (e) transformers
def to_hf_state_dict(model, cfg) -> dict[str, torch.Tensor]:
    """minillm's fused parameters -> transformers Llama names (views, no copies)."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    sd = {}
    for name, p in model.named_parameters():
        t = p.data
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            pre = f"model.layers.{i}."
            module, kind = rest.rsplit(".", 1)
            if module == "qkv_proj":
                sd[pre + f"self_attn.q_proj.{kind}"] = t[:q]
                sd[pre + f"self_attn.k_proj.{kind}"] = t[q:q + kv]
                sd[pre + f"self_attn.v_proj.{kind}"] = t[q + kv:]
            elif module == "gate_up_proj":
                sd[pre + f"mlp.gate_proj.{kind}"] = t[:inter]
                sd[pre + f"mlp.up_proj.{kind}"] = t[inter:]
            elif module == "o_proj":
                sd[pre + f"self_attn.o_proj.{kind}"] = t
            elif module == "down_proj":
                sd[pre + f"mlp.down_proj.{kind}"] = t
            else:
                sd[pre + rest] = t
        elif name.startswith("lm_head."):
            sd[name] = t
        else:
            sd["model." + name] = t
    return sd


def build_hf_model(llm):
    """transformers' LlamaForCausalLM of the same config, holding a copy of the engine's weights."""
    import transformers

    from minillm.models.presets import hf_config_dict

    cfg = llm.model_config
    hf_cfg = transformers.LlamaConfig(**hf_config_dict(cfg))
    dev = torch.device("cuda" if HAS_CUDA else "cpu")
    with torch.device(dev):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=llm.dtype)
    params = dict(hf.named_parameters())
    sd = to_hf_state_dict(llm.engine.model, cfg)
    missing = sorted(set(params) - set(sd))
    if missing:
        raise KeyError(f"no minillm weight for transformers parameters {missing[:4]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(sd[name])
    return hf.eval()


def hf_generate(hf, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float]:
    dev = next(hf.parameters()).device
    ids = torch.tensor(prompts, device=dev)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
              do_sample=False, pad_token_id=0)
    sync()
    t = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(ids, **kw)
    sync()
    wall = time.perf_counter() - t
    return out[:, ids.shape[1]:].tolist(), wall


def section_hf(args, clock: Clock) -> list[dict]:
    if args.dry_run:
        batches, prompt_len, out_len = [2], 8, 3
    else:
        batches, prompt_len, out_len = ([1, 16] if args.quick else [1, 16, 64]), 128, 64
    rows = []
    for model in engine_models(args):
        if clock.left < 40 and not args.dry_run:
            rows.append({"model": model, "error": "skipped: time budget"})
            continue
        llm = hf = None
        try:
            llm = build_engine(model, max(batches), prompt_len + out_len + 16, graphs=True, dry_run=args.dry_run)
            vocab = llm.model_config.vocab_size
            hf = build_hf_model(llm)
            if not args.dry_run:
                warm = random_prompts(1, prompt_len, vocab, 99)
                run_engine(llm, warm, 2)
                hf_generate(hf, warm, 2)
            for batch in batches:
                if clock.left < 20 and not args.dry_run:
                    rows.append({"model": model, "batch": batch, "error": "skipped: time budget"})
                    continue
                prompts = random_prompts(batch, prompt_len, vocab, 1000 + batch)
                ours = run_engine(llm, prompts, out_len)
                theirs, hf_wall = hf_generate(hf, prompts, out_len)
                same = sum(a == b for a, b in zip(ours["tokens"], theirs))
                agree = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
                         for a, b in zip(ours["tokens"], theirs)]
                hf_tok_s = batch * out_len / hf_wall
                rows.append({"model": model, "batch": batch, "prompt": prompt_len, "new": out_len,
                             "minillm tok/s": ours["output_tok_s"], "transformers tok/s": hf_tok_s,
                             "speedup": ours["output_tok_s"] / hf_tok_s,
                             "identical outputs": f"{same}/{batch}",
                             "min agreeing prefix": min(agree)})
        except Exception as exc:  # noqa: BLE001
            rows.append({"model": model, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
            traceback.print_exc()
        finally:
            del llm, hf
            free_memory()
    return rows


# ----------------------------------------------------------------------------- (f) low-bit weights
LLAMA_8B_LINEARS = [("o_proj-shaped", 4096, 4096), ("gate/up-shaped", 14336, 4096), ("down_proj-shaped", 4096, 14336)]
GPT_FAST_A100 = {"int8": 1.5, "int4 g128": 1.9}  # gpt-fast's batch-1 decode speed-up over bf16 on an A100


def stream_us(calls: list, quick: bool) -> float:
    """Median microseconds per call of `calls` (one per weight copy: together they overflow L2, so
    every call reads its weights from HBM). On a GPU all calls are captured in one CUDA graph and
    replayed, which times the kernels alone, without Python's launch gaps; on a CPU, perf_counter."""
    for call in calls:  # compile and warm up
        call()
    sync()
    if not HAS_CUDA:
        t = time.perf_counter()
        for call in calls:
            call()
        return 1e6 * (time.perf_counter() - t) / len(calls)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    sync()
    times = []
    for _ in range(5 if quick else 15):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    del graph
    return sorted(times)[len(times) // 2]


def copies_for(nbytes: int, dev) -> int:
    """Weight copies whose calls read at least 4x the L2 cache between two reads of one copy."""
    if not HAS_CUDA:
        return 1
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
    return max(2, min(64, -(-4 * l2 // max(nbytes, 1))))


def quant_gemv_rows(args, dev, copy_bw: float) -> list[dict]:
    """Batch-1 matrix-vector time of bf16 (torch), int8, int4 (g128) and fp8 on 8B-shaped layers."""
    import torch.nn.functional as F

    from minillm.kernels.channel_matmul import (fp8_matmul, fp8_matmul_reference, fp8_supported, int8_matmul,
                                                int8_matmul_reference)
    from minillm.kernels.int4_matmul import int4_matmul, int4_matmul_reference
    from minillm.quant import pack_int4, quantize_fp8, quantize_int4, quantize_int8

    if args.dry_run:
        shapes, group, dtype = [("tiny", 80, 96), ("tiny", 131, 200)], 32, torch.float32
    else:
        shapes, group, dtype = LLAMA_8B_LINEARS, 128, torch.bfloat16
    dname = str(dtype)[6:]
    rows = []
    for label, n, k in shapes:
        w = randn((n, k), dtype, dev, n + k) * 0.02
        x = randn((1, k), dtype, dev, 7)
        formats = {}
        try:
            formats[f"{dname} (torch F.linear)"] = ((w,), n * k * w.element_size(), lambda t: F.linear(x, t[0]),
                                                   None)
            q8, s8 = quantize_int8(w)
            formats["int8"] = ((q8, s8), n * k + 4 * n, lambda t: int8_matmul(x, *t),
                               lambda t: int8_matmul_reference(x, *t))
            q4, s4, z4 = quantize_int4(F.pad(w, (0, (-k) % group)), group)  # zero columns up to the group size
            t4 = (pack_int4(q4), s4.to(torch.bfloat16), z4.to(torch.bfloat16))
            del q4
            kp = k + (-k) % group
            formats[f"int4 g{group}"] = (t4, n * kp // 2 + 2 * 2 * n * (kp // group),  # + bf16 scales and zeros
                                         lambda t: int4_matmul(x, *t, group),
                                         lambda t: int4_matmul_reference(x, *t, group))
            if fp8_supported(dev):
                formats["fp8 e4m3"] = (quantize_fp8(w), n * k + 4 * n, lambda t: fp8_matmul(x, *t),
                                       lambda t: fp8_matmul_reference(x, *t))
            else:
                rows.append({"layer": label, "N x K": f"{n} x {k}", "weights": "fp8 e4m3",
                             "note": "skipped: the fp8 kernels run on sm_90+ (QuantizedLinear keeps its dequantize path)"})
        except Exception as exc:  # noqa: BLE001
            rows.append({"layer": label, "N x K": f"{n} x {k}", "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        del w
        base_us = None
        for name, (tensors, nbytes, fn, ref) in formats.items():
            row = {"layer": label, "N x K": f"{n} x {k}", "weights": name, "MiB": nbytes / 2**20}
            try:
                if ref is not None:  # the kernel still matches its reference at this shape
                    err, tol = max_error(fn(tensors), ref(tensors))
                    row.update(ok=bool(err <= tol), max_err=err)
                copies = [tensors] + [tuple(t.clone() for t in tensors) for _ in range(copies_for(nbytes, dev) - 1)]
                us = stream_us([lambda t=t: fn(t) for t in copies], args.quick)
                bw = nbytes / (us * 1e-6)
                row.update({"us": us, "GB/s": bw / 1e9, "% of copy": 100 * bw / copy_bw, "copies": len(copies)})
                if base_us is None:
                    base_us = us
                else:
                    row[f"speed-up vs {dname}"] = base_us / us
                del copies
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            free_memory()
        del formats
        free_memory()
    return rows


def quant_engine_rows(args, clock: Clock) -> list[dict]:
    """Batch-1 decode tokens/s: the float model, then int8 and int4 (g128) engines quantizing its
    weights in memory (LLM.with_levers), cuda_graphs on. Weight bytes per setting and the GB/s the
    decode step's weight reads reach."""
    from minillm.quant import QuantizedLinear

    model = "tiny-llama" if args.dry_run else "llama-3-8b"
    prompt_len, out_len = (8, 3) if args.dry_run else ((128, 64) if args.quick else (128, 128))
    max_len = prompt_len + out_len + 16
    rows = []
    base = None
    engines = []
    try:
        base = build_engine(model, 1, max_len, graphs=True, dry_run=args.dry_run)
        engines = [(str(base.dtype)[6:].replace("bfloat16", "bf16").replace("float32", "fp32"), base)]
        for label, levers in (("int8", dict(weight_dtype="int8")),
                              ("int4 g128", dict(weight_dtype="int4", weight_group_size=128))):
            if clock.left < 30 and not args.dry_run:
                rows.append({"model": model, "weights": label, "error": "skipped: time budget"})
                continue
            try:
                engines.append((label, base.with_levers(**levers)))
            except Exception as exc:  # noqa: BLE001
                rows.append({"model": model, "weights": label, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        vocab = base.model_config.vocab_size
        prompt = random_prompts(1, prompt_len, vocab, 5)
        base_tok_s = base_tokens = None
        for label, llm in engines:
            row = {"model": model, "weights": label}
            try:
                if not args.dry_run:
                    run_engine(llm, random_prompts(1, prompt_len, vocab, 0), 2)  # warm-up: compile, capture
                r = run_engine(llm, prompt, out_len)
                gb = llm.weight_bytes / 1e9
                paths = sorted({m.path for m in llm.engine.model.modules() if isinstance(m, QuantizedLinear)})
                row.update({"weights GB": gb, "path": ",".join(paths) or "float", "decode tok/s": r["decode_tok_s"],
                            "step ms": r["step_ms"], "weights GB/s": gb / (r["step_ms"] * 1e-3)})
                if base_tok_s is None:
                    base_tok_s, base_tokens = r["decode_tok_s"], r["tokens"][0]
                else:
                    row["speed-up"] = r["decode_tok_s"] / base_tok_s
                    row["gpt-fast A100"] = GPT_FAST_A100.get(label)
                    # random weights: tokens drift apart quickly; how long they agree is for information
                    row["same tokens as float"] = next((i for i, (a, b) in enumerate(zip(base_tokens, r["tokens"][0]))
                                                        if a != b), len(base_tokens))
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
                traceback.print_exc()
            rows.append(row)
            print(clock.line(f"quant engine {model} {label}: {row.get('decode tok/s', float('nan')):.1f} tok/s"), flush=True)
    except Exception as exc:  # noqa: BLE001
        rows.append({"model": model, "error": f"{type(exc).__name__}: {str(exc)[:300]}"})
        traceback.print_exc()
    finally:
        del base, engines
        free_memory()
    return rows


def section_quant(args, dev, clock: Clock, entry: dict) -> list[dict]:
    copy_bytes = (64 << 20) if args.dry_run else (1 << 30)
    copy_bw = copy_bandwidth(dev, copy_bytes, args.quick)
    entry["copy_bandwidth_GBps"] = copy_bw / 1e9
    rows = [{"layer": "-", "weights": f"D2D copy of {copy_bytes >> 20} MiB (read + write)", "GB/s": copy_bw / 1e9,
             "% of copy": 100.0}]
    rows += quant_gemv_rows(args, dev, copy_bw)
    engine = quant_engine_rows(args, clock)
    # main() prints these two tables (their columns differ) instead of one table of every row
    entry["tables"] = [("batch-1 matrix-vector: weight bytes read / time, against a device-to-device copy", rows),
                       ("batch-1 decode tokens/s, float vs int8 vs int4 (gpt-fast on an A100: 1.5x and 1.9x)", engine)]
    return rows + engine


# ----------------------------------------------------------------------------- main
SECTIONS = ["kernels", "decode", "prefill", "engine", "hf", "quant"]
TITLES = {
    "kernels": "(a) Triton kernels vs torch references, the engine on the device (pytest tests/test_gpu_kernels.py)",
    "decode": "(b) paged decode attention: KV bandwidth",
    "prefill": "(c) prefill / extend attention vs scaled_dot_product_attention",
    "engine": "(d) engine decode tokens/s (random weights)",
    "hf": "(e) minillm vs transformers generate (same weights, prompts, lengths)",
    "quant": "(f) low-bit weights: matrix-vector bandwidth and decode tokens/s",
}
# Rough minimum seconds a section needs on an H100/H200 (skip it when less is left).
MIN_SECONDS = {"kernels": 60, "decode": 15, "prefill": 15, "engine": 40, "hf": 40, "quant": 60}


def environment() -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "device": torch.cuda.get_device_name() if HAS_CUDA else
            f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        info["transformers"] = None
    if HAS_CUDA:
        from minillm.hardware import describe_gpu_formats

        info["capability"] = describe_gpu_formats(torch.cuda.get_device_capability())
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer shapes and shorter outputs")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes (runs on a CPU under the Triton interpreter)")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    ap.add_argument("--budget-s", type=float, default=450.0, help="time budget; sections past it are skipped")
    ap.add_argument("--json", default=None, help="where to write the JSON (default: $OUT/gpu_check.json if OUT is set)")
    args = ap.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; choose from {SECTIONS}")
    if not HAS_CUDA and not args.dry_run:
        print("no CUDA device: the full check needs a GPU. Use --dry-run to walk the sections on tiny shapes "
              "under the Triton interpreter.")
        return 2

    clock = Clock(args.budget_s)
    env = environment()
    mode = "dry-run" if args.dry_run else ("quick" if args.quick else "full")
    results = {"mode": mode, "environment": env, "budget_s": args.budget_s, "sections": {}}
    print(f"minillm gpu_check ({mode}) on {env['device']}: torch {env['torch']}, triton {env['triton']}, "
          f"transformers {env['transformers']}, CUDA {env['cuda']}")
    dev = torch.device("cuda" if HAS_CUDA else "cpu")
    torch.manual_seed(0)

    runners = {
        "kernels": lambda extra: section_kernels(args, clock, wanted),
        "decode": lambda extra: section_decode(args, dev, extra),
        "prefill": lambda extra: section_prefill(args, dev),
        "engine": lambda extra: section_engine(args, clock, extra),
        "hf": lambda extra: section_hf(args, clock),
        "quant": lambda extra: section_quant(args, dev, clock, extra),
    }
    failed = 0
    for name in SECTIONS:
        if name not in wanted:
            continue
        entry = {"title": TITLES[name], "rows": [], "error": None}
        results["sections"][name] = entry
        if clock.left < MIN_SECONDS[name] and not args.dry_run:
            entry["error"] = f"skipped: {clock.left:.0f} s left of the budget, the section needs about {MIN_SECONDS[name]} s"
            print(clock.line(f"{TITLES[name]}: {entry['error']}"))
            failed += 1
            continue
        print(clock.line(f"{TITLES[name]} ..."), flush=True)
        t = time.perf_counter()
        try:
            entry["rows"] = runners[name](entry)
        except Exception as exc:  # noqa: BLE001 - one section's failure must not lose the others
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()
            print(entry["traceback"])
        entry["seconds"] = round(time.perf_counter() - t, 1)
        bad = [r for r in entry["rows"] if r.get("error") or r.get("ok") is False]
        entry["num_failed_rows"] = len(bad)
        failed += bool(entry["error"]) + len(bad)
        header = f"{TITLES[name]} — {env['device']}, torch {env['torch']}, triton {env['triton']} ({entry['seconds']} s)"
        tables = entry.pop("tables", None)  # a section whose rows form tables of their own
        if tables:
            for title, rows in tables:
                print_table(f"{header}: {title}", rows)
        else:
            print_table(header, entry["rows"])
        if entry["error"]:
            print(f"  SECTION ERROR: {entry['error']}")
        free_memory()

    results["total_s"] = round(clock.elapsed, 1)
    results["num_failed"] = failed
    print(f"\n{clock.line('done')}: {failed} failed rows/sections")
    path = args.json or (os.path.join(os.environ["OUT"], "gpu_check.json") if os.environ.get("OUT") else None)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

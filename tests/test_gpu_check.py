"""scripts/gpu_check.py can only measure on a GPU, but every section's code runs here:
`--dry-run` walks all six sections on tiny shapes, the Triton kernels in the interpreter."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
def test_full_run_needs_a_gpu(capsys):
    assert load_script().main([]) == 2
    assert "--dry-run" in capsys.readouterr().out


def test_dry_run_walks_every_section(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["mode"] == "dry-run" and report["num_failed"] == 0
    assert {"torch", "triton", "transformers", "device"} <= set(report["environment"])
    sections = report["sections"]
    assert list(sections) == ["kernels", "decode", "prefill", "engine", "hf", "quant"]
    for name, entry in sections.items():
        assert entry["error"] is None and entry["rows"], name
        assert not [r for r in entry["rows"] if r.get("error")], (name, entry["rows"])
    kernels = {r["kernel"] for r in sections["kernels"]["rows"]}
    assert {"store_kv", "paged_decode", "extend_attention", "rmsnorm", "rotary", "silu_and_mul",
            "int8_matmul", "int4_matmul g32", "fp8_matmul", "fp8_matmul fp8 x fp8"} <= kernels
    assert all(r["ok"] for r in sections["kernels"]["rows"])
    assert all(r["ok"] for r in sections["prefill"]["rows"])         # our extend kernel == SDPA
    engine = sections["engine"]["rows"]
    timed = [r for r in engine if "decode tok/s" in r]
    assert {r["batch"] for r in timed} == {1, 3} and all(r["decode tok/s"] > 0 for r in timed)
    replayed = [r["graph steps"].split("/") for r in timed if "graph steps" in r]
    assert len(replayed) == 2 and all(a == b != "0" for a, b in replayed)  # every decode step took the graph path
    same = [r["same tokens as graphs"] for r in engine if "same tokens as graphs" in r]
    assert same == ["1/1", "3/3"]  # the padded static-buffer path gives eager's tokens
    # transformers on the engine's own weights gives the engine's greedy tokens (fp32 on the CPU)
    assert all(r["identical outputs"] == f"{r['batch']}/{r['batch']}" for r in sections["hf"]["rows"])
    # (f) quant: every low-bit GEMV matches its reference and is timed against the copy bandwidth;
    # the float / int8 / int4 engines decode, int4 storing the fewest weight bytes
    quant = sections["quant"]["rows"]
    assert sections["quant"]["copy_bandwidth_GBps"] > 0
    gemv = [r for r in quant if "N x K" in r]
    assert {r["weights"] for r in gemv} == {"float32 (torch F.linear)", "int8", "int4 g32", "fp8 e4m3"}
    assert all(r["GB/s"] > 0 and r["% of copy"] > 0 for r in gemv)
    assert all(r["ok"] for r in gemv if r["weights"] != "float32 (torch F.linear)")
    engines = {r["weights"]: r for r in quant if "decode tok/s" in r}
    assert set(engines) == {"fp32", "int8", "int4 g128"} and all(r["decode tok/s"] > 0 for r in engines.values())
    assert engines["int4 g128"]["weights GB"] < engines["int8"]["weights GB"] < 0.5 * engines["fp32"]["weights GB"]
    assert engines["fp32"]["path"] == "float" and "int8pack" in engines["int8"]["path"]  # the CPU fast paths
    for title in ("(a) Triton kernels", "(b) paged decode", "(c) prefill", "(d) engine", "(e) minillm vs transformers",
                  "(f) low-bit weights", "batch-1 matrix-vector", "batch-1 decode tokens/s"):
        assert title in proc.stdout
    assert "s left]" in proc.stdout  # the time budget printout

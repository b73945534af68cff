"""scripts/gpu_check.py can only measure on a GPU, but every section's code runs here:
`--dry-run` walks all six sections on tiny shapes, the Triton kernels in the interpreter (its
kernels section: tests/test_gpu_kernels.py through pytest, MINILLM_GPU_TESTS_INTERPRET=1)."""

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
    # (a) is tests/test_gpu_kernels.py run by pytest (tiny shapes, the interpreter): one row per test
    kernel_rows = sections["kernels"]["rows"]
    kernels = {r["kernel"] for r in kernel_rows}
    assert {"store_kv", "paged_decode", "extend_attention", "rmsnorm", "rotary", "silu_and_mul",
            "int8_matmul", "int4_matmul g32", "fp8_matmul", "fp8_matmul fp8 x fp8"} <= kernels
    assert {"store_kv int8", "store_kv fp8", "paged_decode int8 kv", "paged_decode fp8 kv", "extend_attention int8 kv",
            "extend_attention fp8 kv", "rmsnorm+residual", "store_kv+extend+paged_decode",
            "engine: triton == torch backend", "engine: cuda_graphs on == off", "every kernel module has a case"} <= kernels
    assert all(r["ok"] for r in kernel_rows)                         # none failed, none skipped
    compared = [r for r in kernel_rows if "max_err" in r]
    assert len(compared) >= 40 and all(r["max_err"] <= r["tol"] for r in compared)
    assert {r["dtype"] for r in compared} == {"fp32", "bf16"} and all(r["shape"] != "-" for r in compared)
    assert "MINILLM_GPU_SHAPES=tiny" in proc.stdout and " passed" in proc.stdout   # pytest's own summary line
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
    assert engines["fp32"]["path"] == "float" and engines["int8"]["path"] in ("cpu", "int8pack")  # the CPU fast paths
    for title in ("(a) Triton kernels", "(b) paged decode", "(c) prefill", "(d) engine", "(e) minillm vs transformers",
                  "(f) low-bit weights", "batch-1 matrix-vector", "batch-1 decode tokens/s"):
        assert title in proc.stdout
    assert "s left]" in proc.stdout  # the time budget printout


def test_junit_rows_read_pass_fail_and_skip(tmp_path):
    """The kernels section's rows come from pytest's JUnit XML: the properties each gpu test records,
    a failure's message, a skip's reason (a card without fp8, say)."""
    xml = tmp_path / "gpu_tests.xml"
    xml.write_text("""<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.test_gpu_kernels" name="test_kernel_matches_reference[rotary-bf16-tiny]" time="0.25">
 <properties><property name="kernel" value="rotary"/><property name="dtype" value="bf16"/>
 <property name="shape" value="H4/2 D16"/><property name="max_err" value="0.01"/><property name="tol" value="0.05"/>
 </properties></testcase>
<testcase classname="tests.test_gpu_kernels" name="test_kernel_matches_reference[paged_decode-fp16-tiny]" time="1.5">
 <properties><property name="kernel" value="paged_decode"/><property name="dtype" value="fp16"/>
 <property name="shape" value="H4/2 D16 L70"/><property name="max_err" value="0.5"/><property name="tol" value="0.002"/>
 </properties><failure message="AssertionError: paged_decode fp16: max error 0.5 &gt; 0.002 at index [1, 0, 3]">trace
 </failure></testcase>
<testcase classname="tests.test_gpu_kernels" name="test_quant_matmul_matches_reference[fp8-M1-bf16-tiny]" time="0">
 <properties><property name="kernel" value="fp8_matmul"/><property name="dtype" value="bf16"/>
 <property name="shape" value="M1 N99 K56"/></properties>
 <skipped type="pytest.skip" message="sm_80: the fp8 weight kernels run on sm_90+">skip</skipped></testcase>
</testsuite></testsuites>""")
    rows = load_script().junit_rows(xml)
    assert rows[0] == {"kernel": "rotary", "dtype": "bf16", "shape": "H4/2 D16", "ok": True, "max_err": 0.01,
                       "tol": 0.05, "s": 0.25}
    assert rows[1]["ok"] is False and rows[1]["max_err"] == 0.5
    assert rows[1]["error"].startswith("AssertionError: paged_decode fp16: max error 0.5 > 0.002 at index [1, 0, 3]")
    assert rows[2]["ok"] is None and rows[2]["note"] == "skipped: sm_80: the fp8 weight kernels run on sm_90+"
    assert "error" not in rows[2]   # a skip is not a failed row

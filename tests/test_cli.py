"""The command line: generate streams, bench prints its table, doctor explains, model provisions."""

import json

from minillm.bench.runner import percentile
from minillm.cli import _parse_levers, main


def test_parse_levers_types():
    assert _parse_levers(["kv_cache=false", "max_num_seqs=4", "gpu_hourly_usd=2.5", "dtype=float32", "model=none"]) == {
        "kv_cache": False, "max_num_seqs": 4, "gpu_hourly_usd": 2.5, "dtype": "float32", "model": None}


def test_percentile_matches_numpy_linear():
    import numpy as np

    values = [3.0, 1.0, 4.0, 1.5, 9.0, 2.6]
    for q in (0, 50, 90, 100):
        assert abs(percentile(values, q) - float(np.percentile(values, q))) < 1e-12


def test_generate_streams_the_answer(capsys):
    assert main(["generate", "What is the capital of France?", "--max-tokens", "12"]) == 0
    assert "Paris" in capsys.readouterr().out


def test_generate_bad_input_is_explained(capsys):
    assert main(["generate", "hi", "--temperature", "-1"]) == 2
    err = capsys.readouterr().err
    assert "temperature=-1.0" in err and ">= 0" in err


def test_bench_prints_table_and_bound(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    assert main(["bench", "--num-requests", "2", "--max-tokens", "4", "--compare-kv-cache", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for needle in ("TTFT p50 ms", "TPOT p90 ms", "out tok/s", "KV MiB", "$/Mtok", "memory-bandwidth bound", "kv_cache=False"):
        assert needle in text, f"{needle!r} missing from:\n{text}"
    report = json.loads(out_json.read_text())
    rows = report["results"]
    assert len(rows) == 2
    assert rows[0]["peak_kv_mib"] > 0 and rows[1]["peak_kv_mib"] == 0  # no cache, no KV bytes
    assert all(r["output_tok_per_s"] > 0 and r["usd_per_mtok"] > 0 for r in rows)


def test_doctor_without_model(capsys):
    code = main(["doctor", "--no-model"])
    text = capsys.readouterr().out
    assert "triton kernel" in text and "matches torch" in text
    assert code == 0, text


def test_model_check(capsys):
    assert main(["model", "--check"]) == 0
    assert capsys.readouterr().out.startswith("ok:")

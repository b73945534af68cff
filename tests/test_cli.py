"""The command line: generate streams, bench prints its table, doctor explains, model provisions."""

import json
import re

import pytest

from minillm.cli import _parse_levers, main
from minillm.serve.client import percentile


def test_parse_levers_types():
    assert _parse_levers(["kv_cache=false", "max_num_seqs=4", "gpu_hourly_usd=2.5", "dtype=float32", "model=none",
                          "max_model_len=32k", "cpu_threads=2", "weight_dtype=int8"]) == {
        "kv_cache": False, "max_num_seqs": 4, "gpu_hourly_usd": 2.5, "dtype": "float32", "model": None,
        "max_model_len": 32000, "cpu_threads": 2, "weight_dtype": "int8"}


@pytest.mark.parametrize("pair, says", [("kv_cashe=true", "'kv_cashe' is no lever; the levers are"),
                                        ("max_num_seqs=four", "max_num_seqs='four': expected an integer"),
                                        ("kv_cache=maybe", "kv_cache='maybe': expected true or false"),
                                        ("kv_cache", "--set takes NAME=VALUE")])
def test_parse_levers_names_the_bad_pair(pair, says):
    with pytest.raises(SystemExit, match=re.escape(says)):
        _parse_levers([pair])


def test_every_lever_has_help_text():
    from minillm import levers

    assert all(levers.help_text(f.name) for f in levers.fields())


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
    code = main(["doctor", "--no-model", "--capability", "75"])
    text = capsys.readouterr().out
    assert "triton kernel" in text and "matches torch" in text
    formats = next(line for line in text.splitlines() if "gpu formats" in line)
    assert "sm_75 (T4" in formats and "serves float16" in formats and "Triton KV formats int8;" in formats, formats
    assert code == 0, text


def test_model_check(capsys):
    assert main(["model", "--check"]) == 0
    assert capsys.readouterr().out.startswith("ok:")


def test_mixed_workload_shape(default_llm):
    from minillm.bench.workloads import mixed_workload, shipped_corpus

    tok = default_llm.tokenizer
    reqs = mixed_workload(tok, num_requests=50, scale=0.125, seed=1)
    assert len(reqs) == 50
    lens = [len(r.prompt["prompt_token_ids"]) for r in reqs]
    outs = [r.params.max_tokens for r in reqs]
    assert min(lens) >= 12 and max(lens) <= 128 and min(outs) >= 12 and max(outs) <= 128
    assert len(set(lens)) > 20 and len(set(outs)) > 20          # spread, not one length
    assert all(r.params.ignore_eos for r in reqs)
    assert tok.decode(reqs[0].prompt["prompt_token_ids"]).strip() in shipped_corpus()   # real text, cut from the corpus
    again = mixed_workload(tok, num_requests=50, scale=0.125, seed=1)
    assert [r.prompt for r in again] == [r.prompt for r in reqs]   # the seed fixes the workload
    with pytest.raises(ValueError, match="scale=2 must be in"):
        mixed_workload(tok, scale=2)


def test_bench_mixed_prints_batching_and_paging_side_by_side(tmp_path, capsys):
    out_json = tmp_path / "mixed.json"
    assert main(["bench", "--workload", "mixed", "--num-requests", "6", "--scale", "0.02", "--set", "max_num_seqs=3",
                 "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    for needle in ("minillm static", "minillm continuous", "contiguous, fixed KV", "paged, fixed KV",
                   "continuous / static (minillm):", "as many sequences at once as contiguous"):
        assert needle in text, f"{needle!r} missing from:\n{text}"
    report = json.loads(out_json.read_text())
    rows = {r["label"]: r for r in report["rows"]}
    assert all(r["same_tokens"] == "6/6" for r in rows.values())           # greedy: every setting agrees
    assert rows["contiguous, fixed KV"]["peak_running"] == report["reservations"]
    assert rows["paged, fixed KV"]["peak_running"] > rows["contiguous, fixed KV"]["peak_running"]
    assert report["paged_over_contiguous_concurrency"] > 1

"""minillm bench --compare-peers (minillm/bench/peers.py): rows and ratios from timings, the command line, the
minillm rows on a tiny random model, and (when ctranslate2 is installed) every row on a tiny checkpoint."""

from __future__ import annotations

import importlib.util
import json
import shutil
import time

import pytest
import torch

from conftest import tokenizer_files

from minillm import LLM
from minillm.bench import peer_engines, peer_rows, peers
from minillm.bench.peer_rows import Run, best_minillm_vs, format_peers, summarize
from minillm.bench.peers import compare_peers

GB = 1e9


def fake_runs(ttft: float, step: float, n: int, tokens: list[int]) -> Run:
    """A request whose first token comes at `ttft` and each next one `step` later."""
    return Run(ttft, ttft + (n - 1) * step, tokens)


# ------------------------------------------------------------------ rows and ratios on fake timings
def test_rows_and_ratios_from_fake_timings():
    n = 5
    same, other = [7, 8, 9, 10, 11], [7, 8, 0, 0, 0]
    runs = {
        # minillm fp32: 10 tok/s in round 1 (both prompts), 20 in round 2 -> median of rounds 15
        "minillm fp32": [[fake_runs(0.1, 0.1, n, same), fake_runs(0.3, 0.1, n, same)],
                         [fake_runs(0.1, 0.05, n, same), fake_runs(0.1, 0.05, n, same)]],
        # int8: 40 tok/s every time, the second prompt parts from fp32
        "minillm int8": [[fake_runs(0.2, 0.025, n, same), fake_runs(0.2, 0.025, n, other)]] * 2,
        # CTranslate2 int8: per round the median of 25 and 50 = 37.5
        "CTranslate2 int8": [[fake_runs(0.05, 0.04, n, same), fake_runs(0.05, 0.02, n, same)]] * 2,
    }
    weights = {"minillm fp32": 4 * GB // 10, "minillm int8": GB // 10, "CTranslate2 int8": GB // 8}
    rows = summarize(runs, weights, {"llama.cpp": "not installed"}, bandwidth=20 * GB)
    by = {r.engine: r for r in rows}
    assert [r.engine for r in rows] == ["minillm fp32", "minillm int8", "CTranslate2 int8", "llama.cpp"]
    fp32, int8, ct2, skipped = (by[k] for k in ("minillm fp32", "minillm int8", "CTranslate2 int8", "llama.cpp"))
    assert fp32.tok_s_rounds == pytest.approx([10, 20]) and fp32.tok_s == pytest.approx(15)
    assert fp32.ttft_ms == pytest.approx(100)      # median of 100, 300, 100, 100 ms
    # bound: 20 GB/s / 0.4 GB = 50 tok/s -> 15 is 30%; int8: 200 tok/s bound -> 40 is 20%
    assert fp32.pct_of_bound == pytest.approx(30) and int8.pct_of_bound == pytest.approx(20)
    assert int8.vs_base == pytest.approx(40 / 15) and ct2.tok_s == pytest.approx(37.5)
    assert (fp32.agree, int8.agree, ct2.agree) == (2, 1, 2)
    assert skipped.skipped == "not installed" and skipped.tok_s is None and skipped.vs_base is None
    assert best_minillm_vs(rows) == ("minillm int8", pytest.approx(40 / 37.5))
    text = format_peers({"prompts": 2, "new_tokens": n, "rounds": 2, "cpu": "test cpu", "threads": 2,
                         "torch": "x", "bandwidth_gb_s": 20.0, "rows": rows, "best_minillm_vs_ct2_int8":
                         best_minillm_vs(rows)})
    assert "best minillm (minillm int8) / CTranslate2 int8: 1.07x" in text
    assert "llama.cpp" in text and "not installed" in text
    md = peer_rows.format_peers_markdown({"prompts": 2, "new_tokens": n, "rounds": 2, "cpu": "test cpu", "threads": 2,
                                      "torch": "x", "bandwidth_gb_s": 20.0, "rows": rows,
                                      "best_minillm_vs_ct2_int8": best_minillm_vs(rows)})
    assert "| minillm int8 | 100.0 | 40.0 | 200 | 20% | 2.67x | 1/2 |" in md, md
    assert "| llama.cpp |  | not installed |" in md and "CTranslate2 int8: **1.07x**" in md
    int8_line = next(line for line in text.splitlines() if line.startswith("minillm int8"))
    assert "40.0" in int8_line and "20%" in int8_line and "2.67x" in int8_line and "1/2" in int8_line, int8_line


def test_no_ct2_row_means_no_ratio():
    rows = summarize({"minillm fp32": [[fake_runs(0.1, 0.1, 3, [1, 2, 3])]]}, {"minillm fp32": GB}, {}, bandwidth=GB)
    assert best_minillm_vs(rows) is None and rows[0].vs_base == pytest.approx(1.0)


# ------------------------------------------------------------------ the command line
def test_cli_compare_peers_reaches_the_runner(monkeypatch):
    from minillm.cli import main

    seen = {}
    monkeypatch.setattr(peers, "run", lambda *args, **kw: seen.update(args=args, kw=kw))
    assert main(["bench", "--compare-peers", "--gguf", "m.gguf", "--rounds", "2", "--max-tokens", "8",
                 "--compare-prompts", "3", "--json", "out.json", "--set", "kv_cache=true"]) == 0
    assert seen["args"] == (None, 3, 8, 2, "m.gguf", "out.json") and seen["kw"] == {"levers": {"kv_cache": True}}


def test_module_parser_defaults_and_choices():
    args = peers.build_parser().parse_args([])
    assert (args.prompts, args.tokens, args.rounds, args.gguf, args.engines) == (4, 64, 3, None, None)
    args = peers.build_parser().parse_args(["--engines", "minillm", "ctranslate2", "--gguf", "default"])
    assert args.engines == ["minillm", "ctranslate2"] and args.gguf == "default"
    with pytest.raises(SystemExit):
        peers.build_parser().parse_args(["--engines", "vllm"])


@pytest.mark.parametrize("kw, message", [
    (dict(num_prompts=0), r"num_prompts=0: choose 1 to 32"),
    (dict(gguf="/no/such.gguf"), r"--gguf '/no/such.gguf': no such file"),
])
def test_bad_arguments_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        peers.run("random:tiny-llama", **kw)


# ------------------------------------------------------------------ the minillm rows on a tiny random model
@pytest.fixture(scope="module")
def tiny_llm():
    return LLM("random:tiny-llama")


def test_minillm_rows_run_on_a_tiny_random_model(tiny_llm, tmp_path):
    ids = peers.prompt_ids_for(tiny_llm, 2)
    assert len(ids) == 2 and ids[0] != ids[1] and all(3 <= t < 512 for p in ids for t in p)
    result = compare_peers(tiny_llm, ids, new_tokens=4, rounds=2, progress=False)
    rows = {r.engine: r for r in result["rows"]}
    assert list(rows)[:4] == ["minillm fp32", "minillm int8", "minillm int4 g128", "minillm int4 g32"]
    for name in ("minillm fp32", "minillm int8", "minillm int4 g128", "minillm int4 g32"):
        row = rows[name]
        assert row.tok_s > 0 and len(row.tok_s_rounds) == 2 and row.ttft_ms > 0 and row.pct_of_bound > 0, row
    assert rows["minillm fp32"].agree == 2 and rows["minillm fp32"].vs_base == 1.0
    assert rows["minillm int8"].weight_bytes < rows["minillm fp32"].weight_bytes
    # a random model has no directory: transformers and CTranslate2 say why they did not run
    assert "no local model directory" in rows["transformers fp32"].skipped
    assert rows["CTranslate2 int8"].skipped and rows["llama.cpp"].skipped
    path = tmp_path / "peers.json"
    path.write_text(json.dumps(peer_rows.result_json(result)))
    saved = json.loads(path.read_text())
    assert saved["rows"][0]["engine"] == "minillm fp32" and saved["rows"][0]["tok_s"] > 0


@pytest.mark.parametrize("kw, message", [
    (dict(new_tokens=1), r"new_tokens=1: need at least 2"),
    (dict(rounds=0), r"rounds=0: need at least 1"),
    (dict(engines={"minillm", "vllm"}), r"engines \['vllm'\] unknown"),
])
def test_compare_refuses_bad_settings(tiny_llm, kw, message):
    with pytest.raises(ValueError, match=message):
        compare_peers(tiny_llm, [[5, 6, 7]], **{"new_tokens": 4, "progress": False, **kw})


# ------------------------------------------------------------------ every row on a tiny checkpoint (needs ctranslate2)
@pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None,
                    reason="ctranslate2 is not installed (pip install -e '.[peers]')")
def test_all_rows_on_a_tiny_checkpoint(tmp_path, monkeypatch, default_model_dir):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    path = tmp_path / "tiny"
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(path)
    for f in tokenizer_files(default_model_dir):
        shutil.copy(f, path)
    monkeypatch.setenv("MINILLM_CACHE", str(tmp_path / "cache"))
    llm = LLM(str(path))
    result = compare_peers(llm, peers.prompt_ids_for(llm, 2), new_tokens=6, rounds=1,
                           settings={"model dtype": {}, "int8": {"weight_dtype": "int8"}}, progress=False)
    rows = {r.engine: r for r in result["rows"]}
    assert list(rows) == ["minillm fp32", "minillm int8", "transformers fp32", "CTranslate2 float32",
                          "CTranslate2 int8", "llama.cpp"]
    for name in ("transformers fp32", "CTranslate2 float32", "CTranslate2 int8"):
        assert rows[name].tok_s > 0 and rows[name].pct_of_bound > 0, rows[name]
    # fp32 everywhere: the same greedy tokens (CTranslate2's end_token=[] lets EOS through as ignore_eos does)
    assert rows["transformers fp32"].agree == 2 and rows["CTranslate2 float32"].agree == 2
    converted = peer_engines.ct2_model_dir(str(path), "int8")
    assert converted.parent == tmp_path / "cache" / "ctranslate2" and (converted / "model.bin").is_file()
    assert rows["CTranslate2 int8"].weight_bytes == (converted / "model.bin").stat().st_size
    assert rows["CTranslate2 int8"].weight_bytes < rows["CTranslate2 float32"].weight_bytes
    assert result["best_minillm_vs_ct2_int8"][1] > 0
    written = (converted / "model.bin").stat().st_mtime_ns
    assert peer_engines.convert_for_ct2(str(path), "int8") == converted   # cached: not converted again
    assert (converted / "model.bin").stat().st_mtime_ns == written


# ------------------------------------------------------------------ the llama.cpp row's plumbing (a stand-in module)
def test_llama_cpp_row_with_a_stand_in_module(tiny_llm, tmp_path, monkeypatch):
    import importlib.machinery
    import sys
    import types

    made = {}

    class FakeLlama:
        def __init__(self, model_path, n_ctx, n_threads, n_threads_batch, verbose):
            made.update(model_path=model_path, n_ctx=n_ctx, n_threads=n_threads)

        fresh = False

        def reset(self):
            self.fresh = True

        def generate(self, tokens, top_k, temp, **kw):   # endless, like llama-cpp-python's: the caller stops it
            assert top_k == 1 and temp == 0.0
            # llama-cpp-python keeps the prefix a prompt shares with the last call's tokens, even with reset=True:
            # without reset() first a repeated prompt is never prefilled again and its TTFT reads ~0
            assert self.fresh, "reset() before every run"
            self.fresh = False
            t = tokens[-1]
            while True:
                t = (t * 7 + 1) % 500
                time.sleep(0.001)
                yield t

    fake = types.ModuleType("llama_cpp")
    fake.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    fake.Llama = FakeLlama
    monkeypatch.setitem(sys.modules, "llama_cpp", fake)
    ids = [[5, 6, 7], [8, 9]]
    no_gguf = compare_peers(tiny_llm, ids, new_tokens=4, rounds=1, engines={"llama.cpp"}, progress=False)
    assert "no --gguf" in no_gguf["rows"][0].skipped
    gguf = tmp_path / "tiny.Q4_1.gguf"
    gguf.write_bytes(b"\0" * 1234)
    result = compare_peers(tiny_llm, ids, new_tokens=4, rounds=1, engines={"minillm", "llama.cpp"}, gguf=str(gguf),
                           settings={"model dtype": {}}, progress=False)
    row = {r.engine: r for r in result["rows"]}["llama.cpp Q4_1"]
    assert row.weight_bytes == 1234 and row.tok_s > 0 and row.agree is not None
    assert made == {"model_path": str(gguf), "n_ctx": 3 + 4 + 8, "n_threads": torch.get_num_threads()}


def test_llama_cpp_says_in_one_line_how_to_get_it_or_why_it_cannot_build(monkeypatch):
    from minillm.bench import peer_engines

    monkeypatch.setattr("shutil.which", lambda name: "/usr/bin/" + name)
    assert peer_engines.llama_cpp_missing().startswith("not installed (make bench-peers builds it, or "
                                                       "CMAKE_ARGS=-DLLAVA_BUILD=OFF pip install -e '.[llama]'")
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert peer_engines.llama_cpp_missing() == ("not installed, and no C++ compiler here to build llama-cpp-python "
                                                "from source")

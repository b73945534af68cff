"""minillm bench prefill: the lengths it runs, the FLOP arithmetic, and a run on a tiny model (values, not timing)."""

from __future__ import annotations

import pytest

from minillm import LLM
from minillm.bench.prefill import (TimedAttention, attention_flops, compare_prefill, format_prefill, matmul_flops,
                                   prompt_ids, prompt_lengths, summarize, timed)


def test_prompt_lengths_clamp_to_the_context_and_refuse_bad_values():
    assert prompt_lengths([128, 512, 2048, 8192], 8192) == [128, 512, 2048, 8191]
    assert prompt_lengths([8192, 100000, 64], 128) == [64, 127]
    with pytest.raises(ValueError, match=r"--lengths 0: a prompt length is an integer >= 1"):
        prompt_lengths([16, 0], 128)


def test_flop_arithmetic_on_the_default_model_shape(default_llm):
    cfg = default_llm.engine.model_config   # SmolLM2-135M: 30 layers, 9 heads of 64, hidden 576, tied, vocab 49152
    assert (cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.hidden_size) == (30, 9, 64, 576)
    embedding = 49152 * 576
    per_token = cfg.num_params - embedding    # 134,515,008 parameters, 28,311,552 of them the embedding
    assert cfg.num_params == 134515008 and per_token == 106203456
    assert matmul_flops(cfg, 1024) == 2 * per_token * 1024 + 2 * embedding
    # attention: 2 matmuls x 2 FLOPs x 30 layers x 576 (9 x 64) x 1024 * 1025 / 2 pairs
    assert attention_flops(cfg, 1024) == 4 * 30 * 576 * 524800
    share = [attention_flops(cfg, n) / (attention_flops(cfg, n) + matmul_flops(cfg, n)) for n in (128, 8192)]
    assert [round(s, 4) for s in share] == [0.0205, 0.5714]   # grows with the prompt: 2% at 128, 57% at 8192


def test_compare_prefill_runs_every_length_and_says_why_a_peer_is_skipped():
    llm = LLM("random:tiny-llama", max_model_len=128)
    lengths = prompt_lengths([16, 64, 500], llm.engine.max_model_len)
    result = compare_prefill(llm, lengths, {"minillm", "transformers", "llama.cpp"}, rounds=1, gguf=None,
                             progress=False)
    ran = [(r.engine, r.num_tokens) for r in result["rows"] if r.skipped is None]
    assert ran == [(e, n) for n in (16, 64, 127) for e in ("minillm fp32", "minillm int8", "minillm int4 g128")]
    assert all(r.ttft_s > 0 and r.tok_per_s == r.num_tokens / r.ttft_s for r in result["rows"] if r.skipped is None)
    # attention's time is measured around the engine's backend, within the request's time
    assert all(0 < r.attention_s < r.ttft_s for r in result["rows"] if r.skipped is None), result["rows"]
    skipped = {r.engine: r.skipped for r in result["rows"] if r.skipped is not None}
    assert "no local model directory" in skipped["transformers fp32"]
    assert skipped["llama.cpp"].startswith(("not installed", "no --gguf"))
    table = format_prefill(result)
    assert "transformers fp32    skipped: no local model directory" in table
    assert len([line for line in table.splitlines() if line.startswith("minillm")]) == 9
    assert prompt_ids(5, 100) == [16, 78, 43, 8, 70]   # (7919 i + 13) mod 97 + 3: never the special ids 0-2
    assert len(prompt_ids(127, 32000)) == 127 and min(prompt_ids(4000, 32000)) >= 3


class FakeBackend:
    name, layout = "fake", "block_tables"

    def __init__(self):
        self.calls = []

    def store_kv(self, *args):
        self.calls.append(("store_kv", args))

    def extend(self, q, *args, **kwargs):
        self.calls.append(("extend", kwargs))
        return q * 2


def test_timed_attention_passes_every_call_through_and_adds_up_its_time(monkeypatch):
    clock = iter([10.0, 10.5, 20.0, 22.0])
    monkeypatch.setattr("minillm.bench.prefill.time.perf_counter", lambda: next(clock))
    inner = FakeBackend()
    wrapped = TimedAttention(inner)
    assert (wrapped.name, wrapped.layout) == ("fake", "block_tables")
    wrapped.store_kv(1, 2)
    assert wrapped.extend(3, k_scale=None) == 6
    assert inner.calls == [("store_kv", (1, 2)), ("extend", {"k_scale": None})]
    assert wrapped.seconds == 0.5 + 2.0
    assert wrapped.calls is inner.calls     # anything else is the backend's own


def test_timed_wraps_an_engine_once_and_keeps_its_tokens():
    llm = LLM("random:tiny-llama", max_model_len=128)
    ids = prompt_ids(40, 512)
    want = llm.generate([{"prompt_token_ids": ids}])[0].outputs[0].token_ids
    clock = timed(llm)
    assert timed(llm) is clock and llm.engine.runner.backend is clock
    assert llm.generate([{"prompt_token_ids": ids}])[0].outputs[0].token_ids == want
    assert clock.seconds > 0


def test_summarize_reports_the_attention_time_of_the_median_run():
    rows = summarize({("e", 8): [3.0, 1.0, 2.0]}, {}, [8], {("e", 8): [0.3, 0.1, 0.2]})
    assert [(r.ttft_s, r.attention_s) for r in rows] == [(2.0, 0.2)]


def test_settings_pick_minillms_rows_and_refuse_unknown_ones():
    llm = LLM("random:tiny-llama", max_model_len=128)
    result = compare_prefill(llm, [16], {"minillm"}, rounds=1, progress=False, settings=["model dtype"])
    assert [(r.engine, r.num_tokens) for r in result["rows"]] == [("minillm fp32", 16)]
    with pytest.raises(ValueError, match=r"settings \['fp16'\]: minillm's rows are"):
        compare_prefill(llm, [16], {"minillm"}, rounds=1, progress=False, settings=["fp16"])

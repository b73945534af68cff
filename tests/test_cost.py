"""minillm cost: the $/Mtok formula (the course's H100 numbers), the stacked stages on a tiny
random model (order, ratios, prices, greedy agreement, the plot) and the command line."""

from __future__ import annotations

import json
import math

import pytest

from minillm.bench.cost import (CostStage, cost_per_million, cost_stack, cost_workload, default_stages,
                                format_cost_stack, plot_cost_stack, rows_to_json)

TINY = "random:tiny-llama"


def test_cost_per_million_reproduces_the_h100_example():
    # 2.50 $/h; 33.3 tok/s is 30 ms per token (100/3 tok/s), the other throughputs as printed.
    for tok_s, usd in ((100 / 3, 20.83), (466, 1.49), (747, 0.93), (1335, 0.52)):
        assert round(cost_per_million(tok_s, 2.50), 2) == usd
    assert cost_per_million(1e6 / 3600, 1.0) == pytest.approx(1.0)   # 1 $/h at 1 M tokens per hour
    assert cost_per_million(10.0, 0.0) == 0.0


@pytest.mark.parametrize("tok_s", [0, -5.0, float("nan"), float("inf")])
def test_cost_per_million_refuses_impossible_throughput(tok_s):
    with pytest.raises(ValueError, match=f"tokens_per_s={tok_s!r}"):
        cost_per_million(tok_s, 2.5)


def test_cost_per_million_refuses_negative_price():
    with pytest.raises(ValueError, match="hourly_usd=-1"):
        cost_per_million(100.0, -1)


def test_default_stages_stack_their_levers():
    naive, batched, quant, spec = default_stages(batch=8, quant="int4", num_speculative_tokens=3)
    assert naive.sequential and naive.levers["max_num_seqs"] == 1 and not naive.levers["paged"]
    assert batched.levers["batching"] == "continuous" and batched.levers["paged"] and batched.levers["max_num_seqs"] == 8
    assert quant.levers == {**batched.levers, "weight_dtype": "int4"}
    assert spec.levers == {**quant.levers, "speculative": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="quant='int3'"):
        default_stages(quant="int3")
    with pytest.raises(ValueError, match="batch=1"):
        default_stages(batch=1)


@pytest.fixture(scope="module")
def tiny_rows():
    from minillm import LLM

    llm = LLM(TINY, max_model_len=256)
    requests = cost_workload(llm, num_requests=4, max_tokens=8)
    stages = default_stages(batch=4)
    return llm, cost_stack(llm, stages=stages, requests=requests, hourly_usd=2.5, progress=False)


def test_stack_rows_are_consistent(tiny_rows):
    llm, rows = tiny_rows
    assert [r.stage for r in rows] == ["naive", "+ continuous batching + paging", "+ int8 weights",
                                       "+ speculative decoding"]
    for r in rows:
        assert r.output_tokens == 4 * 8 and r.num_requests == 4   # ignore_eos: same work in every stage
        assert r.tokens_per_s == pytest.approx(r.output_tokens / r.wall_s)
        assert r.ratio_vs_naive == pytest.approx(r.tokens_per_s / rows[0].tokens_per_s)
        assert r.usd_per_mtok == pytest.approx(cost_per_million(r.tokens_per_s, 2.5))
        assert r.hourly_usd == 2.5
    assert rows[0].ratio_vs_naive == 1.0 and rows[0].peak_running == 1
    assert rows[1].peak_running == 4   # the batched stage really ran the four together
    # Batching keeps greedy output; int8 (and speculation on int8 weights) is measured, not asserted.
    assert rows[1].same_tokens == 4
    assert rows[3].same_as_previous == sum(a == b for a, b in zip(rows[3].outputs, rows[2].outputs))
    assert rows[2].same_as_previous == rows[2].same_tokens == sum(a == b for a, b in zip(rows[2].outputs, rows[0].outputs))
    assert rows[3].acceptance_rate is not None and 0 <= rows[3].acceptance_rate <= 1
    assert rows[0].acceptance_rate is None
    text = format_cost_stack(rows, llm.device)
    assert llm.device in text and "same tokens" in text and "4/4" in text
    assert "weight_dtype='int8'" in text and "speculative='ngram'" in text
    assert rows_to_json(rows, llm.device)["rows"][2]["levers"]["weight_dtype"] == "int8"


def test_stack_plot_is_written(tiny_rows, tmp_path):
    llm, rows = tiny_rows
    path = plot_cost_stack(rows, llm.device, str(tmp_path / "new_dir" / "cost.png"), log=True)
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_stack_on_given_stages_and_bad_input(tiny_rows):
    llm, _ = tiny_rows
    requests = cost_workload(llm, num_requests=2, max_tokens=4)
    rows = cost_stack(llm, stages=[CostStage("one", {"max_num_seqs": 1}, sequential=True),
                                   ("two", {"max_num_seqs": 2}),
                                   ("spec", {"max_num_seqs": 2, "speculative": "ngram"})],
                      requests=requests, progress=False)
    assert [r.stage for r in rows] == ["one", "two", "spec"] and rows[1].same_tokens == 2
    assert rows[2].same_tokens == rows[2].same_as_previous == 2   # speculation keeps greedy output (model dtype)
    assert rows[2].acceptance_rate is not None and rows[1].acceptance_rate is None
    assert rows[0].hourly_usd == llm.engine.hourly_usd   # the engine's price for its device
    with pytest.raises(ValueError, match="hourly_usd=-2"):
        cost_stack(llm, requests=requests, hourly_usd=-2, progress=False)
    with pytest.raises(ValueError, match="num_requests=0"):
        cost_workload(llm, num_requests=0)


def test_workload_repeats_its_prompt(default_llm):
    """On a chat model, even requests ask for a corpus paragraph back, odd ones ask a question."""
    reqs = cost_workload(default_llm, num_requests=4, max_tokens=16)
    texts = [default_llm.tokenizer.decode(r.prompt["prompt_token_ids"]) for r in reqs]
    assert "paragraph" in texts[0].lower() or "text" in texts[0].lower()
    assert len(reqs[0].prompt["prompt_token_ids"]) > 2 * len(reqs[1].prompt["prompt_token_ids"])
    assert all(r.params.max_tokens == 16 and r.params.ignore_eos and r.params.temperature == 0 for r in reqs)


def test_cli_prints_the_table(tmp_path, capsys):
    from minillm.cli import main

    out = tmp_path / "cost.json"
    plot = tmp_path / "cost.png"
    code = main(["cost", "--model", TINY, "--num-requests", "2", "--max-tokens", "4", "--batch", "2",
                 "--hourly-usd", "3.6", "--no-progress", "--json", str(out), "--plot", str(plot)])
    text = capsys.readouterr().out
    assert code == 0, text
    for needle in ("cost stack on cpu", "3.60 USD/hour", "out tok/s", "vs naive", "$/Mtok", "same tokens",
                   "+ speculative decoding", "one request at a time"):
        assert needle in text, f"{needle!r} missing from:\n{text}"
    saved = json.loads(out.read_text())
    assert [r["stage"] for r in saved["rows"]][0] == "naive" and len(saved["rows"]) == 4
    for r in saved["rows"]:   # printed $/Mtok = 3.6 / 3600 / tok_s * 1e6 = 1000 / tok_s
        assert math.isclose(r["usd_per_mtok"], 1000 / r["tokens_per_s"], rel_tol=1e-9)
    assert plot.is_file()
    assert main(["cost", "--model", TINY, "--hourly-usd", "-1", "--no-progress"]) == 2
    assert "hourly_usd=-1" in capsys.readouterr().err

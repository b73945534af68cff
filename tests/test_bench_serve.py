"""minillm bench serve: the load generator against a fake OpenAI server whose chunks, delays,
failures and usage are known, so TTFT / ITL / TPOT / E2EL, counts, arrivals, the concurrency
cap and goodput are checked with values. One test drives the real `minillm serve` when it exists."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import statistics
import time

import pytest

from app_thread import AppInThread
from minillm.bench import serve as bs
from minillm.bench import serve_dataset as sd

FIRST_DELAY_S = 0.08   # server: request -> first text chunk
GAP_S = 0.03           # server: between text chunks


class FakeServer(AppInThread):
    """Streams `max_tokens` text chunks (default 4): the first after first_delay_s (or slow_delay_s
    for odd-numbered requests when set), the rest gap_s apart; usage counts tokens_per_chunk per
    chunk. Returns HTTP 500 for every fail_every-th request. Records payloads and peak concurrency."""

    def __init__(self, first_delay_s=FIRST_DELAY_S, gap_s=GAP_S, fail_every=0, tokens_per_chunk=1,
                 send_usage=True, slow_delay_s=None, malformed=False):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        self.first_delay_s, self.gap_s, self.fail_every = first_delay_s, gap_s, fail_every
        self.tokens_per_chunk, self.send_usage, self.slow_delay_s = tokens_per_chunk, send_usage, slow_delay_s
        self.malformed = malformed
        self.payloads: list[dict] = []
        self.in_flight = self.peak = 0
        self.arrivals: list[float] = []

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

        async def complete(request):
            body = await request.json()
            n = len(self.payloads)
            self.payloads.append(body)
            self.arrivals.append(time.perf_counter())
            if self.fail_every and n % self.fail_every == 0:
                return JSONResponse({"error": {"message": f"request {n} refused on purpose"}}, status_code=500)
            chat = request.url.path.endswith("/chat/completions")
            num_chunks = body.get("max_tokens") or 4
            first = self.slow_delay_s if (self.slow_delay_s is not None and n % 2 == 1) else self.first_delay_s

            def chunk(text):
                if chat:
                    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
                return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}

            async def stream():
                self.in_flight += 1
                self.peak = max(self.peak, self.in_flight)
                try:
                    if chat:   # a role-only first chunk carries no text: it must not count as the first token
                        yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + "\n\n"
                    await asyncio.sleep(first)
                    if self.malformed and n % 2 == 1:
                        yield "data: {not json\n\n"
                        return
                    for i in range(num_chunks):
                        if i:
                            await asyncio.sleep(self.gap_s)
                        yield "data: " + json.dumps(chunk(f" w{i}")) + "\n\n"
                    if self.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                        usage = {"prompt_tokens": len(body.get("prompt", "x").split()),
                                 "completion_tokens": num_chunks * self.tokens_per_chunk}
                        yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self.in_flight -= 1

            return StreamingResponse(stream(), media_type="text/event-stream")

        app = Starlette(routes=[Route("/v1/models", models), Route("/v1/completions", complete, methods=["POST"]),
                                Route("/v1/chat/completions", complete, methods=["POST"])])
        self._app = app

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}/v1"


DATASET = [{"prompt": f"question number {i} with some words", "output_tokens": 3 + i % 4} for i in range(12)]


def test_metrics_match_the_servers_delays_and_chunks():
    with FakeServer() as fake:
        r = bs.run_benchmark(fake.base_url, num_prompts=8, dataset=DATASET, progress=False, max_concurrency=2)
    assert (r.completed, r.failed, r.model) == (8, 0, "fake-model")
    recs = r.records
    for rec, body in zip(sorted(recs, key=lambda x: x.start_s), fake.payloads):
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["model"] == "fake-model"
    for rec in recs:
        assert rec.success and rec.usage_reported
        assert rec.output_tokens == rec.num_chunks == rec.max_tokens   # one chunk per token here
        assert rec.ttft_s >= FIRST_DELAY_S
        assert len(rec.itl_s) == rec.output_tokens - 1
        assert all(g >= 0 for g in rec.itl_s)
        assert statistics.fmean(rec.itl_s) == pytest.approx(GAP_S, abs=0.02)
        assert rec.e2el_s >= rec.ttft_s + sum(rec.itl_s) - 1e-9
        assert rec.tpot_s == pytest.approx((rec.e2el_s - rec.ttft_s) / (rec.output_tokens - 1), rel=1e-12)
        assert rec.prompt_tokens == 6   # the fake counts words
    # The summaries are over the records, in ms.
    assert r.metrics["ttft"]["mean_ms"] == pytest.approx(1e3 * statistics.fmean(x.ttft_s for x in recs))
    assert r.metrics["itl"]["mean_ms"] == pytest.approx(GAP_S * 1e3, abs=20)
    assert r.metrics["e2el"]["p99_ms"] >= r.metrics["e2el"]["median_ms"] >= FIRST_DELAY_S * 1e3
    assert r.total_output_tokens == sum(x.max_tokens for x in recs)
    assert r.total_input_tokens == 6 * 8
    assert r.output_throughput == pytest.approx(r.total_output_tokens / r.duration_s)
    assert r.request_throughput == pytest.approx(8 / r.duration_s)
    assert r.total_token_throughput == pytest.approx((r.total_output_tokens + 48) / r.duration_s)
    json.dumps(r.to_dict())   # serializable


def test_usage_counts_tokens_and_chunks_are_the_fallback():
    with FakeServer(tokens_per_chunk=2, gap_s=0.01) as fake:
        r = bs.run_benchmark(fake.base_url + "/", "m", num_prompts=4, max_tokens=5, dataset=DATASET, progress=False)
    assert all(x.output_tokens == 10 and x.num_chunks == 5 for x in r.records)   # usage wins over chunk count
    assert all(x.tpot_s == pytest.approx((x.e2el_s - x.ttft_s) / 9) for x in r.records)
    with FakeServer(send_usage=False, gap_s=0.01) as fake:
        r = bs.run_benchmark(fake.base_url[:-3], "m", num_prompts=4, max_tokens=5, dataset=DATASET, progress=False)
    assert all(x.output_tokens == 5 and not x.usage_reported and x.prompt_tokens is None for x in r.records)
    assert r.total_output_tokens == 20 and not r.input_tokens_known
    assert "*" in r.table()


def test_chat_endpoint_skips_the_role_chunk():
    with FakeServer(gap_s=0.01) as fake:
        r = bs.run_benchmark(fake.base_url, endpoint="/v1/chat/completions", num_prompts=3, max_tokens=4,
                             dataset=DATASET, progress=False)
    assert r.completed == 3
    assert fake.payloads[0]["messages"][0]["role"] == "user"
    assert all(x.text == " w0 w1 w2 w3" and x.ttft_s >= FIRST_DELAY_S for x in r.records)


def test_failed_requests_are_counted_with_their_error():
    with FakeServer(fail_every=3, gap_s=0.01) as fake:
        r = bs.run_benchmark(fake.base_url, "m", num_prompts=9, max_tokens=3, dataset=DATASET, progress=False,
                             max_concurrency=1)
    assert (r.completed, r.failed) == (6, 3)   # requests 0, 3, 6 in arrival order
    assert sum(r.errors.values()) == 3
    assert all(e.startswith("HTTP 500") and "refused on purpose" in e for e in r.errors)
    assert r.total_output_tokens == 6 * 3
    assert "Failed requests:" in r.table() and "HTTP 500" in r.table()


def test_malformed_stream_fails_only_that_request():
    with FakeServer(malformed=True, gap_s=0.01) as fake:
        r = bs.run_benchmark(fake.base_url, "m", num_prompts=4, max_tokens=2, dataset=DATASET, progress=False,
                             max_concurrency=1)
    assert (r.completed, r.failed) == (2, 2)
    assert list(r.errors) == [next(iter(r.errors))] and next(iter(r.errors)).startswith("malformed stream")


def test_connection_refused_does_not_crash():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()   # nothing listens there now
    r = bs.run_benchmark(f"http://127.0.0.1:{port}", "m", num_prompts=3, max_tokens=2, dataset=DATASET, progress=False)
    assert (r.completed, r.failed) == (0, 3)
    assert all("Connect" in e for e in r.errors)
    assert math.isnan(r.metrics["ttft"]["mean_ms"]) and r.total_output_tokens == 0


def test_poisson_gaps_have_the_rate_as_mean():
    gaps = sd.arrival_gaps(4001, request_rate=10.0, seed=3)
    assert gaps[0] == 0.0 and all(g > 0 for g in gaps[1:])
    mean = statistics.fmean(gaps[1:])
    assert mean == pytest.approx(0.1, rel=0.05)
    assert statistics.pstdev(gaps[1:]) / mean == pytest.approx(1.0, rel=0.07)   # exponential: std == mean
    assert gaps == sd.arrival_gaps(4001, 10.0, seed=3) and gaps != sd.arrival_gaps(4001, 10.0, seed=4)
    assert sd.arrival_gaps(5, float("inf")) == [0.0] * 5
    with pytest.raises(ValueError, match="request_rate=0"):
        sd.arrival_gaps(5, 0)


def test_requests_are_sent_at_their_arrival_times():
    with FakeServer(first_delay_s=0.01, gap_s=0.005) as fake:
        r = bs.run_benchmark(fake.base_url, "m", num_prompts=6, request_rate=20.0, seed=1, max_tokens=2,
                             dataset=DATASET, progress=False)
    gaps = sd.arrival_gaps(6, 20.0, seed=1)
    starts = [x.start_s for x in r.records]
    expected = [sum(gaps[:i + 1]) for i in range(6)]
    for got, want in zip(starts, expected):
        assert want <= got <= want + 0.05
    assert r.duration_s >= sum(gaps)


def test_max_concurrency_is_the_servers_peak():
    with FakeServer(gap_s=0.01) as fake:
        r = bs.run_benchmark(fake.base_url, "m", num_prompts=10, max_concurrency=3, max_tokens=4, dataset=DATASET,
                             progress=False)
    assert r.completed == 10 and fake.peak == 3 and r.peak_in_flight == 3
    with FakeServer(gap_s=0.01) as fake:
        r = bs.run_benchmark(fake.base_url, "m", num_prompts=10, max_tokens=4, dataset=DATASET, progress=False)
    assert fake.peak > 3 and r.peak_in_flight == 10   # rate inf without a cap: all at once


def test_goodput_counts_requests_meeting_every_slo():
    # Even-numbered requests answer after 20 ms, odd ones after 300 ms; one at a time, so the
    # server's numbering is the send order.
    with FakeServer(first_delay_s=0.02, slow_delay_s=0.3, gap_s=0.01) as fake:
        r = bs.run_benchmark(fake.base_url, "m", num_prompts=6, max_concurrency=1, max_tokens=3, dataset=DATASET,
                             progress=False, goodput={"ttft": 150, "tpot": 1000})
    assert r.num_good == 3
    assert r.goodput == pytest.approx(3 / r.duration_s)
    assert all(rec.meets({"ttft": 150}) == (rec.ttft_s * 1e3 <= 150) for rec in r.records)
    assert not any(rec.meets({"e2el": 1}) for rec in r.records)
    assert "Request goodput (req/s):" in r.table()


def test_goodput_and_percentile_parsing():
    assert sd.parse_goodput(["ttft:200", "e2el:5000"]) == {"ttft": 200.0, "e2el": 5000.0}
    assert sd.parse_goodput("tpot:50") == {"tpot": 50.0}
    with pytest.raises(ValueError, match="'itl' is not one of"):
        sd.parse_goodput(["itl:5"])
    with pytest.raises(ValueError, match="ttft:-1"):
        sd.parse_goodput({"ttft": -1})
    with pytest.raises(ValueError, match="NAME:MILLISECONDS"):
        sd.parse_goodput(["ttft"])
    assert sd.parse_percentiles("50,90,99.9") == (50.0, 90.0, 99.9)
    with pytest.raises(ValueError, match="101"):
        sd.parse_percentiles("50,101")


def test_shipped_dataset_is_the_generators_output():
    from importlib import resources

    text = resources.files("minillm").joinpath(sd.DATASET_FILE).read_text()
    records = [json.loads(line) for line in text.splitlines()]
    assert records == sd.build_serve_dataset()
    assert len(records) >= 200
    assert all(1 <= r["output_tokens"] <= 160 and r["prompt"] for r in records)
    assert sd.load_dataset() == records
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        sd.load_dataset("nope.jsonl")


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="endpoint='/v1/embeddings'"):
        bs.run_benchmark("http://127.0.0.1:1", "m", endpoint="/v1/embeddings")
    with pytest.raises(ValueError, match="num_prompts=0"):
        bs.run_benchmark("http://127.0.0.1:1", "m", num_prompts=0)
    with pytest.raises(ValueError, match="base_url='localhost:8000'"):
        bs.run_benchmark("localhost:8000", "m")


def test_cli_prints_the_report(tmp_path, capsys):
    from minillm.cli import main

    out = tmp_path / "serve.json"
    with FakeServer(gap_s=0.01) as fake:
        code = main(["bench", "serve", "--base-url", fake.base_url, "--num-prompts", "4", "--max-tokens", "3",
                     "--request-rate", "50", "--max-concurrency", "2", "--goodput", "ttft:10000", "--percentiles",
                     "50,95", "--no-progress", "--json", str(out)])
    text = capsys.readouterr().out
    assert code == 0, text
    for needle in ("Serving Benchmark Result", "Successful requests:", "Benchmark duration (s):",
                   "Output token throughput (tok/s):", "Request goodput (req/s):", "P95 TTFT (ms):",
                   "Mean ITL (ms):", "Median E2EL (ms):", "Mean TPOT (ms):", "fake-model"):
        assert needle in text, f"{needle!r} missing from:\n{text}"
    line = next(x for x in text.splitlines() if x.startswith("Successful requests:"))
    assert line.split()[-1] == "4"
    saved = json.loads(out.read_text())
    assert saved["completed"] == 4 and saved["num_good"] == 4 and len(saved["records"]) == 4
    assert saved["total_output_tokens"] == 12
    with pytest.raises(SystemExit):
        main(["bench", "serve", "--request-rate", "0"])
    assert "request rate 0 must be > 0" in capsys.readouterr().err
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:1", "--model", "m", "--goodput", "itl:3"]) == 2
    assert "'itl' is not one of" in capsys.readouterr().err


def test_works_inside_a_running_event_loop():
    """A Jupyter cell runs inside an asyncio loop: run_benchmark must not call asyncio.run there."""
    with FakeServer(gap_s=0.01) as fake:
        async def cell():
            return bs.run_benchmark(fake.base_url, "m", num_prompts=2, max_tokens=2, dataset=DATASET, progress=False)

        r = asyncio.run(cell())
    assert r.completed == 2


def test_real_minillm_server(default_model_dir, tmp_path):
    """The load generator against `minillm serve` on a tiny random model with the default tokenizer."""
    serve = pytest.importorskip("minillm.serve", reason="minillm.serve (the OpenAI-compatible server) is not built yet")
    if not hasattr(serve, "serve_in_thread"):
        pytest.skip("minillm.serve has no serve_in_thread(llm, host, port) yet")
    import shutil

    import torch
    import transformers

    from conftest import tokenizer_files
    from minillm import LLM

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path = tmp_path / "tiny"
    model.save_pretrained(path)
    for f in tokenizer_files(default_model_dir):
        shutil.copy(f, path)
    llm = LLM(str(path), max_num_seqs=4)
    handle = serve.serve_in_thread(llm, "127.0.0.1", port=0)
    try:
        r = bs.run_benchmark(handle.base_url, num_prompts=6, max_tokens=8, max_concurrency=4, progress=False)
        chat = bs.run_benchmark(handle.base_url, endpoint="/v1/chat/completions", num_prompts=2, max_tokens=5,
                                progress=False)
    finally:
        handle.close()
    assert (r.completed, r.failed) == (6, 0), r.errors
    assert all(x.usage_reported and x.output_tokens == 8 for x in r.records)   # ignore_eos: every token made
    assert r.total_output_tokens == 48 and r.total_input_tokens > 6
    assert all(x.ttft_s > 0 and x.tpot_s > 0 for x in r.records)
    assert chat.completed == 2 and all(x.output_tokens == 5 for x in chat.records), chat.errors

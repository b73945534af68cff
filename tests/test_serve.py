"""minillm.serve: the OpenAI-compatible server (AsyncEngine + FastAPI app + serve_in_thread + CLI).

The default model is served once for the module (it loads once per session, conftest's
default_llm); the offline answers it is compared with are computed before the server takes
the engine. Engine-thread failure modes run on a tiny random model.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
import torch

from conftest import assert_engine_idle
from minillm import LLM, EngineConfig, SamplingParams
from minillm.serve import AsyncEngine, build_app, serve_in_thread
from minillm.serve.cli import build_parser, config_from_argv
from minillm.serve.flags import engine_fields, engine_kwargs, flag_name

NUM_CLIENTS = 64
MAX_TOKENS = 8
ANIMALS = ["cat", "fox", "whale", "robot", "owl", "horse", "bee", "dragon"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def build_prompts(llm) -> list[str]:
    """Half chat-templated questions (the instruct model answers them), half text to continue."""
    prompts = []
    for i in range(NUM_CLIENTS):
        if i % 2 == 0:
            question = f"In one short sentence, what is {i} plus {i % 7 + 1}?"
            prompts.append(llm.apply_chat_template([{"role": "user", "content": question}]))
        else:
            prompts.append(f"Once upon a time, a {ANIMALS[i % 8]} named {['Luna', 'Max', 'Kiki', 'Bo'][i % 4]} "
                           f"found {i} shiny stones and")
    return prompts


SAMPLE_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? '
                         r'(-?[0-9.eE+-]+|[+-]Inf|NaN)$')


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value}; asserts every line is HELP, TYPE or a sample."""
    samples = {}
    for line in text.strip().splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = SAMPLE_LINE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    hits = [v for k, v in samples.items() if k.split("{")[0] == name and all(f'{a}="{b}"' in k for a, b in labels.items())]
    assert len(hits) == 1, f"{name} {labels}: {len(hits)} samples in {sorted(samples)[:5]}..."
    return hits[0]


def get_metrics(server) -> dict[str, float]:
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200
    return parse_metrics(r.text)


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def offline(default_llm):
    """What the offline engine answers (computed before the server owns the engine)."""
    assert_engine_idle(default_llm)
    prompts = build_prompts(default_llm)
    t0 = time.perf_counter()
    outs = default_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS))
    offline_s = time.perf_counter() - t0
    chat = default_llm.chat(CHAT, SamplingParams(max_tokens=12))[0]
    completions = [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]
    # The comparison means something only if the answers are real text, and differ.
    assert sum(len(ids) == MAX_TOKENS for _, ids in completions) >= NUM_CLIENTS // 2
    assert len({text for text, _ in completions}) >= NUM_CLIENTS // 4
    return {"prompts": prompts, "completions": completions, "finish": [o.outputs[0].finish_reason for o in outs],
            "wall_s": offline_s,
            "chat": (chat.outputs[0].text, len(chat.prompt_token_ids))}


@pytest.fixture(scope="module")
def server(default_llm, offline):
    with serve_in_thread(default_llm, model_name="smollm2") as handle:
        yield handle
    assert_engine_idle(default_llm)   # close() hands the engine back with every block free


@pytest.fixture(scope="module")
def tiny():
    return LLM("random:tiny-llama", max_model_len=128, max_num_seqs=8)


# ------------------------------------------------------------------------------------------ default model
def test_concurrent_streaming_clients_match_offline(server, offline):
    """64 streaming clients at once all finish, and each greedy answer equals llm.generate's."""
    async def one(client, i):
        body = {"model": "smollm2", "prompt": offline["prompts"][i], "max_tokens": MAX_TOKENS, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        text, ids, finish, usage, done = [], [], None, None, False
        async with client.stream("POST", "/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if not line:
                    continue
                assert line.startswith("data: "), line
                if line == "data: [DONE]":
                    done = True
                    continue
                chunk = json.loads(line[len("data: "):])
                assert chunk["object"] == "text_completion" and chunk["model"] == "smollm2"
                if chunk["usage"] is not None:
                    usage = chunk["usage"]
                    assert chunk["choices"] == []
                    continue
                choice, = chunk["choices"]
                text.append(choice["text"])
                ids.extend(choice["token_ids"])
                finish = choice["finish_reason"] or finish
        return "".join(text), ids, finish, usage, done

    async def run_all():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS)))

    before = get_metrics(server)
    t0 = time.perf_counter()
    results = asyncio.run(run_all())
    wall_s = time.perf_counter() - t0
    mismatched = [i for i, (res, ref) in enumerate(zip(results, offline["completions"]))
                  if (res[0], res[1]) != (ref[0], ref[1])]
    assert not mismatched, (f"{len(mismatched)} of {NUM_CLIENTS} streamed answers differ from llm.generate, e.g. "
                            f"#{mismatched[0]}: {results[mismatched[0]][:2]} vs {offline['completions'][mismatched[0]]}")
    for (text, ids, finish, usage, done), ref_finish in zip(results, offline["finish"]):
        assert done and finish == ref_finish
        assert usage["completion_tokens"] == len(ids) and usage["total_tokens"] == usage["prompt_tokens"] + len(ids)
    after = get_metrics(server)
    generated = sum(len(r[1]) for r in results)
    assert metric(after, "minillm_generation_tokens_total") - metric(before, "minillm_generation_tokens_total") == generated
    finished = sum(metric(after, "minillm_request_success_total", finished_reason=r)
                   - metric(before, "minillm_request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert finished == NUM_CLIENTS
    ttft_count = metric(after, "minillm_time_to_first_token_seconds_count")
    assert ttft_count - metric(before, "minillm_time_to_first_token_seconds_count") == NUM_CLIENTS
    assert metric(after, "minillm_kv_blocks_used") == 0 and metric(after, "minillm_num_requests_running") == 0
    print(f"\n{NUM_CLIENTS} streaming clients: {generated} tokens in {wall_s:.1f} s over HTTP vs "
          f"{offline['wall_s']:.1f} s in llm.generate (HTTP / offline wall time: {wall_s / offline['wall_s']:.2f}x)")


def wait_for_one_abort(server, since: dict[str, float], timeout_s: float = 20.0) -> tuple[dict[str, float], float]:
    """Poll /metrics until one more request finished with reason "abort" than in `since` and no KV
    block is in use (or the timeout passes); returns (the last metrics, aborts since)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = get_metrics(server)
        aborted = (metric(now, "minillm_request_success_total", finished_reason="abort")
                   - metric(since, "minillm_request_success_total", finished_reason="abort"))
        if aborted == 1 and metric(now, "minillm_kv_blocks_used") == 0 or time.monotonic() > deadline:
            return now, aborted
        time.sleep(0.1)


def test_disconnect_mid_stream_frees_kv_blocks(server):
    before = get_metrics(server)
    body = {"model": "smollm2", "prompt": "Count slowly from one to one thousand:", "max_tokens": 400,
            "ignore_eos": True, "stream": True}
    chunks = 0
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        with client.stream("POST", "/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks += 1
                if chunks == 3:
                    during = get_metrics(server)
                    break  # leaving the block closes the connection mid-stream
    assert metric(during, "minillm_kv_blocks_used") > 0 and metric(during, "minillm_num_requests_running") == 1
    now, aborted = wait_for_one_abort(server, before)
    assert aborted == 1, "the disconnected request was not aborted"
    assert metric(now, "minillm_kv_blocks_used") == 0, "the disconnected request's KV blocks were not freed"
    assert metric(now, "minillm_num_requests_running") == 0
    generated = metric(now, "minillm_generation_tokens_total") - metric(before, "minillm_generation_tokens_total")
    assert 3 <= generated < 400, f"{generated} tokens: the request should have stopped soon after the client left"
    assert metric(now, "minillm_request_success_total", finished_reason="length") == \
        metric(before, "minillm_request_success_total", finished_reason="length")

    # A non-streaming client that gives up is noticed too (the handler polls for the disconnect).
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json={**body, "stream": False}, timeout=1.5)
    later, aborted = wait_for_one_abort(server, now)
    assert aborted == 1 and metric(later, "minillm_kv_blocks_used") == 0


def test_stream_holds_back_text_that_may_become_a_stop_string(server, offline):
    """Streamed pieces never show a stop string, even one split across tokens; the text ends before it."""
    ref_text, _ = offline["completions"][5]
    words = ref_text.split()
    assert len(words) >= 3, ref_text
    stop = " " + words[2]  # the third word, with its space: usually split across two or more tokens
    expected = ref_text[:ref_text.find(stop)]
    shown, finish = "", None
    with httpx.stream("POST", server.base_url + "/completions", timeout=60,
                      json={"prompt": offline["prompts"][5], "max_tokens": MAX_TOKENS, "stop": [stop, "@@@@"], "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                shown += choice["text"]
                finish = choice["finish_reason"] or finish
                assert stop not in shown, f"the stream showed the stop string {stop!r}: {shown!r}"
    assert shown == expected and finish == "stop"


BAD_REQUESTS = [
    # (endpoint, body, param, words the message must contain)
    ("completions", b"{not json", None, ["not valid JSON"]),
    ("completions", b"[1, 2]", None, ["JSON object"]),
    ("completions", {"model": "gpt-4", "prompt": "Hi"}, "model", ['"gpt-4"', "smollm2"]),
    ("completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens", ["max_tokens=0", ">= 1"]),
    ("completions", {"prompt": "Hi", "max_tokens": -5}, "max_tokens", ["max_tokens=-5", ">= 1"]),
    ("completions", {"prompt": "Hi", "max_tokens": 10**9}, "max_tokens", ["max_tokens=1000000000", "at most 8191"]),
    ("completions", {"prompt": "Hi", "max_tokens": "8"}, "max_tokens", ['max_tokens="8"', "integer"]),
    ("completions", {"prompt": [7] * 9000}, "prompt", ["9000 tokens", "8192", "at most 8191"]),
    ("completions", {"prompt": 5}, "prompt", ["prompt=5", "a string, a list of token ids, a list of strings"]),
    ("completions", {"prompt": "Hi", "temperature": "hot"}, "temperature", ['temperature="hot"', "number"]),
    ("completions", {"prompt": "Hi", "temperature": -1}, "temperature", ["temperature=-1", ">= 0"]),
    ("completions", {"prompt": "Hi", "top_p": 1.5}, "top_p", ["top_p=1.5", "(0, 1]"]),
    ("completions", {"prompt": "Hi", "stop": 5}, "stop", ["stop=5", "string"]),
    ("completions", {"prompt": "Hi", "n": 0}, "n", ["n=0", "[1, 128]"]),
    ("completions", {"prompt": "Hi", "n": 3, "best_of": 2}, "best_of", ["best_of=2", "[n=3, 128]"]),
    ("completions", {"prompt": "Hi", "n": 1, "best_of": 3, "stream": True}, "best_of", ["best_of=3", "stream"]),
    ("chat/completions", {"messages": CHAT, "best_of": 2}, "best_of", ["chat API has n only"]),
    ("completions", {"prompt": "Hi", "n": 100}, "n", ["n=100", "max_num_seqs=16"]),
    ("completions", {"prompt": ["a", 5]}, "prompt", ["prompt[1] of 2 is 5", "a string or a list of integer token ids"]),
    ("completions", {"prompt": [1, 99999999]}, "prompt", ["99999999", "[0, 49151]"]),
    ("completions", {"max_tokens": 4}, "prompt", ["prompt is missing"]),
    ("chat/completions", {"messages": "hi"}, "messages", ['messages="hi"', "list"]),
    ("chat/completions", {"messages": []}, "messages", ["empty"]),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content", ["content=3"]),
    ("chat/completions", {"prompt": "Hi"}, "messages", ["messages is missing"]),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens",
     ["max_completion_tokens=0", ">= 1"]),
    ("chat/completions", {"messages": CHAT, "stream": "yes"}, "stream", ['stream="yes"', "true or false"]),
    ("completions", {"prompt": "Hi", "logprobs": 21}, "logprobs", ["logprobs=21", "[0, 20]"]),
    ("completions", {"prompt": "Hi", "logprobs": True}, "logprobs", ["logprobs=N"]),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs",
     ["top_logprobs=-1", "[0, 20]"]),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", ["needs logprobs=true"]),
    ("completions", {"prompt": "Hi", "min_p": 1.5}, "min_p", ["min_p=1.5", "[0, 1]"]),
    ("completions", {"prompt": "Hi", "presence_penalty": 3}, "presence_penalty", ["presence_penalty=3", "[-2, 2]"]),
    ("completions", {"prompt": "Hi", "logit_bias": {"12": 500}}, "logit_bias", ["logit_bias[12]=500", "[-100, 100]"]),
    ("completions", {"prompt": "Hi", "logit_bias": {"x": 1}}, "logit_bias", ["token ids"]),
    ("completions", {"prompt": "Hi", "temprature": 0.5}, "temprature", ["temprature", "not a field"]),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format",
     ['"xml"', "json_schema"]),
    ("completions", {"prompt": "Hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     ["exactly one of"]),
    ("completions", {"prompt": "Hi", "echo": "yes"}, "echo", ['echo="yes"', "true or false"]),
]


def test_malformed_requests_get_openai_style_400(server, offline):
    rejected_before = metric(get_metrics(server), "minillm_requests_rejected_total")
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        for endpoint, body, param, words in BAD_REQUESTS:
            kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body}
            r = client.post("/" + endpoint, **kwargs)
            assert r.status_code == 400, (endpoint, body, r.status_code, r.text)
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, error
            assert error["type"] == "invalid_request_error"
            assert error["param"] == param, (body, error)
            missing = [w for w in words if w not in error["message"]]
            assert not missing, f"{body!r}: the message {error['message']!r} lacks {missing}"
        # The server still serves, and nothing leaked.
        r = client.post("/completions", json={"model": "smollm2", "prompt": offline["prompts"][0],
                                              "max_tokens": MAX_TOKENS})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == offline["completions"][0][0]
    m = get_metrics(server)
    assert metric(m, "minillm_kv_blocks_used") == 0 and metric(m, "minillm_num_requests_waiting") == 0
    # Only the engine thread can judge four of them: max_tokens vs context, prompt length, ids (it tokenizes),
    # n vs max_num_seqs.
    assert metric(m, "minillm_requests_rejected_total") - rejected_before == 4


def test_openai_client_completions_chat_and_streaming(server, offline):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2"]

    completion = client.completions.create(model="smollm2", prompt=offline["prompts"][3], max_tokens=MAX_TOKENS, temperature=0)
    ref_text, ref_ids = offline["completions"][3]
    assert completion.choices[0].text == ref_text
    assert completion.usage.completion_tokens == len(ref_ids)
    assert completion.id.startswith("cmpl-") and completion.model == "smollm2" and completion.created > 0

    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=12, temperature=0)
    ref_chat, ref_prompt_tokens = offline["chat"]
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == ref_chat and ref_chat
    assert chat.usage.prompt_tokens == ref_prompt_tokens
    assert chat.choices[0].finish_reason in ("stop", "length")

    pieces, finishes, usage, roles = [], [], None, []
    stream = client.chat.completions.create(model="smollm2", messages=CHAT, max_completion_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            roles.append(choice.delta.role)
            finishes.append(choice.finish_reason)
    assert "".join(pieces) == ref_chat
    assert roles[0] == "assistant" and finishes[-1] == chat.choices[0].finish_reason and not any(finishes[:-1])
    assert usage.completion_tokens == chat.usage.completion_tokens and usage.prompt_tokens == ref_prompt_tokens

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="smollm2", prompt="Hi", max_tokens=0)
    assert "max_tokens=0" in str(info.value)


def test_models_health_and_metrics_format(server):
    r = httpx.get(server.base_url + "/models")
    assert r.status_code == 200
    model, = r.json()["data"]
    assert model["id"] == "smollm2" and model["object"] == "model" and model["max_model_len"] == 8192
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = httpx.get(server.url + "/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    samples = parse_metrics(text)
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    helps = set(re.findall(r"^# HELP (\S+) ", text, re.M))
    assert set(types) == helps
    for name, kind in [("minillm_num_requests_running", "gauge"), ("minillm_num_requests_waiting", "gauge"),
                       ("minillm_kv_blocks_used", "gauge"), ("minillm_kv_blocks_total", "gauge"),
                       ("minillm_prefix_cache_hit_rate", "gauge"), ("minillm_prompt_tokens_total", "counter"),
                       ("minillm_generation_tokens_total", "counter"), ("minillm_request_success_total", "counter"),
                       ("minillm_time_to_first_token_seconds", "histogram")]:
        assert types.get(name) == kind, (name, types.get(name))
    bm = server.llm.engine.block_manager
    assert metric(samples, "minillm_kv_blocks_total") == bm.num_blocks
    # Histogram buckets are cumulative and end at +Inf == _count.
    buckets = [(k, v) for k, v in samples.items() if k.startswith("minillm_time_to_first_token_seconds_bucket")]
    values = [v for _, v in buckets]
    assert len(buckets) > 5 and values == sorted(values) and 'le="+Inf"' in buckets[-1][0]
    assert values[-1] == metric(samples, "minillm_time_to_first_token_seconds_count")
    r = httpx.get(server.url + "/nowhere")
    assert r.status_code == 404 and "error" in r.json()


def test_fastapi_validation_errors_become_openai_400(server):
    from fastapi.testclient import TestClient

    app = build_app(server.async_engine, "smollm2")

    @app.get("/typed")
    def typed(count: int):  # FastAPI validates this itself (a 422 by default)
        return {"count": count}

    r = TestClient(app).get("/typed", params={"count": "many"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "count" and '"many"' in error["message"]


# ------------------------------------------------------------------------------------------ tiny model: the engine thread
def test_async_engine_bad_request_step_failure_abort_and_shutdown(tiny, monkeypatch):
    """A bad request fails alone; a failing step fails its batch only; abort and shutdown free every block."""
    engine = AsyncEngine(tiny)

    async def scenario():
        long = SamplingParams(max_tokens=60, ignore_eos=True)
        good = await engine.add_request(long, prompt_token_ids=[5, 6, 7])
        with pytest.raises(ValueError, match=r"max_tokens=0 must be an integer >= 1"):
            await engine.add_request(_bad_params(), prompt_token_ids=[1, 2])
        with pytest.raises(ValueError, match=r"outside the vocabulary range \[0, 511\]"):
            await engine.add_request(long, prompt_token_ids=[1, 600])
        first = await good.get(timeout=30)
        assert first.token_ids and not first.finished  # the good request is unaffected

        # One step raises: the requests in that batch finish with "error", the loop keeps serving.
        runner = tiny.engine.runner
        real_run, calls = runner.run, []

        def flaky(seqs):
            calls.append(len(seqs))
            if len(calls) == 1:
                raise RuntimeError("injected kernel failure")
            return real_run(seqs)

        monkeypatch.setattr(runner, "run", flaky)
        last = None
        async for event in good:
            last = event
        assert last.finish_reason == "error" and "injected kernel failure" in last.error
        text, ids, end = await engine.generate(SamplingParams(max_tokens=5, ignore_eos=True), prompt_token_ids=[9, 8])
        assert end.finish_reason == "length" and len(ids) == 5 and end.num_output_tokens == 5

        # abort(request_id) finishes with "abort" and frees the blocks.
        victim = await engine.add_request(long, prompt_token_ids=list(range(3, 40)))
        await victim.get(timeout=30)
        engine.abort(victim.request_id)
        events = [e async for e in victim]
        assert events[-1].finish_reason == "abort"

        # shutdown() ends a stream still in flight with "abort".
        pending = await engine.add_request(long, prompt_token_ids=[4, 4, 4])
        await pending.get(timeout=30)
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        tail = [e async for e in pending]
        assert tail[-1].finish_reason == "abort"
        return calls

    calls = asyncio.run(scenario())
    assert len(calls) >= 2
    assert engine.metrics.step_errors == 1 and engine.metrics.rejected == 2
    assert engine.metrics.finished["error"] == 1 and engine.metrics.finished["abort"] == 2
    assert engine.metrics.finished["length"] == 1
    assert not engine.is_running
    assert_engine_idle(tiny)


def _bad_params():
    params = SamplingParams(max_tokens=1)
    params.max_tokens = 0  # slips past construction; the engine's validation refuses it
    return params


def test_serve_in_thread_closes_and_reopens(tiny):
    """port 0 picks a free port; close() frees it; the LLM serves again afterwards, offline and online."""
    with serve_in_thread(tiny) as handle:
        assert handle.base_url == f"http://127.0.0.1:{handle.port}/v1" and handle.url + "/v1" == handle.base_url
        assert handle.model_name == "random:tiny-llama"
        r = httpx.post(handle.base_url + "/completions",
                       json={"prompt": [3, 4, 5], "max_tokens": 6, "ignore_eos": True, "return_token_ids": True})
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]["token_ids"]
    assert not handle.running
    with pytest.raises(httpx.ConnectError):
        httpx.get(handle.url + "/health", timeout=2)
    offline = tiny.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=6, ignore_eos=True))
    assert offline[0].outputs[0].token_ids == served
    with serve_in_thread(tiny, model_name="again") as handle:
        assert httpx.get(handle.base_url + "/models").json()["data"][0]["id"] == "again"
        with pytest.raises(RuntimeError, match="already served"):  # one engine thread per engine
            serve_in_thread(tiny)
        # the notebook's own thread may not step the served engine: a clear refusal, and the server goes on
        with pytest.raises(RuntimeError, match=r"generate\(\)|add_request\(\).*being served by thread 'minillm-engine'"):
            tiny.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=2))
        with pytest.raises(RuntimeError, match=r"step\(\) from thread .*being served"):
            tiny.engine.step()
        r = httpx.post(handle.base_url + "/completions",
                       json={"prompt": [3, 4, 5], "max_tokens": 6, "ignore_eos": True, "return_token_ids": True})
        assert r.json()["choices"][0]["token_ids"] == served
    assert tiny.engine.owner_thread is None


def test_openai_client_logprobs_and_penalties(server):
    """The official client: chat logprobs (top_logprobs), completion logprobs, penalties and logit_bias accepted,
    and the logprobs of a stream arrive chunk by chunk with the tokens they describe."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    chat = client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6, logprobs=True, top_logprobs=3,
                                          presence_penalty=0.5, frequency_penalty=0.3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6 or chat.choices[0].finish_reason == "stop"
    assert "".join(item.token for item in content).startswith(chat.choices[0].message.content[:5])
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert item.logprob == max(t.logprob for t in item.top_logprobs), "greedy takes the most likely token"
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
    completion = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=4,
                                           logprobs=2, logit_bias={"0": -100})
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == completion.choices[0].text and lp.text_offset[0] == 0
    assert all(len(top) >= 2 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))
    pieces, streamed = [], []
    for chunk in client.chat.completions.create(model="smollm2", messages=CHAT, max_tokens=6, logprobs=True,
                                                 stream=True):
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            streamed += [item.logprob for item in (choice.logprobs.content if choice.logprobs else [])]
    assert streamed == [item.logprob for item in content] or chat.choices[0].finish_reason == "stop"


def test_openai_client_n_choices_streaming_and_best_of(server):
    """n=3 through the official client: three choices indexed 0..2 that equal three seeded n=1 requests (choice i
    draws with seed + i), usage over every choice; streamed, each choice's chunks carry its index and rebuild the
    same texts; best_of=3, n=2 returns the two best by mean logprob."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    args = dict(model="smollm2", prompt="Three facts about the sea:", max_tokens=8, temperature=1.0, seed=40)
    many = client.completions.create(n=3, **args)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [client.completions.create(**{**args, "seed": 40 + i}).choices[0] for i in range(3)]
    assert [c.text for c in many.choices] == [c.text for c in singles]
    assert len({c.text for c in many.choices}) > 1
    single_usages = [client.completions.create(**{**args, "seed": 40 + i}).usage for i in range(3)]
    singles_usage = sum(u.completion_tokens for u in single_usages)
    assert many.usage.completion_tokens == singles_usage, "usage counts every choice's tokens"
    assert many.usage.prompt_tokens == single_usages[0].prompt_tokens, "the prompt is counted once"
    texts, finished = ["", "", ""], set()
    for chunk in client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **args):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finished.add(choice.index)
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == singles_usage
    assert texts == [c.text for c in many.choices] and finished == {0, 1, 2}
    chat_args = dict(model="smollm2", messages=CHAT, max_tokens=6, temperature=1.0, seed=9)
    chat = client.chat.completions.create(n=2, **chat_args)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[1].message.content == client.chat.completions.create(
        **{**chat_args, "seed": 10}).choices[0].message.content
    streamed = ["", ""]
    for chunk in client.chat.completions.create(n=2, stream=True, **chat_args):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [c.message.content for c in chat.choices]
    best = client.completions.create(n=2, best_of=3, logprobs=0, **args)
    three = [client.completions.create(**{**args, "seed": 40 + i, "logprobs": 0}).choices[0] for i in range(3)]
    ranked = sorted(three, key=lambda c: -sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs))
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]] and [c.index for c in best.choices] == [0, 1]


def test_echo_with_logprobs_scores_the_prompt_as_evaluation_harnesses_do(server, hf_default):
    """echo=true, logprobs=1, max_tokens=0: the prompt's text and the model's log-probability of each of its tokens
    (the first has none), nothing generated; equal to transformers' log-softmax."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url, api_key="none")
    prompt = "The quick brown fox jumps over the lazy dog"
    scored = client.completions.create(model="smollm2", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == prompt and lp.text_offset[0] == 0
    from transformers import AutoTokenizer  # the same tokenizer files the server loaded
    prompt_ids = AutoTokenizer.from_pretrained(hf_default.name_or_path).encode(prompt)
    with torch.inference_mode():
        ref = hf_default(torch.tensor([prompt_ids])).logits[0].float().log_softmax(-1)
    assert len(lp.token_logprobs) == len(prompt_ids)
    for position in range(1, len(prompt_ids)):
        assert abs(lp.token_logprobs[position] - float(ref[position - 1, prompt_ids[position]])) < 1e-4
    more = client.completions.create(model="smollm2", prompt=prompt, max_tokens=3, echo=True, temperature=0)
    assert more.choices[0].text.startswith(prompt) and len(more.choices[0].text) > len(prompt)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="smollm2", prompt=prompt, max_tokens=3, echo=True, stream=True) if c.choices)
    assert streamed == more.choices[0].text


def test_sampling_fields_reach_the_engine(tiny):
    """temperature, top_p, top_k, seed, stop_token_ids, ignore_eos, max_tokens: the server's answer is the
    offline engine's answer with the same SamplingParams (a seeded sample is reproducible)."""
    prompt = [5, 17, 3, 99]
    greedy = tiny.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=10, ignore_eos=True))
    stop_id = greedy[0].outputs[0].token_ids[3]  # the 4th greedy token (or an earlier copy of it) ends the answer
    cases = [dict(temperature=0.9, top_p=0.8, top_k=40, seed=3, max_tokens=9, ignore_eos=True),
             dict(temperature=1.3, seed=11, max_tokens=12),
             dict(temperature=0.8, min_p=0.1, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.2,
                  seed=5, max_tokens=8, ignore_eos=True, logit_bias={7: 3.0}, min_tokens=4),
             dict(temperature=0, max_tokens=10, stop_token_ids=[stop_id], ignore_eos=True)]
    with serve_in_thread(tiny) as handle:
        served = [httpx.post(handle.base_url + "/completions", timeout=60,
                             json={"prompt": prompt, "return_token_ids": True, **case}).json()["choices"][0]
                  for case in cases]
    for case, choice in zip(cases, served):
        ref = tiny.generate([{"prompt_token_ids": prompt}], SamplingParams(**case))[0].outputs[0]
        assert (choice["token_ids"], choice["finish_reason"]) == (ref.token_ids, ref.finish_reason), case
    assert served[0]["token_ids"] != served[1]["token_ids"]
    assert served[3]["finish_reason"] == "stop" and served[3]["token_ids"][-1] == stop_id
    assert len(served[3]["token_ids"]) <= 4


def test_serve_in_thread_inside_a_running_event_loop(tiny):
    """As in a Jupyter kernel: the caller's thread already runs an asyncio loop; uvicorn runs its own."""
    async def notebook_cell():
        with serve_in_thread(tiny) as handle:
            async with httpx.AsyncClient(base_url=handle.base_url) as client:
                r = await client.post("/completions", json={"prompt": [7, 8], "max_tokens": 4, "ignore_eos": True})
            return r.status_code, r.json()["usage"]

    status, usage = asyncio.run(notebook_cell())
    assert status == 200 and usage == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert_engine_idle(tiny)


def test_prefix_cache_hits_show_in_metrics():
    llm = LLM("random:tiny-llama", max_model_len=128, prefix_caching=True, block_size=16)
    prompt = list(range(10, 50))  # 40 tokens: two full blocks to share
    with serve_in_thread(llm) as handle:
        outs = [httpx.post(handle.base_url + "/completions", json={"prompt": prompt, "max_tokens": 2, "ignore_eos": True,
                                                                    "return_token_ids": True}).json()
                for _ in range(2)]
        samples = get_metrics(handle)
    assert outs[0]["choices"][0]["token_ids"] == outs[1]["choices"][0]["token_ids"]
    hits, queries = metric(samples, "minillm_prefix_cache_hits_total"), metric(samples, "minillm_prefix_cache_queries_total")
    sched = llm.engine.scheduler
    assert (hits, queries) == (sched.prefix_hits, sched.prefix_queries) and hits >= 32
    assert metric(samples, "minillm_prefix_cache_hit_rate") == pytest.approx(hits / queries)
    assert metric(samples, "minillm_prompt_tokens_total") == 80


# ------------------------------------------------------------------------------------------ CLI
def test_cli_help_lists_every_engine_field(capsys):
    from minillm.cli import main  # `minillm serve ...` delegates to minillm.serve.cli.main

    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    missing = [f.name for f in engine_fields() if flag_name(f.name) not in text]
    assert not missing, f"minillm serve --help lacks {missing}"
    for flag in ("--host", "--port", "--served-model-name", "--no-prefix-caching", "--no-kv-cache"):
        assert flag in text


def test_cli_every_engine_field_is_reachable():
    parser = build_parser()
    for f in dataclasses_fields():
        kind = str(f.type)
        if kind in ("bool", "bool | None"):   # an on/off flag (None: the engine's default, when neither is given)
            for argv, value in (([flag_name(f.name)], True), (["--no-" + f.name.replace("_", "-")], False)):
                assert engine_kwargs(parser.parse_args(argv)) == {f.name: value}, (f.name, argv)
            continue
        text, value = ("7", 7) if kind.startswith("int") else ("0.25", 0.25) if kind.startswith("float") else \
            ("abc", "abc")
        assert engine_kwargs(parser.parse_args([flag_name(f.name), text])) == {f.name: value}, f.name
        if "None" in kind:
            assert engine_kwargs(parser.parse_args([flag_name(f.name), "none"])) == {f.name: None}, f.name
    assert engine_kwargs(parser.parse_args([])) == {}


def dataclasses_fields():
    import dataclasses

    return dataclasses.fields(EngineConfig)


def test_cli_maps_flags_to_engine_config():
    config = config_from_argv(["--model", "random:tiny-llama", "--max-num-seqs", "4", "--no-kv-cache",
                               "--max-model-len", "256", "--block-size", "32", "--batching", "static",
                               "--kv-cache-memory-fraction", "0.5", "--gpu-hourly-usd", "1.25", "--seed", "3",
                               "--port", "9000", "--served-model-name", "x"])
    expected = EngineConfig(model="random:tiny-llama", max_num_seqs=4, kv_cache=False, max_model_len=256,
                            block_size=32, batching="static", kv_cache_memory_fraction=0.5, gpu_hourly_usd=1.25, seed=3)
    assert config == expected
    assert config_from_argv([]) == EngineConfig()
    config = config_from_argv(["--prefix-caching", "--kv-dtype", "int8", "--weight-dtype", "int8",
                               "--speculative", "ngram", "--num-speculative-tokens", "3", "--max-model-len", "none"])
    assert (config.prefix_caching, config.kv_dtype, config.weight_dtype, config.speculative,
            config.num_speculative_tokens, config.max_model_len) == (True, "int8", "int8", "ngram", 3, None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-num-seqs", "many"])
    with pytest.raises(ValueError, match=r"max_num_seqs=0 must be an integer in \[1, 4096\]"):
        config_from_argv(["--max-num-seqs", "0"])


def test_cli_subprocess_serves_and_terminates(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "minillm.cli", "serve", "--model", "random:tiny-llama",
                             "--port", str(port), "--max-model-len", "64", "--max-num-seqs", "2",
                             "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                            text=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, f"minillm serve exited early: {proc.stdout.read()}"
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "minillm serve did not answer /health within 90 s"
                time.sleep(0.3)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                       json={"model": "random:tiny-llama", "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={"prompt": [1] * 64})
        assert r.status_code == 400 and "max_model_len) is 64" in r.json()["error"]["message"]
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    # uvicorn shuts down gracefully on SIGTERM, then re-raises the signal (the shell's usual exit status).
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert f"http://127.0.0.1:{port}/v1" in out

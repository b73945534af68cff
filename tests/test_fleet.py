"""minillm.fleet.ray_fleet: replicas behind Ray Serve (a local Ray cluster on loopback).

One fleet of 2 default-model replicas is shared by the fast tests (starting Ray and loading two replicas costs
~30-45 s on 2 cores); its greedy answers are compared with one in-process engine's. The replica-kill and autoscale
tests start their own fleets after it (FleetPool keeps one alive at a time) and are marked slow.
"""

from __future__ import annotations

import asyncio
import io
import json
import time

import httpx
import pytest

from minillm import SamplingParams
from minillm.fleet.autoscale_demo import autoscale_demo, replica_count_path
from minillm.fleet.autoscaling import AutoscalingConfig
from minillm.fleet.ray_fleet import build_parser, fleet_kwargs, main, start_fleet
from minillm.fleet.replicas import REPLICA_HEADER

NUM_CLIENTS = 64
MAX_TOKENS = 8
SUBJECTS = ["a lighthouse", "the moon", "a small robot", "bread", "the river", "an old map", "winter", "a violin"]
CHAT = [{"role": "user", "content": "Name one planet of the solar system."}]


def fleet_prompts(count: int) -> list[str]:
    return [f"Write one sentence about {SUBJECTS[i % len(SUBJECTS)]} and the number {i}:" for i in range(count)]


class FleetPool:
    """One fleet at a time (Serve is one per Ray cluster): asking for another configuration stops the current."""

    def __init__(self):
        self.key, self.fleet = None, None

    def get(self, key: str, **kwargs):
        if self.key != key:
            self.close()
            self.fleet, self.key = start_fleet(**kwargs), key
        return self.fleet

    def close(self):
        if self.fleet is not None:
            self.fleet.shutdown()
        self.key, self.fleet = None, None


@pytest.fixture(scope="module")
def pool():
    fleets = FleetPool()
    yield fleets
    fleets.close()


@pytest.fixture(scope="module")
def offline(default_llm):
    """What one in-process engine answers, greedy: the fleet must answer the same, token for token."""
    prompts = fleet_prompts(NUM_CLIENTS)
    outs = default_llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    chat = default_llm.chat(CHAT, SamplingParams(max_tokens=12))[0].outputs[0]
    long_params = SamplingParams(max_tokens=24, ignore_eos=True)
    long = default_llm.generate(prompts[:16], long_params)
    completions = [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]
    assert len({text for text, _ in completions}) >= NUM_CLIENTS // 4   # the comparison means something
    return {"prompts": prompts, "completions": completions, "chat": chat.text,
            "long": [list(o.outputs[0].token_ids) for o in long]}


@pytest.fixture(scope="module")
def fleet(pool, offline):
    return pool.get("two", num_replicas=2, max_ongoing_requests=16)


async def stream_completion(client: httpx.AsyncClient, url: str, body: dict, on_first=None) -> dict:
    """One streaming completion: its token ids, whether [DONE] came, any error event, the answering replica."""
    out = {"ids": [], "text": "", "done": False, "error": None, "replica": None, "finish": None, "status": None}
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True,
                                                                     "return_token_ids": True}) as r:
        out["status"], out["replica"] = r.status_code, r.headers.get(REPLICA_HEADER)
        async for line in r.aiter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            if on_first is not None:
                on_first(out)
                on_first = None
            if line == "data: [DONE]":
                out["done"] = True
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                out["error"] = chunk["error"]
                continue
            choice, = chunk["choices"]
            out["ids"].extend(choice["token_ids"])
            out["text"] += choice["text"]
            out["finish"] = choice["finish_reason"] or out["finish"]
    return out


# ------------------------------------------------------------------------------------------ no Ray needed
@pytest.mark.parametrize("fields, bad, allowed", [
    (dict(min_replicas=0), "min_replicas=0", "integer >= 1"),
    (dict(min_replicas=3, max_replicas=2), "max_replicas=2", "integer >= min_replicas (3)"),
    (dict(target_ongoing_requests=0), "target_ongoing_requests=0", "a number > 0"),
    (dict(target_ongoing_requests=float("nan")), "target_ongoing_requests=nan", "a number > 0"),
    (dict(upscale_delay_s=-1.0), "upscale_delay_s=-1.0", "seconds >= 0"),
    (dict(downscale_delay_s="soon"), "downscale_delay_s='soon'", "seconds >= 0"),
    (dict(min_replicas=1, max_replicas=4, initial_replicas=5), "initial_replicas=5", "[1, 4]"),
    (dict(metrics_interval_s=0), "metrics_interval_s=0", "seconds > 0"),
    (dict(min_replicas=True), "min_replicas=True", "integer >= 1"),
])
def test_autoscaling_config_refuses_bad_values(fields, bad, allowed):
    with pytest.raises(ValueError) as info:
        AutoscalingConfig(**fields)
    assert bad in str(info.value) and allowed in str(info.value), str(info.value)


def test_autoscaling_config_is_rays():
    """The dict is what Ray Serve's own AutoscalingConfig accepts, field for field."""
    from ray.serve.config import AutoscalingConfig as RayAutoscalingConfig

    ours = AutoscalingConfig(min_replicas=2, max_replicas=5, target_ongoing_requests=3, upscale_delay_s=0.5,
                             downscale_delay_s=7, initial_replicas=3)
    theirs = RayAutoscalingConfig(**ours.to_ray())
    assert (theirs.min_replicas, theirs.max_replicas, theirs.initial_replicas) == (2, 5, 3)
    assert (theirs.target_ongoing_requests, theirs.upscale_delay_s, theirs.downscale_delay_s) == (3, 0.5, 7)
    assert "initial_replicas" not in AutoscalingConfig().to_ray()   # None: Ray's own default (min_replicas)


def test_start_fleet_refuses_bad_arguments():
    with pytest.raises(ValueError, match=r"num_replicas=0 must be an integer >= 1"):
        start_fleet(num_replicas=0)
    with pytest.raises(ValueError, match=r"port=70000 must be an integer in \[0, 65535\]"):
        start_fleet(port=70000)
    with pytest.raises(ValueError, match=r"threads_per_replica=0"):
        start_fleet(threads_per_replica=0)
    with pytest.raises(ValueError, match=r"give num_replicas .* or autoscaling"):
        start_fleet(num_replicas=None)
    with pytest.raises(ValueError, match=r"max_num_seqs=0 must be an integer in \[1, 4096\]"):
        start_fleet({"max_num_seqs": 0}, num_replicas=1)   # refused here, before Ray starts 1 replica that fails


def test_cli_flags():
    parse = build_parser().parse_args
    fixed = fleet_kwargs(parse(["--num-replicas", "3", "--set", "max_num_seqs=8", "--port", "0"]))
    assert fixed["num_replicas"] == 3 and "autoscaling" not in fixed and fixed["levers"] == {"max_num_seqs": 8}
    auto = fleet_kwargs(parse(["--min-replicas", "1", "--max-replicas", "3", "--target-ongoing-requests", "5",
                               "--upscale-delay-s", "2", "--downscale-delay-s", "9", "--model", "random:tiny-llama"]))
    assert auto["num_replicas"] is None and auto["levers"] == {"model": "random:tiny-llama"}
    assert auto["autoscaling"] == AutoscalingConfig(min_replicas=1, max_replicas=3, target_ongoing_requests=5.0,
                                                    upscale_delay_s=2.0, downscale_delay_s=9.0)
    demo = fleet_kwargs(parse(["--demo-autoscale"]))["autoscaling"]
    assert (demo.min_replicas, demo.max_replicas, demo.target_ongoing_requests) == (1, 2, 2.0)
    with pytest.raises(ValueError, match="--num-replicas=2 is a fixed fleet; --max-replicas"):
        fleet_kwargs(parse(["--num-replicas", "2", "--max-replicas", "3"]))


def test_cli_refuses_bad_values_before_starting_ray(capsys):
    assert main(["--min-replicas", "2", "--max-replicas", "1"]) == 2
    assert "max_replicas=1 is out of range: an integer >= min_replicas (2)" in capsys.readouterr().err
    assert main(["--port", "-5"]) == 2
    assert "port=-5 must be an integer in [0, 65535]" in capsys.readouterr().err
    assert main(["--set", "max_num_seqs=0", "--port", "0"]) == 2
    assert "minillm fleet: max_num_seqs=0 must be an integer in [1, 4096]" in capsys.readouterr().err


def test_replica_count_path():
    timeline = [(0.5, 1, "replicas: 1 running (Serve: HEALTHY)"), (2.0, 1, "replica a ready: ..."),
                (3.0, 1, "autoscaler decided: upscaling -> replicas: 1 running, 1 starting (Serve: UPSCALING)"),
                (9.0, 2, "replicas: 2 running (Serve: HEALTHY)"), (9.5, 2, "replica b ready: ..."),
                (20.0, 1, "autoscaler decided: downscaling -> replicas: 1 running, 1 stopping (Serve: DOWNSCALING)"),
                (21.0, 1, "replicas: 1 running (Serve: HEALTHY)")]
    assert replica_count_path(timeline) == [1, 2, 1]


# ------------------------------------------------------------------------------------------ a fleet of 2
def test_64_streaming_clients_match_one_engine(fleet, offline):
    """64 streaming clients through Ray Serve, 2 replicas: all finish, both replicas answer, greedy tokens equal
    one in-process engine's, prompt for prompt."""
    async def run_all():
        async with httpx.AsyncClient(timeout=300.0) as client:
            return await asyncio.gather(*(
                stream_completion(client, fleet.base_url, {"prompt": prompt, "max_tokens": MAX_TOKENS,
                                                           "ignore_eos": True})
                for prompt in offline["prompts"]))

    results = asyncio.run(run_all())
    for i, (got, (text, ids)) in enumerate(zip(results, offline["completions"])):
        assert got["status"] == 200 and got["done"] and got["error"] is None, (i, got)
        assert got["ids"] == ids, f"prompt {i}: the fleet answered {got['ids']}, one engine {ids}"
        assert got["text"] == text and got["finish"] == "length"
    replicas = {got["replica"] for got in results}
    assert len(replicas) == 2 and None not in replicas, f"answered by {replicas}: Ray's router used one replica"


def test_chat_models_health_metrics_and_errors(fleet, offline):
    """The other routes come through unchanged: chat (whole and streamed), /v1/models, /health, /metrics, and a 400
    naming the bad value."""
    with httpx.Client(base_url=fleet.base_url, timeout=120.0) as client:
        r = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 12})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == offline["chat"]
        assert r.headers[REPLICA_HEADER]
        pieces, roles = [], []
        with client.stream("POST", "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 12,
                                                                 "stream": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in r.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            delta = json.loads(line[len("data: "):])["choices"][0]["delta"]
            roles.append(delta.get("role"))
            pieces.append(delta.get("content") or "")
        assert roles[0] == "assistant" and "".join(pieces) == offline["chat"]
        models = client.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "SmolLM2-135M-Instruct"
        assert client.get("/health").json() == {"status": "ok"}
        metrics = client.get("/metrics")
        assert metrics.status_code == 200 and "minillm_" in metrics.text
        bad = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
        assert bad.status_code == 400
        error = bad.json()["error"]
        assert error["param"] == "max_tokens" and "max_tokens=0" in error["message"] and ">= 1" in error["message"]
        missing = client.get("/v1/nothing-here")
        assert missing.status_code == 404 and "/v1/nothing-here" in missing.json()["error"]["message"]


def replica_metrics(client: httpx.Client, replica: str, timeout_s: float = 30.0) -> dict[str, float]:
    """/metrics of one replica (Ray's router picks who answers: ask until that one does)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = client.get("/metrics")
        if r.headers[REPLICA_HEADER] == replica:
            samples = {}
            for line in r.text.splitlines():
                if line and not line.startswith("#"):
                    name, value = line.rsplit(" ", 1)
                    samples[name] = float(value)
            return samples
    raise AssertionError(f"replica {replica} never answered /metrics in {timeout_s} s")


def test_client_leaving_mid_stream_aborts_its_request_in_the_replica(fleet):
    """Closing a stream through the fleet cancels the relay, the replica's generator, and the engine's request."""
    with httpx.Client(base_url=fleet.base_url, timeout=120.0) as client:
        with client.stream("POST", "/v1/completions", json={"prompt": "Count to a thousand:", "max_tokens": 4000,
                                                            "ignore_eos": True, "stream": True}) as r:
            replica = r.headers[REPLICA_HEADER]
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
        deadline = time.monotonic() + 30
        while True:
            samples = replica_metrics(client, replica)
            running = next(v for k, v in samples.items() if k.startswith("minillm_num_requests_running"))
            aborted = sum(v for k, v in samples.items()
                          if k.startswith("minillm_request_success_total") and 'finished_reason="abort"' in k)
            if running == 0 and aborted >= 1:
                break
            assert time.monotonic() < deadline, f"replica {replica} still runs {running} requests, {aborted} aborted"
            time.sleep(0.2)
        generated = next(v for k, v in samples.items() if k.startswith("minillm_generation_tokens_total"))
        assert generated < NUM_CLIENTS * MAX_TOKENS + 1000   # it stopped long before its 4000 tokens


def test_startup_times_and_timeline(fleet):
    times = fleet.startup_times()
    assert len(times) == 2 and len({t["replica"] for t in times}) == 2
    for t in times:
        assert t["process_start_s"] > 0 and t["weight_load_s"] > 0
        assert t["total_s"] == pytest.approx(t["process_start_s"] + t["weight_load_s"])
    assert fleet.num_replicas() == 2
    timeline = fleet.timeline()
    assert [t for t, _, _ in timeline] == sorted(t for t, _, _ in timeline)
    ready = [text for _, _, text in timeline if " ready: process start " in text]
    assert len(ready) == 2
    assert replica_count_path(timeline)[-1] == 2


# ------------------------------------------------------------------------------------------ slow: own fleets
@pytest.mark.slow
def test_killed_replica_loses_no_unstarted_request(pool, offline):
    """ray.kill one replica while it streams 2 requests and holds 4 more not yet started (max_num_seqs=2): the
    2 streaming ones end with an error event naming the dead replica (no hang), every other request is retried
    on the other replica and gets the full greedy answer."""
    fleet = pool.get("kill", levers={"max_num_seqs": 2}, num_replicas=2, max_ongoing_requests=6)
    victim = fleet.replica_actor_names()[0].rsplit("#", 1)[-1]
    started_on_victim = []

    def first_byte(out):
        if out["replica"] == victim:
            started_on_victim.append(out)

    async def run_all():
        async with httpx.AsyncClient(timeout=300.0) as client:
            tasks = [asyncio.ensure_future(stream_completion(
                client, fleet.base_url, {"prompt": prompt, "max_tokens": 24, "ignore_eos": True}, first_byte))
                for prompt in offline["prompts"][:16]]
            deadline = time.monotonic() + 120
            while len(started_on_victim) < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.3)    # the engine's next steps: its running requests have sent tokens
            await asyncio.to_thread(fleet.kill_replica, 0)
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=240)

    results = asyncio.run(run_all())
    lost = [r for r in results if r["error"] is not None]
    assert 1 <= len(lost) <= 2, [(r["replica"], len(r["ids"]), r["error"]) for r in results]
    for r in lost:
        assert r["replica"] == victim and r["done"] and r["status"] == 200
        assert r["error"]["code"] == "replica_died"
        assert f"replica {victim}, which served this stream, died mid-stream" in r["error"]["message"]
        assert len(r["ids"]) < 24
    for i, r in enumerate(results):
        if r["error"] is None:
            assert r["done"] and r["ids"] == offline["long"][i], (i, r)
    served_after = [r for r in results if r["error"] is None and r["replica"] != victim]
    timeline = fleet.timeline()
    retried = [text for _, _, text in timeline if "retried on another replica" in text]
    assert retried, "no request was queued on the killed replica: the test did not test retries"
    assert len(served_after) >= len(retried)
    assert any("killed (ray.kill)" in text for _, _, text in timeline)


@pytest.mark.slow
def test_autoscaler_scales_1_2_1_under_a_load_ramp(pool):
    config = AutoscalingConfig(min_replicas=1, max_replicas=2, target_ongoing_requests=2, upscale_delay_s=1,
                               downscale_delay_s=3, metrics_interval_s=0.5, look_back_period_s=2)
    fleet = pool.get("autoscale", autoscaling=config, max_ongoing_requests=8)
    assert fleet.num_replicas() == 1
    printed = io.StringIO()
    path = autoscale_demo(fleet, high_clients=8, max_tokens=24, low_s=2, hold_s=3, out=printed)
    assert path == [1, 2, 1], printed.getvalue()
    text = printed.getvalue()
    assert "replica count: 1 -> 2 -> 1" in text and "t=" in text
    times = fleet.startup_times()
    assert len(times) == 2 and all(t["weight_load_s"] > 0 for t in times)   # the added replica measured its own
    assert ", 0 failed)" in text

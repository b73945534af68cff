"""Measured replica profiles for the simulator: decode step time vs batch size, prefill time vs prompt tokens, start-up.

    from minillm.fleet.profile import measure_profile, calibrate_on_server
    profile = measure_profile({"max_num_seqs": 16}, batch_sizes=(1, 2, 4, 8, 16), threads=1)   # in-process
    profile.save("artifacts/fleet_profile.json")
    profile = calibrate_on_server(fleet.base_url, num_replicas=2, startup_s=...)   # a running fleet, over HTTP

Two ways to measure, for two questions:

* `measure_profile` runs the real engine (minillm.LLM) in this process with `threads` torch threads and
  reads its own step timings (llm.stats.steps): the median decode step at each batch size (B requests
  decoding together), and the prefill step of one prompt of each length. Start-up is timed as a fresh
  Python process that imports minillm and builds the same LLM (`startup=True`), which is what a new
  replica pays before Ray's own actor start. This is the profile of one replica alone on the machine:
  what the simulated day uses (a learner's own hardware, or a GPU's numbers).
* `calibrate_on_server` measures a running fleet through its HTTP API, under the conditions the
  validation runs in: decode at batch B from num_replicas x B concurrent streams (Ray's router spreads
  them, so every replica decodes about B at once: the replicas share the cores, memory bandwidth, and
  the proxy / ingress processes that relay every chunk), as the median gap between streamed tokens;
  prefill from one request of each prompt length at a time (one replica prefilling, the others idle),
  as the median TTFT; and the busy slowdown (ReplicaProfile.busy_slowdown_points): the decode step with
  k = 1 .. num_replicas replicas each decoding one request of n = B sequences at once, over k = 1. On a
  2-core CPU with two 1-thread replicas the shared machine makes a replica's decode step much slower
  than alone, and a profile measured alone predicts a fleet's TTFT far too low, which is why the
  validation calibrates on the fleet itself (and simulates with replicas_share_cores=True). The TTFT it
  measures holds the HTTP / proxy latency as well as the prefill step, so its prefill curve includes that
  latency (request_overhead_s stays 0); a prefill step holding several prompts counts it once, which
  under-counts by a few tens of ms per extra prompt.
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

from ..serve.client import run_in_thread
from .replica_profile import ReplicaProfile
from .replicas import REPLICA_HEADER

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16)
DEFAULT_PROMPT_TOKENS = (16, 64, 256)


def _check_sizes(name: str, values, lo: int = 1) -> tuple[int, ...]:
    values = tuple(values)
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= lo for v in values) \
            or len(set(values)) != len(values):
        raise ValueError(f"{name}={values!r} must be distinct integers >= {lo}")
    return tuple(sorted(values))


def prompt_ids(num_tokens: int, seed: int = 0, vocab_size: int = 49152) -> list[int]:
    """A prompt of exactly num_tokens random token ids, from the middle of the vocabulary (ordinary words of
    SmolLM2's 49152, its default; past the special tokens at the start of any vocabulary)."""
    rng = random.Random(seed * 100003 + num_tokens)
    lo, hi = min(1000, vocab_size // 4), min(20000, vocab_size)
    return [rng.randrange(lo, hi) for _ in range(num_tokens)]


def time_startup(levers: dict | None = None, threads: int = 1, timeout_s: float = 600.0) -> float:
    """Seconds for a fresh Python process to import minillm and build LLM(**levers) with `threads` torch threads."""
    code = ("import sys, json, torch; torch.set_num_threads(int(sys.argv[1])); "
            "from minillm import LLM; LLM(**json.loads(sys.argv[2]))")
    import json
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, str(threads), json.dumps(levers or {})],
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"building LLM(**{levers!r}) in a fresh process failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - t0


def measure_profile(levers: dict | None = None, *, batch_sizes=DEFAULT_BATCH_SIZES,
                    prompt_tokens=DEFAULT_PROMPT_TOKENS, threads: int = 1, decode_steps: int = 12,
                    decode_prompt_tokens: int = 96,
                    repeats: int = 3, startup: bool = True, llm=None, progress: bool = True) -> ReplicaProfile:
    """One replica's profile, measured in this process on the real engine (see the module docstring).

    levers: LLM(**levers) (max_num_seqs is raised to the largest batch size). llm: an LLM already built
    (its levers are used as they are; levers must then be None). decode_steps: decode steps timed per
    batch size, after prompts of decode_prompt_tokens (the workload's typical prompt: attention reads it every
    step); repeats: prefill runs per prompt length (the median is kept)."""
    import torch
    from tqdm.auto import tqdm

    from ..sampling import SamplingParams

    batch_sizes = _check_sizes("batch_sizes", batch_sizes)
    prompt_tokens = _check_sizes("prompt_tokens", prompt_tokens)
    if not (isinstance(threads, int) and threads >= 1):
        raise ValueError(f"threads={threads!r} must be an integer >= 1 (torch threads of one replica)")
    if not (isinstance(decode_steps, int) and decode_steps >= 2):
        raise ValueError(f"decode_steps={decode_steps!r} must be an integer >= 2")
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1")
    if llm is not None and levers is not None:
        raise ValueError("give levers or llm, not both")
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        if llm is None:
            from ..llm import LLM
            levers = {**(levers or {})}
            levers["max_num_seqs"] = max(levers.get("max_num_seqs", 1), batch_sizes[-1])
            llm = LLM(**levers)
        elif llm.config.max_num_seqs < batch_sizes[-1]:
            llm = llm.with_levers(max_num_seqs=batch_sizes[-1])
        bar = tqdm(total=len(batch_sizes) + len(prompt_tokens) * repeats + 1, desc="replica profile",
                   disable=not progress)
        vocab = llm.engine.model_config.vocab_size
        llm.generate([{"prompt_token_ids": prompt_ids(16, vocab_size=vocab)}],
                     SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        bar.update(1)
        decode = []
        for b in batch_sizes:
            prompts = [{"prompt_token_ids": prompt_ids(decode_prompt_tokens, seed=i, vocab_size=vocab)} for i in range(b)]
            llm.generate(prompts, SamplingParams(max_tokens=decode_steps + 1, ignore_eos=True))
            steps = [s.duration_s for s in llm.stats.steps if s.kind == "decode" and s.num_seqs == b]
            decode.append((b, statistics.median(steps)))
            bar.update(1)
        prefill = []
        for n in prompt_tokens:
            times = []
            for r in range(repeats):
                llm.generate([{"prompt_token_ids": prompt_ids(n, seed=r, vocab_size=vocab)}],
                             SamplingParams(max_tokens=1, ignore_eos=True))
                times.append(sum(s.duration_s for s in llm.stats.steps if s.kind == "prefill"))
                bar.update(1)
            prefill.append((n, statistics.median(times)))
        bar.close()
    finally:
        torch.set_num_threads(previous_threads)
    startup_s = time_startup(levers, threads) if startup and levers is not None else 0.0
    return ReplicaProfile(decode_points=decode, prefill_points=prefill, startup_s=startup_s,
                          conditions={"how": "in-process (measure_profile)", "threads": threads,
                                      "levers": {k: v for k, v in (levers or {}).items() if _jsonable(v)},
                                      "decode_steps": decode_steps, "decode_prompt_tokens": decode_prompt_tokens,
                                      "repeats": repeats})


def _jsonable(value) -> bool:
    return isinstance(value, (str, int, float, bool, type(None)))


@dataclass
class StreamTiming:
    """One streamed completion, timed by the client: seconds from the run's t0 and from the request's send."""

    start_s: float = 0.0            # sent, from t0
    ttft_s: float | None = None     # send -> first chunk with a choice (the first token)
    gaps_s: list[float] = field(default_factory=list)   # between later chunks with a choice
    chunks: int = 0
    error: str = ""
    replica: str = ""               # which fleet replica answered (the x-minillm-replica header; "" from one server)
    choice_times_s: list[tuple[int, float]] = field(default_factory=list)   # (choice index, s from send) per chunk

    def gaps_by_choice(self) -> list[list[float]]:
        """The gaps between one choice's successive chunks, per choice (n > 1: one request, n sequences)."""
        times: dict[int, list[float]] = {}
        for index, at in self.choice_times_s:
            times.setdefault(index, []).append(at)
        return [[b - a for a, b in zip(ts, ts[1:])] for _, ts in sorted(times.items())]


async def stream_completion(client, url: str, body: dict, t0: float) -> StreamTiming:
    """POST a streaming completion and time its chunks (never raises: a failure is in .error)."""
    import json

    timing = StreamTiming(start_s=time.perf_counter() - t0)
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                timing.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return timing
            timing.replica = response.headers.get(REPLICA_HEADER, "")
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    timing.error = f"error in the stream: {chunk['error']}"
                    return timing
                if chunk.get("choices"):
                    now = time.perf_counter()
                    timing.choice_times_s.append((chunk["choices"][0].get("index", 0), now - start))
                    if timing.ttft_s is None:
                        timing.ttft_s = now - start
                    else:
                        timing.gaps_s.append(now - last)
                    last = now
                    timing.chunks += 1
        if timing.ttft_s is None:
            timing.error = "the stream carried no token"
    except Exception as exc:   # noqa: BLE001 - one request's failure is reported, never raised
        timing.error = f"{type(exc).__name__}: {exc}"
    return timing


async def send_requests(base_url: str, model: str, requests: list[tuple[float, list[int], int]],
                        timeout_s: float = 600.0, progress: bool = False, n: int = 1) -> list[StreamTiming]:
    """Send (at_s, prompt token ids, max_tokens) requests at their times from now (greedy, ignore_eos), streamed.
    base_url: "http://host:port", with or without "/v1". n: sequences per request (n > 1: one request
    decodes as a batch of n in the replica that takes it)."""
    import asyncio

    import httpx
    from tqdm.auto import tqdm

    from ..serve.client import normalize_base_url

    base_url = normalize_base_url(base_url)

    body = {"model": model, "stream": True, "temperature": 0.0, "ignore_eos": True, **({"n": n} if n != 1 else {})}
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=len(requests) + 4)
    bar = tqdm(total=len(requests), desc="requests", unit="req", disable=not progress)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=60.0)) as client:
        t0 = time.perf_counter()

        async def one(at_s: float, prompt: list[int], max_tokens: int) -> StreamTiming:
            delay = t0 + at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            timing = await stream_completion(client, base_url + "/v1/completions",
                                             {**body, "prompt": prompt, "max_tokens": max_tokens}, t0)
            bar.update(1)
            return timing

        timings = await asyncio.gather(*(one(*r) for r in requests))
    bar.close()
    return list(timings)


def _burst(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, timeout_s: float,
           n: int = 1) -> list[StreamTiming]:
    """All prompts at once; raises if any failed."""
    timings = run_in_thread(send_requests, base_url, model, [(0.0, p, max_tokens) for p in prompts], timeout_s,
                            False, n)
    failed = [t.error for t in timings if t.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(prompts)} calibration requests failed: {failed[0]}")
    return timings


def calibrate_on_server(base_url: str, *, num_replicas: int, batch_sizes=(1, 2, 4, 8),
                        prompt_tokens=(16, 128, 384), decode_tokens: int = 24, decode_prompt_tokens: int = 96,
                        repeats: int = 3, startup_s: float = 0.0, model: str | None = None,
                        vocab_size: int = 49152, timeout_s: float = 300.0, busy_batch: int | None = None,
                        progress: bool = True) -> ReplicaProfile:
    """A replica profile measured through a running fleet's (or server's) HTTP API with every replica busy.

    `repeats` rounds, each over every size (the medians over the rounds are kept).
    Decode at batch B: num_replicas x B concurrent streams of decode_tokens tokens after prompts of
    decode_prompt_tokens (attention reads the whole context: give the workload's typical prompt); the median
    inter-token gap (each stream's first two gaps left out: late admissions' prefill steps) is the
    step. Prefill at L tokens: num_replicas concurrent requests of L-token prompts, `repeats` times;
    the median TTFT (HTTP latency included, see the module docstring). startup_s: from the fleet
    (fleet.startup_times()), since a running fleet cannot be timed starting again. vocab_size: the served
    model's (prompts are random token ids below it).

    The busy slowdown (num_replicas >= 2; ReplicaProfile.busy_slowdown_points): k = 1 .. num_replicas
    requests at once, each asking for n = busy_batch sequences (default: the largest batch size), so that k
    replicas each decode a batch of busy_batch while the others idle (Ray's router sends the k requests to k
    different replicas; a round where two landed on one replica, read from the x-minillm-replica header, is
    left out). slowdown(k) = the median inter-token gap with k busy / with 1 busy."""
    from tqdm.auto import tqdm

    from ..serve.client import discover_model, normalize_base_url

    batch_sizes = _check_sizes("batch_sizes", batch_sizes)
    prompt_tokens = _check_sizes("prompt_tokens", prompt_tokens)
    if not (isinstance(num_replicas, int) and num_replicas >= 1):
        raise ValueError(f"num_replicas={num_replicas!r} must be an integer >= 1 (replicas serving base_url)")
    if not (isinstance(decode_tokens, int) and decode_tokens >= 6):
        raise ValueError(f"decode_tokens={decode_tokens!r} must be an integer >= 6")
    if not (isinstance(decode_prompt_tokens, int) and decode_prompt_tokens >= 1):
        raise ValueError(f"decode_prompt_tokens={decode_prompt_tokens!r} must be an integer >= 1")
    if not (isinstance(repeats, int) and repeats >= 1):
        raise ValueError(f"repeats={repeats!r} must be an integer >= 1")
    busy_batch = batch_sizes[-1] if busy_batch is None else busy_batch
    if not (isinstance(busy_batch, int) and not isinstance(busy_batch, bool) and busy_batch >= 1):
        raise ValueError(f"busy_batch={busy_batch!r} must be an integer >= 1 (sequences per busy replica)")
    base = normalize_base_url(base_url)
    model = model or discover_model(base)
    busy_counts = list(range(1, num_replicas + 1)) if num_replicas >= 2 else []
    bar = tqdm(total=1 + repeats * (len(batch_sizes) + len(prompt_tokens) + len(busy_counts)), desc="calibrate fleet",
               disable=not progress)
    _burst(base, model, [prompt_ids(16, seed=i, vocab_size=vocab_size) for i in range(num_replicas * 2)], 4,
           timeout_s)  # warm-up
    bar.update(1)
    gaps: dict[int, list[float]] = {b: [] for b in batch_sizes}
    ttfts: dict[int, list[float]] = {n: [] for n in prompt_tokens}
    busy_gaps: dict[int, list[float]] = {k: [] for k in busy_counts}
    busy_rounds_left_out = 0
    for rep in range(repeats):   # rounds over every size: a passing load on the machine touches them all alike
        for k in busy_counts:
            timings = _burst(base, model, [prompt_ids(decode_prompt_tokens, seed=100 * rep + 50 + i,
                                                      vocab_size=vocab_size) for i in range(k)],
                             decode_tokens, timeout_s, n=busy_batch)
            if len({t.replica for t in timings}) == k:
                busy_gaps[k] += [g for t in timings for per_choice in t.gaps_by_choice() for g in per_choice[2:]]
            else:
                busy_rounds_left_out += 1
            bar.update(1)
        for b in batch_sizes:
            timings = _burst(base, model, [prompt_ids(decode_prompt_tokens, seed=100 * rep + i, vocab_size=vocab_size)
                                           for i in range(num_replicas * b)], decode_tokens, timeout_s)
            gaps[b] += [g for t in timings for g in t.gaps_s[2:]]
            bar.update(1)
        for n in prompt_tokens:   # one request at a time: one replica prefilling, the others idle
            timings = _burst(base, model, [prompt_ids(n, seed=100 * rep, vocab_size=vocab_size)], 2, timeout_s)
            ttfts[n] += [t.ttft_s for t in timings]
            bar.update(1)
    bar.close()
    decode = [(b, statistics.median(gaps[b])) for b in batch_sizes]
    prefill = [(n, statistics.median(ttfts[n])) for n in prompt_tokens]
    busy_points = [(1, 1.0)]
    if busy_counts:
        missing = [k for k in busy_counts if not busy_gaps[k]]
        if missing:
            raise RuntimeError(f"the busy slowdown with {missing} replicas busy was never measured: in every round "
                               f"Ray's router sent two of the requests to one replica")
        alone = statistics.median(busy_gaps[1])
        busy_points = [(k, statistics.median(busy_gaps[k]) / alone) for k in busy_counts]
    return ReplicaProfile(decode_points=decode, prefill_points=prefill, startup_s=startup_s,
                          busy_slowdown_points=busy_points, decode_busy_replicas=num_replicas,
                          prefill_busy_replicas=1,
                          conditions={"how": "calibrate_on_server (HTTP; decode: every replica busy, prefill: one)",
                                      "base_url": base,
                                      "num_replicas": num_replicas, "decode_tokens": decode_tokens,
                                      "decode_prompt_tokens": decode_prompt_tokens,
                                      "repeats": repeats, "busy_batch": busy_batch,
                                      "busy_step_s": {k: statistics.median(v) for k, v in busy_gaps.items() if v},
                                      "busy_rounds_left_out": busy_rounds_left_out})

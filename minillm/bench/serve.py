"""Serving benchmark: a load generator for any OpenAI-compatible endpoint (vLLM's `bench serve`).

    minillm bench serve --base-url http://127.0.0.1:8000 --num-prompts 64 --request-rate 4
    minillm bench serve --max-concurrency 8 --goodput ttft:500 tpot:100 --json result.json

Requests come from a JSONL dataset of {"prompt": ..., "output_tokens": N} (by default
minillm/data/serve_prompts.jsonl, built by build_serve_dataset() from data/prompts.txt and
windows of data/corpus.txt). They are sent with `stream: true` at Poisson arrivals
(exponential gaps with mean 1 / --request-rate; `inf` sends them all at once), optionally
capped at --max-concurrency requests in flight, and each streamed answer is timed on arrival
of its chunks. The definitions are vLLM's:

    TTFT  request sent -> first chunk that carries text
    ITL   the gaps between consecutive chunks that carry text (pooled over all requests)
    E2EL  request sent -> last byte of the stream
    TPOT  (E2EL - TTFT) / (output tokens - 1), for requests with more than one output token

Output tokens come from the server's `usage` (asked for with stream_options.include_usage),
else from the number of text chunks. A request is good for goodput when it meets every given
SLO (--goodput ttft:MS tpot:MS e2el:MS); goodput = good requests / benchmark duration.
Failed requests (HTTP errors, refused connections, an error inside the stream) are counted
with their error; they never stop the run.

It measures a vLLM server unchanged (tests/test_vllm_compat.py replays vLLM 0.11's stream
shapes): `data: [DONE]`, a `"usage": null` on every completions chunk, the final usage chunk
with `"choices": []`, usage on every chunk (`continuous_usage_stats`: the last one counts), the
chat stream's role-only first chunk, empty-text chunks (a token whose text comes with the next
one), several tokens in one chunk, reasoning deltas (`reasoning_content` / `reasoning`: output
text for TTFT and ITL), tool-call argument deltas, and `{"error": ...}` inside the stream.

From a notebook (the benchmark runs its own event loop in a worker thread, so it also works
inside Jupyter's running loop):

    >>> from minillm.bench.serve import run_benchmark, compare_servers
    >>> result = run_benchmark(handle.base_url, num_prompts=16, max_concurrency=4)
    >>> print(result.table())
    >>> print(compare_servers({"minillm": handle.base_url, "vllm": "http://127.0.0.1:8001"}).table())
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import random
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path

from .runner import percentile
from .workloads import shipped_corpus, shipped_prompts

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
SLO_METRICS = ("ttft", "tpot", "e2el")
METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_TITLES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                 "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)
DATASET_FILE = "data/serve_prompts.jsonl"


# ------------------------------------------------------------------ dataset
def build_serve_dataset(num_records: int = 256, seed: int = 0) -> list[dict]:
    """Deterministic {"prompt", "output_tokens"} records from data/prompts.txt and data/corpus.txt.

    A quarter are bare questions (32-128 output tokens), half a corpus window of 40-160 words
    followed by a question (16-96), a quarter ask to summarize a window of 80-240 words (48-160).
    Lengths are in words and tokens of no particular tokenizer, so any server can take them."""
    if num_records < 1:
        raise ValueError(f"num_records={num_records} must be >= 1")
    questions = shipped_prompts()
    words = shipped_corpus().split()
    rng = random.Random(seed)

    def window(lo: int, hi: int) -> str:
        n = rng.randint(lo, hi)
        start = rng.randrange(0, len(words) - n)
        return " ".join(words[start:start + n])

    records = []
    for i in range(num_records):
        question = questions[i % len(questions)]
        kind = i % 4
        if kind == 0:
            prompt, out = question, rng.randint(32, 128)
        elif kind in (1, 2):
            prompt = f"Read the passage, then answer the question.\n\nPassage: {window(40, 160)}\n\nQuestion: {question}"
            out = rng.randint(16, 96)
        else:
            prompt, out = f"Summarize the following passage in a few sentences:\n\n{window(80, 240)}", rng.randint(48, 160)
        records.append({"prompt": prompt, "output_tokens": out})
    return records


def write_serve_dataset(path: str | Path, num_records: int = 256, seed: int = 0) -> Path:
    """Write build_serve_dataset() as JSONL (how minillm/data/serve_prompts.jsonl was made)."""
    path = Path(path)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in build_serve_dataset(num_records, seed)))
    return path


def load_dataset(dataset=None) -> list[dict]:
    """None: the shipped data/serve_prompts.jsonl; a path to a JSONL file; or a list of records
    (dicts with "prompt" and optionally "output_tokens", or plain prompt strings)."""
    if dataset is None:
        text = resources.files("minillm").joinpath(DATASET_FILE).read_text()
        source = DATASET_FILE
    elif isinstance(dataset, (str, Path)):
        path = Path(dataset)
        if not path.is_file():
            raise FileNotFoundError(f"dataset={str(dataset)!r}: no such file (a JSONL file of "
                                    '{"prompt": ..., "output_tokens": N} lines)')
        text, source = path.read_text(), str(path)
    else:
        text, source = None, "the given list"
    if text is not None:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{source} line {n} is not JSON: {exc}") from None
    else:
        records = [r if isinstance(r, dict) else {"prompt": r} for r in dataset]
    for n, r in enumerate(records):
        if not isinstance(r.get("prompt"), str) or not r["prompt"]:
            raise ValueError(f"{source} record {n} has no non-empty 'prompt' string: {str(r)[:80]}")
        out = r.get("output_tokens")
        if out is not None and not (isinstance(out, int) and out >= 1):
            raise ValueError(f"{source} record {n}: output_tokens={out!r} must be an integer >= 1")
    if not records:
        raise ValueError(f"{source} holds no records")
    return records


# ------------------------------------------------------------------ arrivals and SLOs
def arrival_gaps(num_requests: int, request_rate: float, seed: int = 0) -> list[float]:
    """Seconds to wait before each request after the previous one was sent (the first goes at 0):
    exponential gaps with mean 1 / request_rate, i.e. Poisson arrivals; all 0 for rate inf."""
    if not (request_rate > 0):
        raise ValueError(f"request_rate={request_rate} must be > 0 requests/s (or inf: all at once)")
    if math.isinf(request_rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(request_rate) for _ in range(num_requests - 1)]


def parse_goodput(spec) -> dict[str, float]:
    """SLOs in milliseconds: ["ttft:200", "e2el:5000"], "ttft:200 tpot:50" or {"ttft": 200}."""
    if spec is None:
        return {}
    if isinstance(spec, str):
        spec = spec.replace(",", " ").split()
    if isinstance(spec, dict):
        items = list(spec.items())
    else:
        items = []
        for part in spec:
            name, sep, value = str(part).partition(":")
            if not sep:
                raise ValueError(f"goodput {part!r} must look like NAME:MILLISECONDS with NAME in {SLO_METRICS}")
            try:
                items.append((name, float(value)))
            except ValueError:
                raise ValueError(f"goodput {part!r}: {value!r} is not a number of milliseconds") from None
    slos = {}
    for name, value in items:
        if name not in SLO_METRICS:
            raise ValueError(f"goodput metric {name!r} is not one of {SLO_METRICS}")
        if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
            raise ValueError(f"goodput {name}:{value} must be a positive number of milliseconds")
        slos[name] = float(value)
    return slos


def parse_percentiles(spec) -> tuple[float, ...]:
    values = spec.replace(",", " ").split() if isinstance(spec, str) else list(spec)
    out = []
    for v in values:
        try:
            p = float(v)
        except ValueError:
            raise ValueError(f"percentile {v!r} is not a number in [0, 100]") from None
        if not 0 <= p <= 100:
            raise ValueError(f"percentile {p:g} must be in [0, 100]")
        out.append(p)
    if not out:
        raise ValueError("give at least one percentile, e.g. 50,90,99")
    return tuple(out)


# ------------------------------------------------------------------ results
@dataclass
class RequestRecord:
    """One request's outcome; times in seconds, start_s from the benchmark's start."""
    index: int
    max_tokens: int | None
    success: bool = False
    error: str = ""
    start_s: float = 0.0
    ttft_s: float | None = None
    e2el_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None     # from usage (None when the server sent none)
    output_tokens: int = 0               # from usage, else the number of text chunks
    usage_reported: bool = False
    num_chunks: int = 0                  # chunks that carried text
    text: str = ""

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def meets(self, slos_ms: dict[str, float]) -> bool:
        if not self.success:
            return False
        values = {"ttft": self.ttft_s, "tpot": self.tpot_s, "e2el": self.e2el_s}
        # A one-token answer has no TPOT: vLLM counts it as 0, so it meets any TPOT SLO.
        return all((values[name] or 0.0) * 1e3 <= limit for name, limit in slos_ms.items())


def summarize(values_s: list[float], percentiles=DEFAULT_PERCENTILES) -> dict[str, float]:
    """mean / median / std / p<q> of a list of seconds, in milliseconds (nan when empty)."""
    ms = [v * 1e3 for v in values_s]
    nan = float("nan")
    out = {"mean_ms": statistics.fmean(ms) if ms else nan, "median_ms": statistics.median(ms) if ms else nan,
           "std_ms": statistics.pstdev(ms) if ms else nan}
    for q in percentiles:
        out[f"p{q:g}_ms"] = percentile(ms, q)
    return out


@dataclass
class ServeBenchResult:
    base_url: str
    endpoint: str
    model: str
    num_prompts: int
    request_rate: float
    max_concurrency: int | None
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float           # completed requests / s
    output_throughput: float            # output tokens / s
    total_token_throughput: float       # (input + output) tokens / s
    goodput: float | None               # good requests / s (None without SLOs)
    goodput_slos_ms: dict[str, float]
    num_good: int
    peak_in_flight: int                 # most requests this client had open at once
    percentiles: tuple[float, ...]
    metrics: dict[str, dict[str, float]]   # "ttft" | "tpot" | "itl" | "e2el" -> summarize()
    errors: dict[str, int]              # error message -> count
    records: list[RequestRecord]
    input_tokens_known: bool = True     # False when some successful request had no usage

    def table(self) -> str:
        w = 50

        def line(label: str, value) -> str:
            text = f"{value:.2f}" if isinstance(value, float) else str(value)
            return f"{label:<40}{text:>10}"

        out = ["{s:=^{w}}".format(s=" Serving Benchmark Result ", w=w),
               line("Successful requests:", self.completed),
               line("Failed requests:", self.failed)]
        if self.max_concurrency is not None:
            out.append(line("Maximum request concurrency:", self.max_concurrency))
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        out += [line("Request rate (req/s):", rate),
                line("Benchmark duration (s):", self.duration_s),
                line("Total input tokens:", self.total_input_tokens if self.input_tokens_known
                     else f"{self.total_input_tokens}*"),
                line("Total generated tokens:", self.total_output_tokens),
                line("Request throughput (req/s):", self.request_throughput),
                line("Output token throughput (tok/s):", self.output_throughput),
                line("Total token throughput (tok/s):", self.total_token_throughput)]
        if self.goodput is not None:
            slos = " ".join(f"{k}<={v:g}ms" for k, v in self.goodput_slos_ms.items())
            out.append(line("Request goodput (req/s):", self.goodput))
            out.append(f"  ({self.num_good} of {self.num_prompts} requests met {slos})")
        for name in METRICS:
            m = self.metrics[name]
            out.append("{s:-^{w}}".format(s=METRIC_TITLES[name], w=w))
            out.append(line(f"Mean {name.upper()} (ms):", m["mean_ms"]))
            out.append(line(f"Median {name.upper()} (ms):", m["median_ms"]))
            for q in self.percentiles:
                if q == 50:
                    continue    # the median, printed above
                out.append(line(f"P{q:g} {name.upper()} (ms):", m[f"p{q:g}_ms"]))
        out.append("=" * w)
        if not self.input_tokens_known:
            out.append("* some responses carried no usage: their prompt tokens are not counted")
        for error, count in sorted(self.errors.items(), key=lambda kv: -kv[1])[:5]:
            out.append(f"failed x{count}: {error}")
        return "\n".join(out)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["request_rate"] = "inf" if math.isinf(self.request_rate) else self.request_rate
        for r, rec in zip(d["records"], self.records):
            r["tpot_s"] = rec.tpot_s
        return d


# ------------------------------------------------------------------ the client
def normalize_base_url(base_url: str) -> str:
    """'http://host:port', '.../' or '.../v1' -> 'http://host:port' (endpoints carry /v1)."""
    url = base_url.rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"base_url={base_url!r} must start with http:// or https://")
    return url


def discover_model(base_url: str, timeout_s: float = 30.0) -> str:
    """The first model id that GET /v1/models lists."""
    import httpx

    url = normalize_base_url(base_url) + "/v1/models"
    try:
        response = httpx.get(url, timeout=timeout_s)
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise ValueError(f"could not read a model id from {url} ({type(exc).__name__}: {exc}); "
                         "pass model= (--model)") from None


def _payload(endpoint: str, model: str, prompt: str, max_tokens: int | None, ignore_eos: bool) -> dict:
    body = {"model": model, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0}
    if endpoint == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    if ignore_eos:
        body["ignore_eos"] = True   # vLLM's extension: generate all max_tokens
    return body


def _chunk_text(chunk: dict, endpoint: str) -> tuple[str, str]:
    """(answer text, all output text) of a streamed chunk. Chat deltas also carry a reasoning model's
    thinking (vLLM's `reasoning_content`, later `reasoning`) and tool-call arguments: output tokens
    for TTFT and ITL, though not the answer."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", ""
    choice = choices[0]
    if endpoint != "/v1/chat/completions":
        text = choice.get("text") or ""
        return text, text
    delta = choice.get("delta") or {}
    content = delta.get("content") or ""
    other = (delta.get("reasoning_content") or "") + (delta.get("reasoning") or "")
    for call in delta.get("tool_calls") or []:
        function = (call or {}).get("function") or {}
        other += (function.get("name") or "") + (function.get("arguments") or "")
    return content, other + content


async def _send(client, url: str, endpoint: str, body: dict, record: RequestRecord, t0: float) -> None:
    import httpx

    start = time.perf_counter()
    record.start_s = start - t0
    last = None
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace").strip()
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                return
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue        # blank separators, ": keep-alive" comments, "event:" lines
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk or chunk.get("object") == "error":   # vLLM: {"error": {...}}, then [DONE]
                    err = chunk.get("error", chunk)
                    record.error = f"error in the stream: {err.get('message', err) if isinstance(err, dict) else err}"
                    return
                answer, output = _chunk_text(chunk, endpoint)
                if output:
                    if record.ttft_s is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last)
                    last = now
                    record.num_chunks += 1
                    record.text += answer
                usage = chunk.get("usage")
                if usage:   # the final usage chunk, or (continuous_usage_stats) every chunk's running total
                    record.usage_reported = True
                    record.prompt_tokens = usage.get("prompt_tokens")
                    record.output_tokens = usage.get("completion_tokens") or 0
        record.e2el_s = time.perf_counter() - start
        if record.ttft_s is None:
            record.error = "the stream carried no text"
            return
        if not record.usage_reported:
            record.output_tokens = record.num_chunks
        record.success = True
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except (json.JSONDecodeError, AttributeError, TypeError) as exc:
        record.error = f"malformed stream: {type(exc).__name__}: {exc}"
    except Exception as exc:   # anything else still fails this request only, never the run
        record.error = f"{type(exc).__name__}: {exc}"


async def _benchmark(base_url: str, model: str, endpoint: str, prompts: list[tuple[str, int | None]],
                     gaps: list[float], max_concurrency: int | None, ignore_eos: bool,
                     progress: bool, timeout_s: float) -> tuple[list[RequestRecord], float, int]:
    import httpx
    from tqdm.auto import tqdm

    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    timeout = httpx.Timeout(timeout_s, connect=60.0)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    records = [RequestRecord(i, max_tokens) for i, (_, max_tokens) in enumerate(prompts)]
    in_flight = peak = 0
    url = base_url + endpoint
    bar = tqdm(total=len(prompts), desc="bench serve", unit="req", disable=not progress)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        send_at = list(itertools.accumulate(gaps))

        async def one(i: int) -> None:
            nonlocal in_flight, peak
            delay = t0 + send_at[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            prompt, max_tokens = prompts[i]
            body = _payload(endpoint, model, prompt, max_tokens, ignore_eos)
            if semaphore is not None:
                await semaphore.acquire()
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await _send(client, url, endpoint, body, records[i], t0)
            finally:
                in_flight -= 1
                if semaphore is not None:
                    semaphore.release()
                bar.update(1)

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        duration = time.perf_counter() - t0
    bar.close()
    return records, duration, peak


def run_in_thread(coro_fn, *args, **kwargs):
    """asyncio.run(coro_fn(*args, **kwargs)) on a worker thread: callers inside a running loop (Jupyter) can wait
    on it."""
    box: dict = {}

    def target():
        try:
            box["value"] = asyncio.run(coro_fn(*args, **kwargs))
        except BaseException as exc:   # re-raised on the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target, name="minillm-bench-serve", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def run_benchmark(base_url: str, model: str | None = None, *, endpoint: str = "/v1/completions",
                  num_prompts: int = 64, request_rate: float = float("inf"), max_concurrency: int | None = None,
                  max_tokens: int | None = None, dataset=None, seed: int = 0, goodput=None,
                  ignore_eos: bool = True, progress: bool = True,
                  percentiles=DEFAULT_PERCENTILES, timeout_s: float = 3600.0) -> ServeBenchResult:
    """Send `num_prompts` streamed requests to an OpenAI-compatible server and measure them.

    base_url: "http://host:port" with or without "/v1". model: None asks GET /v1/models.
    request_rate: requests/s with Poisson arrivals (inf: all at once). max_concurrency: at most
    this many requests in flight. max_tokens: overrides every record's output_tokens.
    dataset: None (data/serve_prompts.jsonl), a JSONL path or a list of records. goodput: SLOs
    in ms, {"ttft": 200, "tpot": 50, "e2el": 5000} or ["ttft:200", ...]."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"endpoint={endpoint!r} is not one of {ENDPOINTS}")
    if not (isinstance(num_prompts, int) and num_prompts >= 1):
        raise ValueError(f"num_prompts={num_prompts!r} must be an integer >= 1")
    if max_concurrency is not None and not (isinstance(max_concurrency, int) and max_concurrency >= 1):
        raise ValueError(f"max_concurrency={max_concurrency!r} must be None or an integer >= 1")
    if max_tokens is not None and not (isinstance(max_tokens, int) and max_tokens >= 1):
        raise ValueError(f"max_tokens={max_tokens!r} must be None or an integer >= 1")
    if not (timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s} must be > 0 seconds")
    base = normalize_base_url(base_url)
    slos = parse_goodput(goodput)
    percentiles = parse_percentiles(percentiles)
    gaps = arrival_gaps(num_prompts, request_rate, seed)
    records = load_dataset(dataset)
    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    chosen = [records[order[i % len(order)]] for i in range(num_prompts)]
    prompts = [(r["prompt"], max_tokens if max_tokens is not None else r.get("output_tokens")) for r in chosen]
    model = model or discover_model(base)

    results, duration, peak = run_in_thread(_benchmark, base, model, endpoint, prompts, gaps, max_concurrency,
                                         ignore_eos, progress, timeout_s)
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    good = sum(r.meets(slos) for r in results) if slos else 0
    metrics = {
        "ttft": summarize([r.ttft_s for r in ok], percentiles),
        "tpot": summarize([r.tpot_s for r in ok if r.tpot_s is not None], percentiles),
        "itl": summarize([g for r in ok for g in r.itl_s], percentiles),
        "e2el": summarize([r.e2el_s for r in ok], percentiles),
    }
    return ServeBenchResult(
        base_url=base, endpoint=endpoint, model=model, num_prompts=num_prompts, request_rate=float(request_rate),
        max_concurrency=max_concurrency, completed=len(ok), failed=len(results) - len(ok), duration_s=duration,
        total_input_tokens=total_in, total_output_tokens=total_out,
        request_throughput=len(ok) / duration, output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        goodput=good / duration if slos else None, goodput_slos_ms=slos, num_good=good, peak_in_flight=peak,
        percentiles=percentiles, metrics=metrics, errors=dict(Counter(r.error for r in results if not r.success)),
        records=results, input_tokens_known=all(r.prompt_tokens is not None for r in ok))


# ------------------------------------------------------------------ the same benchmark against several servers
DEFAULT_VLLM_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"   # minillm's default model, by its hub id
COMPARE_COLUMNS = (   # (key, header, width, format)
    ("server", "server", 10, ""), ("completed", "ok", 4, "d"), ("failed", "fail", 5, "d"),
    ("request_throughput", "req/s", 7, ".2f"), ("output_throughput", "out tok/s", 10, ".1f"),
    ("output_throughput_ratio", "x first", 8, ".2f"), ("ttft_mean_ms", "TTFT ms", 9, ".1f"),
    ("ttft_p99_ms", "TTFT p99", 9, ".1f"), ("tpot_mean_ms", "TPOT ms", 9, ".1f"), ("itl_mean_ms", "ITL ms", 8, ".1f"),
    ("e2el_mean_ms", "E2EL ms", 9, ".1f"))


def server_missing_note(name: str, url: str, error: str = "") -> str:
    """What to tell a learner when a server does not answer (a vLLM one needs a GPU to exist at all)."""
    if "vllm" in name.lower():
        port = url.rstrip("/").removesuffix("/v1").rsplit(":", 1)[-1]
        port = f" --port {port}" if port.isdigit() else ""
        return (f"no vLLM server at {url} (vLLM needs a GPU; run `vllm serve {DEFAULT_VLLM_MODEL}{port}` "
                "where one exists)")
    return f"no server answers at {url}" + (f" ({error})" if error else "")


def _answers(base_url: str, timeout_s: float) -> str:
    """'' when GET /v1/models answers 200, else why not."""
    import httpx

    try:
        response = httpx.get(normalize_base_url(base_url) + "/v1/models", timeout=timeout_s)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return "" if response.status_code == 200 else f"GET /v1/models: HTTP {response.status_code}"


@dataclass
class ServerComparison:
    """compare_servers' answer: one row per server (skipped ones with their note), the full results."""

    rows: list[dict]
    results: dict[str, ServeBenchResult]
    notes: dict[str, str]               # server name -> why it was skipped
    settings: dict

    def table(self) -> str:
        head = "".join(f"{h:{'<' if k == 'server' else '>'}{w}}" for k, h, w, _ in COMPARE_COLUMNS)
        st = self.settings
        tokens = f"{st['max_tokens']} tokens" if st["max_tokens"] else "the dataset's output lengths"
        at_once = f"at most {st['max_concurrency']} at once" if st["max_concurrency"] else "no concurrency cap"
        lines = [f"{st['endpoint']}: {st['num_prompts']} requests x {tokens}, {at_once}, request rate "
                 f"{st['request_rate']}/s; the same prompts and arrivals for each server", head]
        for row in self.rows:
            if row["skipped"]:
                lines.append(f"{row['server']:<10}skipped: {row['note']}")
                continue
            lines.append("".join(f"{row[k]:{'<' if k == 'server' else '>'}{w}{f}}" for k, _, w, f in COMPARE_COLUMNS))
        if self.rows and any(not r["skipped"] for r in self.rows):
            first = next(r for r in self.rows if not r["skipped"])
            lines.append(f"x first: output tok/s over {first['server']}'s")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"rows": self.rows, "notes": self.notes, "settings": self.settings,
                "results": {name: r.to_dict() for name, r in self.results.items()}}


def compare_servers(servers: dict[str, str], models: dict[str, str] | None = None, *,
                    endpoint: str = "/v1/completions", num_prompts: int = 16, max_concurrency: int | None = 4,
                    max_tokens: int | None = 32, request_rate: float = float("inf"), dataset=None, seed: int = 0,
                    goodput=None, ignore_eos: bool = True, progress: bool = True, check_timeout_s: float = 5.0,
                    timeout_s: float = 3600.0) -> ServerComparison:
    """The same benchmark (prompts, arrivals, max_tokens, concurrency) against each server in turn.

    servers: {"minillm": "http://127.0.0.1:8000", "vllm": "http://gpu-box:8001"}; a server that
    does not answer GET /v1/models within check_timeout_s is skipped with a note (a "vllm" one
    says how to start vLLM where a GPU exists), never an exception. models: {name: model id}
    (default: each server's first /v1/models id). The other arguments are run_benchmark's."""
    if not servers:
        raise ValueError("servers={} is empty: give {name: base_url}, e.g. {'minillm': 'http://127.0.0.1:8000'}")
    rows, results, notes = [], {}, {}
    for name, url in servers.items():
        normalize_base_url(url)   # a malformed URL is the caller's mistake: ValueError now
        problem = _answers(url, check_timeout_s)
        if problem:
            notes[name] = server_missing_note(name, url, problem)
            rows.append({"server": name, "url": url, "skipped": True, "note": notes[name]})
            continue
        result = run_benchmark(url, (models or {}).get(name), endpoint=endpoint, num_prompts=num_prompts,
                               request_rate=request_rate, max_concurrency=max_concurrency, max_tokens=max_tokens,
                               dataset=dataset, seed=seed, goodput=goodput, ignore_eos=ignore_eos,
                               progress=progress, timeout_s=timeout_s)
        results[name] = result
        m = result.metrics
        rows.append({"server": name, "url": url, "skipped": False, "note": "", "model": result.model,
                     "completed": result.completed, "failed": result.failed,
                     "request_throughput": result.request_throughput, "output_throughput": result.output_throughput,
                     "ttft_mean_ms": m["ttft"]["mean_ms"], "ttft_p99_ms": m["ttft"].get("p99_ms", float("nan")),
                     "tpot_mean_ms": m["tpot"]["mean_ms"], "itl_mean_ms": m["itl"]["mean_ms"],
                     "e2el_mean_ms": m["e2el"]["mean_ms"], "total_output_tokens": result.total_output_tokens,
                     "goodput": result.goodput})
    measured = [r for r in rows if not r["skipped"]]
    for row in measured:
        first = measured[0]["output_throughput"]
        row["output_throughput_ratio"] = row["output_throughput"] / first if first else float("nan")
    settings = {"endpoint": endpoint, "num_prompts": num_prompts, "max_concurrency": max_concurrency,
                "max_tokens": max_tokens, "request_rate": "inf" if math.isinf(request_rate) else request_rate,
                "seed": seed}
    return ServerComparison(rows, results, notes, settings)


# ------------------------------------------------------------------ command line
def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of requests/s (or inf)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"request rate {text} must be > 0 (or inf)")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minillm bench serve", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="TTFT, ITL, E2EL and TPOT are vLLM's definitions (see the module docstring).")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, with or without /v1")
    p.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    p.add_argument("--model", default=None, help="default: the first id GET /v1/models lists")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--request-rate", type=_rate, default=float("inf"),
                   help="requests/s with Poisson arrivals (exponential gaps); inf sends all at once (default)")
    p.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    p.add_argument("--dataset", default=None, help="JSONL of {\"prompt\": ..., \"output_tokens\": N} "
                                                  "(default: minillm/data/serve_prompts.jsonl)")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens for every request "
                                                               "(default: each record's output_tokens)")
    p.add_argument("--seed", type=int, default=0, help="which records, in which order, and the arrival gaps")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask the server to generate all max_tokens (vLLM's ignore_eos; default on)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs, e.g. ttft:500 tpot:100 e2el:10000; goodput = requests meeting all / s")
    p.add_argument("--percentiles", "--metric-percentiles", default="50,90,99",
                   help="latency percentiles to report, e.g. 50,90,99 (vLLM's spelling: --metric-percentiles)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds a request may wait for its next bytes")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the result (with every request) here")
    p.add_argument("--no-progress", "--disable-tqdm", action="store_true", help="no progress bar (vLLM: --disable-tqdm)")
    p.add_argument("--compare", nargs="+", default=None, metavar="NAME=URL",
                   help="run the same benchmark against each server in turn and print one table, e.g. "
                        "minillm=http://127.0.0.1:8000 vllm=http://127.0.0.1:8001 (a server that does not answer is "
                        "skipped with a note)")
    p.add_argument("--write-dataset", default=None, metavar="FILE",
                   help="write build_serve_dataset() to FILE (how data/serve_prompts.jsonl is made) and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.write_dataset:
            print(write_serve_dataset(args.write_dataset))
            return 0
        if args.compare:
            servers = {}
            for item in args.compare:
                name, sep, url = item.partition("=")
                if not sep or not name or not url:
                    raise ValueError(f"--compare {item!r} must be NAME=URL, e.g. vllm=http://127.0.0.1:8001")
                servers[name] = url
            comparison = compare_servers(servers, endpoint=args.endpoint, num_prompts=args.num_prompts,
                                         request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                                         max_tokens=args.max_tokens, dataset=args.dataset, seed=args.seed,
                                         goodput=args.goodput, ignore_eos=args.ignore_eos,
                                         progress=not args.no_progress, timeout_s=args.timeout)
            print(comparison.table())
            if args.json:
                Path(args.json).write_text(json.dumps(comparison.to_dict(), indent=1))
            return 0 if comparison.results else 1
        result = run_benchmark(args.base_url, args.model, endpoint=args.endpoint, num_prompts=args.num_prompts,
                               request_rate=args.request_rate, max_concurrency=args.max_concurrency,
                               max_tokens=args.max_tokens, dataset=args.dataset, seed=args.seed,
                               goodput=args.goodput, ignore_eos=args.ignore_eos, progress=not args.no_progress,
                               percentiles=args.percentiles, timeout_s=args.timeout)
    except (ValueError, FileNotFoundError) as exc:
        print(f"minillm bench serve: {exc}", file=sys.stderr)
        return 2
    print(f"{result.endpoint} on {result.base_url}, model {result.model}")
    print(result.table())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1))
    return 0 if result.completed else 1


if __name__ == "__main__":
    sys.exit(main())

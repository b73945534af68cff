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
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..serve.client import (RequestRecord, discover_model, normalize_base_url, run_in_thread, stream_request,
                            streaming_body)
from .serve_dataset import arrival_gaps, load_dataset, parse_goodput, parse_percentiles, write_serve_dataset
from .serve_result import DEFAULT_PERCENTILES, ServeBenchResult, summarize

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


# ------------------------------------------------------------------ the load
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
            body = streaming_body(endpoint, model, prompt, max_tokens, ignore_eos)
            if semaphore is not None:
                await semaphore.acquire()
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await stream_request(client, url, endpoint, body, records[i], t0)
            finally:
                in_flight -= 1
                if semaphore is not None:
                    semaphore.release()
                bar.update(1)

        await asyncio.gather(*(one(i) for i in range(len(prompts))))
        duration = time.perf_counter() - t0
    bar.close()
    return records, duration, peak


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

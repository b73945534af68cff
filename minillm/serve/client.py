"""The HTTP/SSE client of an OpenAI-compatible server: find the server and its model, stream one request and time it.

What the load generator (minillm/bench/serve.py) and the fleet's calibration (minillm/fleet/profile.py) share:

* `normalize_base_url` and `discover_model`: "http://host:port" with or without /v1, and its first model id;
* `streaming_body` and `stream_request`: one `stream: true` request, each chunk timed on arrival into a
  `RequestRecord` (TTFT, the inter-token gaps, E2EL; output tokens from the server's `usage`, else the
  number of text chunks);
* `run_in_thread`: an asyncio client run on a worker thread, so a caller inside a running loop (Jupyter)
  can wait on it; `percentile`, the latency statistics' one interpolation.

It reads a vLLM server's stream unchanged (tests/test_vllm_compat.py replays vLLM 0.11's stream shapes):
`data: [DONE]`, a `"usage": null` on every completions chunk, the final usage chunk with `"choices": []`,
usage on every chunk (`continuous_usage_stats`: the last one counts), the chat stream's role-only first
chunk, empty-text chunks, several tokens in one chunk, reasoning deltas (`reasoning_content` /
`reasoning`: output text for TTFT and ITL), tool-call argument deltas, and `{"error": ...}` inside the stream.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field


def percentile(values: list[float], q: float) -> float:
    """q in [0, 100], linear interpolation (numpy's default)."""
    if not values:
        return float("nan")
    values = sorted(values)
    pos = (len(values) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


# ------------------------------------------------------------------ the server
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


# ------------------------------------------------------------------ one streamed request
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


def streaming_body(endpoint: str, model: str, prompt: str, max_tokens: int | None, ignore_eos: bool) -> dict:
    """The JSON body of a streamed, greedy request to /v1/completions or /v1/chat/completions."""
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


async def stream_request(client, url: str, endpoint: str, body: dict, record: RequestRecord, t0: float) -> None:
    """POST `body` to `url` on the httpx.AsyncClient `client` and time its stream into `record` (start_s from
    t0). A failure (HTTP error, refused connection, an error inside the stream) is recorded, never raised."""
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

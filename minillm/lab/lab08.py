"""Lab 08 helpers — serving and cost: checks of the learner's SSE parser, stream timer, goodput,
$ per million tokens and batch-size choice; a raw streaming client over httpx; the batch-size sweep
through the server with the load generator; the tables and figures of the notebook's experiments (the
stream timed by the learner's stream_metrics, the cost ladder beside the sources' H100 numbers: their
code is in the notebook).

The learner writes, with fixed signatures:

    parse_sse(lines) -> list[dict]                            # the JSON of every `data:` line, up to [DONE]
    stream_metrics(timed_lines, sent_s) -> dict               # {"text", "ttft_s", "itl_s"}
    goodput(records, slo, duration_s) -> float                # requests per second that meet every SLO
    cost_per_million(tokens_per_s, hourly_usd) -> float       # USD per million output tokens
    choose_batch_size(measurements, per_user_floor_tps) -> int | None

and, in the notebook's cells, a measurement (measure_batch_sweep: each sweep row's aggregate and per-user
tokens/s from its raw records, checked by check_measure_batch_sweep) and a short answer (answer_best_lever:
the lever whose own step of the cost ladder was the largest, checked by check_answer_best_lever).

The engine-facing pieces (minillm.serve, minillm.bench.serve, minillm.bench.cost) are imported
where they are used, so the checks of the five functions run without a server.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections.abc import Callable, Sequence

from .common import (
    CheckFailed,
    call_learner,
    control_panel,
    echo_prediction,
    format_seconds,
    new_figure,
    passed,
)

# The sources' cost ladder: one H100 at 2.50 USD per hour, output tokens per second as the levers
# stack. The naive engine makes one token every 30 ms (33.3 tok/s): 20.83 USD per million tokens.
SOURCE_DEVICE = "NVIDIA H100 (the sources' example)"
SOURCE_HOURLY_USD = 2.50
SOURCE_STACK: tuple[tuple[str, float], ...] = (
    ("naive: one request at a time", 100 / 3),
    ("+ continuous batching + paging", 466.0),
    ("+ quantization", 747.0),
    ("+ speculative decoding", 1335.0),
)
SOURCE_USD_PER_MTOK = (20.83, 1.49, 0.93, 0.52)

# The SLO keys goodput understands: a record's metric (seconds) must be <= the limit.
SLO_KEYS = ("ttft_s", "tpot_s", "e2el_s")


_call = call_learner   # lab/common.py


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# =================================================================== 1. server-sent events
def reference_parse_sse(lines: Sequence[str]) -> list[dict]:
    """The JSON payload of every `data:` line, in order, up to `data: [DONE]`."""
    events = []
    for line in lines:
        line = line.rstrip("\r\n")
        if not line.startswith("data:"):
            continue   # blank event separators, ': keep-alive' comments, event: / id: / retry: fields
        data = line[len("data:"):]
        if data.startswith(" "):
            data = data[1:]
        if data.strip() == "[DONE]":
            break
        events.append(json.loads(data))
    return events


def _sse(event: dict) -> str:
    return "data: " + json.dumps(event, separators=(",", ":"))


def completion_chunk(text: str, finish_reason: str | None = None, index: int = 0) -> dict:
    """A /v1/completions stream chunk, as OpenAI (and minillm's server) sends it."""
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
            "choices": [{"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(content: str | None = None, role: str | None = None, finish_reason: str | None = None) -> dict:
    """A /v1/chat/completions stream chunk: the first carries only the role, the last only a finish_reason."""
    delta: dict = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(prompt_tokens: int = 5, completion_tokens: int = 3) -> dict:
    """The last chunk when the request asks for stream_options={"include_usage": true}: no choices."""
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


def _sse_cases() -> list[tuple[list[str], str]]:
    a, b, c = completion_chunk(" Paris"), completion_chunk(" is"), completion_chunk("", "stop")
    return [
        ([_sse(a), "", _sse(b), "", "data: [DONE]", ""], "two chunks, each followed by a blank separator line"),
        ([_sse(a), "", "data: [DONE]", "", _sse(b)], "nothing after data: [DONE] counts"),
        ([": keep-alive", "", _sse(a), "", ": ping", _sse(c), "", "data: [DONE]"], "comment lines start with ':'"),
        (["event: message", "id: 7", _sse(a), "retry: 100", "", "data: [DONE]"], "event:, id: and retry: are not data"),
        (["data:" + json.dumps(b), "", "data:[DONE]"], "'data:' without the space is legal SSE"),
        ([_sse(a) + "\r", "\r", "data: [DONE]\r"], "lines may end in '\\r'"),
        ([_sse(chat_chunk(role="assistant", content="")), _sse(chat_chunk("Hi")), _sse(usage_chunk()), "data: [DONE]"],
         "chat chunks and a usage chunk are events like any other"),
        ([], "an empty stream"),
        (["data: [DONE]"], "only [DONE]"),
        ([_sse(a), _sse(b)], "a stream cut before [DONE]: keep what arrived"),
    ]


def _diagnose_sse(lines: list[str], got: list, want: list[dict]) -> str:
    if any(line.strip() == "data: [DONE]" or line.strip() == "data:[DONE]" for line in lines) and len(got) > len(want):
        return "stop at data: [DONE]: it ends the stream (it is not JSON, and nothing after it is an event)"
    if not got and want and any(line.startswith("data:") and not line.startswith("data: ") for line in lines):
        return "after 'data:' the space is optional: 'data:{...}' is a data line too"
    if got and not isinstance(got[0], dict):
        return "return the parsed JSON (json.loads of what follows 'data: '), a dict per event, not the raw text"
    if len(got) < len(want):
        return "every 'data:' line before [DONE] is one event; only blank, ':' comment and other field lines are skipped"
    return "json.loads the text after 'data:' (one optional space), skip every other line, stop at [DONE]"


def check_parse_sse(parse_sse: Callable) -> None:
    """Your parser vs the reference on streams with separators, comments, fields, [DONE] and '\\r'."""
    cases = _sse_cases()
    for lines, why in cases:
        call = f"parse_sse({lines!r})"
        hint = ("'data: [DONE]' ends the stream and is not JSON; blank lines, ': comment' lines and other fields "
                "(event:, id:) are not events: skip them" if any(not line.startswith("data:") or "[DONE]" in line
                                                                for line in lines) else "")
        got = _call(parse_sse, (list(lines),), call, hint)
        want = reference_parse_sse(lines)
        if not isinstance(got, (list, tuple)) or list(got) != want:
            got_list = list(got) if isinstance(got, (list, tuple)) else []
            raise CheckFailed(f"{call} returned {got!r}, expected {want} ({why}): "
                              + _diagnose_sse(lines, got_list, want))
    passed("parse_sse", len(cases))


def _sse_edge_cases() -> list[tuple[list[str], str]]:
    a = completion_chunk(" Paris")
    return [
        ([], "an empty stream: no events"),
        (["", "", ""], "only blank lines: no events"),
        (["data: [DONE]", _sse(a)], "[DONE] first: nothing counts"),
        (["data:" + json.dumps(a), "data:[DONE]"], "'data:' without the space is legal SSE"),
        ([_sse(a) + "\r", "\r", "data: [DONE]\r", _sse(a) + "\r"], "lines that end in '\\r' (the [DONE] too)"),
        (['data: {"s": "data: [DONE]"}', "data: [DONE]"], "'[DONE]' inside a JSON string is data, not the end"),
        (['data: {"s": "[DONE]"}', 'data:{"t": 2}'], "a JSON string '[DONE]', no [DONE] line: keep both"),
    ]


def check_parse_sse_edges(parse_sse: Callable) -> None:
    """Your parser on the edges: empty input, no space after 'data:', '\\r' line ends, '[DONE]' inside JSON."""
    cases = _sse_edge_cases()
    for lines, why in cases:
        call = f"parse_sse({lines!r})"
        got = _call(parse_sse, (list(lines),), call,
                    "strip a trailing '\\r' before looking at a line; only a line whose data is exactly [DONE] ends it")
        want = reference_parse_sse(lines)
        if not isinstance(got, (list, tuple)) or list(got) != want:
            got_list = list(got) if isinstance(got, (list, tuple)) else []
            if any("[DONE]" in line and line.rstrip("\r") not in ("data: [DONE]", "data:[DONE]") for line in lines) \
                    and len(got_list) < len(want):
                hint = ("only a line whose data is exactly [DONE] ends the stream; '[DONE]' inside a JSON string is "
                        "data (compare the data with '[DONE]', do not search the line for it)")
            else:
                hint = _diagnose_sse(lines, got_list, want)
            raise CheckFailed(f"{call} returned {got!r}, expected {want} ({why}): {hint}")
    passed("parse_sse on the edges", len(cases))


# =================================================================== 2. timing a stream
def chunk_text(event: dict) -> str:
    """The text one stream chunk adds: choices[0]["text"] (completions) or choices[0]["delta"]["content"]
    (chat); '' for a role-only, finish-only or usage chunk."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def reference_stream_metrics(timed_lines: Sequence[tuple[float, str]], sent_s: float) -> dict:
    """Text, time to first token and inter-token gaps of one streamed response: only chunks that
    carry text count (the time a chunk's line arrived is its time)."""
    pieces, times = [], []
    for arrival_s, line in timed_lines:
        for event in reference_parse_sse([line]):
            piece = chunk_text(event)
            if piece:
                pieces.append(piece)
                times.append(arrival_s)
    return {"text": "".join(pieces), "ttft_s": times[0] - sent_s if times else None,
            "itl_s": [b - a for a, b in zip(times, times[1:])]}


def _timed(sent_s: float, events: list[tuple[float, dict | str]]) -> list[tuple[float, str]]:
    lines = []
    for t, event in events:
        lines.append((sent_s + t, event if isinstance(event, str) else _sse(event)))
        lines.append((sent_s + t, ""))
    return lines


def _stream_cases() -> list[tuple[list[tuple[float, str]], float, str]]:
    sent = 1000.0
    chat = _timed(sent, [(0.05, chat_chunk(role="assistant", content="")), (0.40, chat_chunk("The")),
                         (0.55, chat_chunk(" sky")), (0.75, chat_chunk(" is")), (0.80, chat_chunk(" blue")),
                         (0.81, chat_chunk(finish_reason="stop")), (0.81, usage_chunk(9, 4)), (0.82, "data: [DONE]")])
    completion = _timed(sent, [(0.30, completion_chunk(" Paris")), (0.42, completion_chunk(",")),
                               (0.61, completion_chunk(" the capital")),   # one chunk may carry several tokens
                               (0.66, completion_chunk("", "length")), (0.67, "data: [DONE]")])
    keepalive = [(sent + 0.1, ": keep-alive")] + _timed(sent, [(0.5, completion_chunk("A")), (0.9, completion_chunk("B")),
                                                               (0.95, "data: [DONE]")])
    no_text = _timed(sent, [(0.2, chat_chunk(role="assistant", content="")), (0.3, chat_chunk(finish_reason="length")),
                            (0.3, "data: [DONE]")])
    one = _timed(5.0, [(0.25, chat_chunk(role="assistant")), (1.5, chat_chunk("Yes")), (1.6, chat_chunk(finish_reason="stop")),
                       (1.6, "data: [DONE]")])
    return [(chat, sent, "a chat stream: role-only first chunk, finish chunk, usage chunk"),
            (completion, sent, "a completion stream"),
            (keepalive, sent, "a keep-alive comment before the first token"),
            (no_text, sent, "no text at all: ttft_s None, itl_s []"),
            (one, 5.0, "a single text chunk: no gaps")]


def _diagnose_stream(timed_lines, sent_s, got: dict, want: dict) -> str:
    first_line_s = next((t for t, line in timed_lines if line.startswith("data:")), None)
    text_times = [t for t, line in timed_lines for e in reference_parse_sse([line]) if chunk_text(e)]
    all_times = [t for t, line in timed_lines for _ in reference_parse_sse([line])]
    ttft = got.get("ttft_s")
    itl = got.get("itl_s")
    if got.get("text") != want["text"]:
        return ("the text is the pieces of every chunk joined: choices[0]['text'] for completions, "
                "choices[0]['delta']['content'] for chat (a missing or None content adds nothing)")
    if want["ttft_s"] is not None and _number(ttft):
        if first_line_s is not None and math.isclose(ttft, first_line_s - sent_s, abs_tol=1e-9) \
                and not math.isclose(ttft, want["ttft_s"], abs_tol=1e-9):
            return ("you timed the first chunk; a chat stream's first chunk carries only the role (no text): the first "
                    "token is the first chunk with text")
        if math.isclose(ttft, want["ttft_s"] + sent_s, abs_tol=1e-6):
            return "time to first token is measured from sent_s (when the request left): subtract it"
    if want["ttft_s"] is None and ttft is not None:
        return "no chunk carried text, so there is no first token: ttft_s is None"
    if isinstance(itl, (list, tuple)) and _number(ttft) and want["ttft_s"] is not None \
            and math.isclose(ttft, want["ttft_s"], abs_tol=1e-9):
        if len(itl) == len(want["itl_s"]) + 1 and itl and math.isclose(itl[0], want["ttft_s"], abs_tol=1e-9):
            return ("the first gap counted the wait for the first token; that wait is the TTFT, and inter-token gaps "
                    "start after the first token (n text chunks, n - 1 gaps)")
        if len(itl) > len(want["itl_s"]) and len(all_times) > len(text_times):
            return ("chunks without text (the role chunk, the finish_reason chunk, the usage chunk) are not tokens: "
                    "leave them out of the gaps")
    return "ttft_s = first text chunk's arrival - sent_s; itl_s = gaps between consecutive text chunks' arrivals"


def check_stream_metrics(stream_metrics: Callable) -> None:
    """Your stream timer vs the reference on synthetic timed streams (chat and completions)."""
    cases = _stream_cases()
    for timed_lines, sent_s, why in cases:
        call = f"stream_metrics(<{why}>, sent_s={sent_s})"
        got = _call(stream_metrics, (list(timed_lines), sent_s), call,
                    "a usage chunk has \"choices\": [] and a role chunk has no \"content\": read them defensively")
        want = reference_stream_metrics(timed_lines, sent_s)
        if not isinstance(got, dict) or not {"text", "ttft_s", "itl_s"} <= set(got):
            raise CheckFailed(f"{call} returned {got!r}; expected a dict with 'text', 'ttft_s' and 'itl_s'")
        itl = got["itl_s"]
        ok = (got["text"] == want["text"]
              and ((want["ttft_s"] is None and got["ttft_s"] is None)
                   or (want["ttft_s"] is not None and _number(got["ttft_s"])
                       and math.isclose(got["ttft_s"], want["ttft_s"], abs_tol=1e-9)))
              and isinstance(itl, (list, tuple)) and len(itl) == len(want["itl_s"])
              and all(_number(a) and math.isclose(a, b, abs_tol=1e-9) for a, b in zip(itl, want["itl_s"])))
        if not ok:
            shown = {k: (round(v, 6) if _number(v) else [round(x, 6) for x in v] if isinstance(v, list) else v)
                     for k, v in want.items()}
            raise CheckFailed(f"{call} returned {got!r}, expected {shown}: "
                              + _diagnose_stream(timed_lines, sent_s, got, want))
    passed("stream_metrics", len(cases))


# =================================================================== 3. goodput
def reference_goodput(records: Sequence[dict], slo: dict, duration_s: float) -> float:
    """Requests per second that succeeded and met every limit of `slo` (a metric of None — a one-token
    answer has no TPOT — meets its limit)."""
    unknown = set(slo) - set(SLO_KEYS)
    if unknown:
        raise ValueError(f"slo keys {sorted(unknown)} unknown; allowed: {SLO_KEYS}")
    if not duration_s > 0:
        raise ValueError(f"duration_s={duration_s!r} must be > 0")
    good = sum(1 for r in records if r["success"]
               and all(r[key] is None or r[key] <= limit for key, limit in slo.items()))
    return good / duration_s


def _record(ttft: float, tpot: float | None, e2el: float, success: bool = True, output_tokens: int = 16) -> dict:
    return {"success": success, "ttft_s": ttft, "tpot_s": tpot, "e2el_s": e2el, "output_tokens": output_tokens}


def _goodput_cases() -> list[tuple[list[dict], dict, float, str]]:
    base = [_record(0.2, 0.04, 0.8), _record(0.6, 0.03, 1.1), _record(0.3, 0.09, 1.7), _record(0.1, 0.02, 0.5)]
    failed = [_record(0.0, 0.0, 0.0, success=False, output_tokens=0)]   # vLLM's failed record: zeros
    rng = random.Random(8)
    many = [_record(rng.uniform(0.05, 2.0), rng.choice([None, rng.uniform(0.01, 0.2)]), rng.uniform(0.5, 9.0),
                    success=rng.random() > 0.15) for _ in range(60)]
    for r in many:
        if not r["success"]:
            r.update(ttft_s=0.0, tpot_s=0.0, e2el_s=0.0)
    return [
        (base, {"ttft_s": 0.5}, 2.0, "one request misses the TTFT limit"),
        (base, {"ttft_s": 0.5, "tpot_s": 0.05}, 2.0, "a request is good only if it meets every limit"),
        (base + failed, {"ttft_s": 0.5}, 2.0, "a failed request is never good, however small its (zero) numbers"),
        (base, {"ttft_s": 0.3, "tpot_s": 0.04}, 4.0, "a value equal to its limit meets it (<=)"),
        (base + [_record(0.2, None, 0.2, output_tokens=1)], {"tpot_s": 0.05}, 1.0,
         "a one-token answer has no TPOT (None): it meets a TPOT limit"),
        (base, {}, 2.0, "no limits: every successful request is good"),
        (base, {"e2el_s": 1.0}, 0.5, "goodput is a rate: good requests per second of the run"),
        ([], {"ttft_s": 1.0}, 3.0, "no requests"),
        (many, {"ttft_s": 1.0, "tpot_s": 0.1, "e2el_s": 6.0}, 12.5, "60 random requests"),
    ]


def _diagnose_goodput(records, slo, duration_s, got: float) -> str:
    want = reference_goodput(records, slo, duration_s)
    n_good = want * duration_s

    def count(pred) -> int:
        return sum(1 for r in records if pred(r))

    def meets(r, key, limit, strict=False):
        return r[key] is None or (r[key] < limit if strict else r[key] <= limit)

    with_failed = count(lambda r: all(meets(r, k, v) for k, v in slo.items())) / duration_s
    any_limit = count(lambda r: r["success"] and (not slo or any(meets(r, k, v) for k, v in slo.items()))) / duration_s
    strict = count(lambda r: r["success"] and all(meets(r, k, v, strict=True) for k, v in slo.items())) / duration_s
    if records and math.isclose(got, n_good / len(records), rel_tol=1e-9, abs_tol=1e-12) and len(records) != duration_s:
        return "goodput is good requests per second (divide by duration_s), not the fraction of requests that were good"
    if math.isclose(got, n_good, rel_tol=1e-9) and duration_s != 1:
        return "goodput is a rate: divide the good requests by duration_s"
    if with_failed != want and math.isclose(got, with_failed, rel_tol=1e-9):
        return ("a failed request (success False) is never good — its zero TTFT is not a fast answer, it is no answer")
    if any_limit != want and math.isclose(got, any_limit, rel_tol=1e-9):
        return "a request is good only if it meets every limit in slo (all, not any)"
    if strict != want and math.isclose(got, strict, rel_tol=1e-9):
        return "a value equal to its limit meets the SLO: compare with <=, not <"
    return "count the successful requests whose every named metric is <= its limit (None meets it), divide by duration_s"


def check_goodput(goodput: Callable) -> None:
    """Your goodput vs the reference on hand-made and random benchmark records."""
    cases = _goodput_cases()
    for records, slo, duration_s, why in cases:
        call = f"goodput(<{len(records)} records>, {slo}, {duration_s})"
        hint = ("a one-token answer's tpot_s is None: it meets a TPOT limit (there is no second token to be late)"
                if any(r["tpot_s"] is None for r in records) else "")
        got = _call(goodput, ([dict(r) for r in records], dict(slo), duration_s), call, hint)
        want = reference_goodput(records, slo, duration_s)
        if not _number(got) or not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
            shown = f"{got:.4g}" if _number(got) else repr(got)
            raise CheckFailed(f"{call} returned {shown}, expected {want:.4g} ({why}): "
                              + (_diagnose_goodput(records, slo, duration_s, got) if _number(got) else
                                 "return a float: good requests per second"))
    passed("goodput", len(cases))


# =================================================================== 4. USD per million tokens
def reference_cost_per_million(tokens_per_s: float, hourly_usd: float) -> float:
    """USD per million output tokens when a device rented at `hourly_usd` makes `tokens_per_s`."""
    if not tokens_per_s > 0:
        raise ValueError(f"tokens_per_s={tokens_per_s!r} must be > 0 (a device that makes no tokens has no price per token)")
    if not hourly_usd >= 0:
        raise ValueError(f"hourly_usd={hourly_usd!r} must be >= 0")
    return hourly_usd / 3600.0 / tokens_per_s * 1e6


COST_CASES = [(100 / 3, 2.50), (466.0, 2.50), (1335.0, 2.50), (25.0, 0.08), (150.0, 0.08), (1.0, 3600.0),
              (12_000.0, 4.10), (0.5, 0.0)]


def _diagnose_cost(tokens_per_s: float, hourly_usd: float, got: float) -> str:
    want = reference_cost_per_million(tokens_per_s, hourly_usd)
    if want and math.isclose(got, want * 3600, rel_tol=1e-6):
        return "the price is per hour and the rate per second: divide the hourly price by 3600"
    if want and math.isclose(got, want / 1000, rel_tol=1e-6):
        return "per million tokens: multiply the price of one token by 1e6 (not 1e3)"
    if want and math.isclose(got, want / 1e6, rel_tol=1e-6):
        return "that is the price of one token; the question is per million tokens"
    if math.isclose(got, hourly_usd / 3600 * tokens_per_s * 1e6, rel_tol=1e-6):
        return "more tokens per second must make each token cheaper: divide by tokens_per_s, do not multiply"
    return "seconds per million tokens = 1e6 / tokens_per_s; their cost = that × hourly_usd / 3600"


def check_cost_per_million(cost_per_million: Callable) -> None:
    """Your price per million tokens vs the reference, and a clear error for a rate <= 0."""
    for tokens_per_s, hourly_usd in COST_CASES:
        call = f"cost_per_million({tokens_per_s:.6g}, {hourly_usd})"
        got = _call(cost_per_million, (tokens_per_s, hourly_usd), call)
        want = reference_cost_per_million(tokens_per_s, hourly_usd)
        if not _number(got) or not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-12):
            shown = f"{got:.4g}" if _number(got) else repr(got)
            raise CheckFailed(f"{call} returned {shown}, expected {want:.4g} USD per million tokens: "
                              + (_diagnose_cost(tokens_per_s, hourly_usd, got) if _number(got) else "return a float"))
    for bad in (0, 0.0, -5.0):
        try:
            got = cost_per_million(bad, 2.5)
        except ValueError as exc:
            if str(bad) not in str(exc) and repr(bad) not in str(exc):
                raise CheckFailed(f"cost_per_million({bad}, 2.5) raised ValueError({str(exc)!r}); name the bad value "
                                  f"in the message (e.g. 'tokens_per_s={bad} must be > 0')") from exc
            continue
        except Exception as exc:  # noqa: BLE001
            raise CheckFailed(f"cost_per_million({bad}, 2.5) raised {type(exc).__name__}: {exc}; raise ValueError "
                              "naming the value (a rate of 0 tokens/s has no price per token)") from exc
        raise CheckFailed(f"cost_per_million({bad}, 2.5) returned {got!r}; raise ValueError naming the value "
                          "(tokens_per_s must be > 0)")
    passed("cost_per_million", len(COST_CASES) + 3)


# =================================================================== 5. the batch size from a floor
def reference_choose_batch_size(measurements: Sequence[dict], per_user_floor_tps: float) -> int | None:
    """The batch with the lowest USD per million tokens among those whose per-user tokens/s is >= the
    floor (the smaller batch on a tie); None when none meets it."""
    meeting = [m for m in measurements if m["per_user_tps"] >= per_user_floor_tps]
    if not meeting:
        return None
    return min(meeting, key=lambda m: (m["usd_per_mtok"], m["batch"]))["batch"]


def sweep_row(batch: int, aggregate_tps: float, per_user_tps: float, hourly_usd: float = 0.08) -> dict:
    return {"batch": batch, "aggregate_tps": aggregate_tps, "per_user_tps": per_user_tps,
            "usd_per_mtok": reference_cost_per_million(aggregate_tps, hourly_usd)}


def _choose_cases() -> list[tuple[list[dict], float, str]]:
    smooth = [sweep_row(1, 25, 25), sweep_row(2, 46, 23), sweep_row(4, 80, 20), sweep_row(8, 120, 15),
              sweep_row(16, 150, 9.4), sweep_row(32, 170, 5.3)]
    # measured on a busy machine: batch 16 made fewer tokens/s than batch 8
    bumpy = [sweep_row(1, 24, 24), sweep_row(2, 44, 22), sweep_row(4, 71, 17.8), sweep_row(8, 118, 14.7),
             sweep_row(16, 109, 13.9), sweep_row(32, 160, 5.0)]
    ties = [sweep_row(1, 30, 30), sweep_row(4, 100, 25), sweep_row(8, 100, 12.5)]
    shuffled = [smooth[4], smooth[0], smooth[5], smooth[2], smooth[1], smooth[3]]
    return [
        (smooth, 10.0, "the floor allows batch 8, not 16"),
        (smooth, 15.0, "a per-user speed equal to the floor meets it"),
        (smooth, 30.0, "no batch is that fast: None"),
        (smooth, 0.0, "no floor: the cheapest batch"),
        (bumpy, 13.0, "batch 16 meets the floor but costs more per token than batch 8"),
        (ties, 10.0, "batches 4 and 8 cost the same: the smaller serves each user faster"),
        (shuffled, 9.0, "measurements in any order"),
        ([], 5.0, "no measurements"),
    ]


def _diagnose_choose(measurements, floor, got) -> str:
    def largest_meeting():
        meeting = [m["batch"] for m in measurements if m["per_user_tps"] >= floor]
        return max(meeting) if meeting else None

    cheapest_any = min(measurements, key=lambda m: (m["usd_per_mtok"], m["batch"]))["batch"] if measurements else None
    strict = [m for m in measurements if m["per_user_tps"] > floor]
    strict_choice = min(strict, key=lambda m: (m["usd_per_mtok"], m["batch"]))["batch"] if strict else None
    meeting = [m for m in measurements if m["per_user_tps"] >= floor]
    tie_larger = min(meeting, key=lambda m: (m["usd_per_mtok"], -m["batch"]))["batch"] if meeting else None
    want = reference_choose_batch_size(measurements, floor)
    if isinstance(got, dict):
        return "return the batch size (an int), not its measurement"
    cost = {m["batch"]: m["usd_per_mtok"] for m in meeting}
    if want is not None and got in cost and got != want and cost[got] == cost[want]:
        return "on a tie in cost, take the smaller batch: the same price, and each user's text arrives faster"
    if got == largest_meeting() and got != want:
        return ("the largest batch that meets the floor is not always the cheapest: measured throughput need not grow "
                "with the batch; take the lowest usd_per_mtok among the batches that meet the floor")
    if got == cheapest_any and got != want:
        return "the cheapest batch overall breaks the promise: only batches whose per_user_tps >= the floor qualify"
    if got == strict_choice and got != want:
        return "a batch whose per-user speed equals the floor meets it: compare with >=, not >"
    if got == tie_larger and got != want:
        return "on a tie in cost, take the smaller batch: the same price, and each user's text arrives faster"
    if want is None:
        return "no batch meets the floor: return None (and say so to whoever asked)"
    return "filter per_user_tps >= floor, then the lowest usd_per_mtok (the smaller batch on a tie)"


def check_choose_batch_size(choose_batch_size: Callable) -> None:
    """Your choice vs the reference on smooth, bumpy, tied, shuffled and empty sweeps."""
    cases = _choose_cases()
    for measurements, floor, why in cases:
        call = f"choose_batch_size(<batches {[m['batch'] for m in measurements]}>, {floor})"
        got = _call(choose_batch_size, ([dict(m) for m in measurements], floor), call)
        want = reference_choose_batch_size(measurements, floor)
        if got != want or isinstance(got, bool):
            table = ", ".join(f"b={m['batch']}: {m['per_user_tps']:.1f} tok/s/user, ${m['usd_per_mtok']:.2f}/Mtok"
                              for m in measurements)
            raise CheckFailed(f"{call} returned {got!r}, expected {want!r} ({why}; {table or 'empty'}): "
                              + _diagnose_choose(measurements, floor, got))
    passed("choose_batch_size", len(cases))


# =================================================================== the server, raw
def stream_raw(base_url: str, payload: dict, timeout_s: float = 600.0) -> tuple[float, list[tuple[float, str]]]:
    """POST `payload` with stream=true to /chat/completions (it has "messages") or /completions, and
    return (sent_s, [(arrival_s, line), ...]): every raw line of the response with the
    time.perf_counter() at which it arrived — what a load generator times."""
    import httpx

    endpoint = "/chat/completions" if "messages" in payload else "/completions"
    url = base_url.rstrip("/") + endpoint
    lines: list[tuple[float, str]] = []
    with httpx.Client(timeout=timeout_s) as client:
        sent_s = time.perf_counter()
        with client.stream("POST", url, json={**payload, "stream": True}) as response:
            if response.status_code != 200:
                raise RuntimeError(f"POST {url} answered HTTP {response.status_code}: {response.read().decode()[:300]}")
            for line in response.iter_lines():
                lines.append((time.perf_counter(), line))
    return sent_s, lines


def openai_client(handle):
    """An openai.OpenAI client on the server (the key is not checked; the client insists on one)."""
    import openai

    return openai.OpenAI(base_url=handle.base_url, api_key="none")


def print_stream(run: dict, num_lines: int = 6) -> None:
    lines = [line for _, line in run["lines"]]
    print(f"{len(lines)} raw lines; the first {num_lines}:")
    for line in lines[:num_lines]:
        print("  " + (line if len(line) < 150 else line[:147] + "..."))
    mine = run["mine"]
    if isinstance(mine, dict) and _number(mine.get("ttft_s")):
        gaps = mine.get("itl_s") or []
        mean_itl = f"{statistics.fmean(gaps) * 1e3:.1f} ms" if gaps else "n/a"
        print(f"your stream_metrics: TTFT {mine['ttft_s'] * 1e3:.1f} ms, {len(gaps)} inter-token gaps, mean ITL {mean_itl}")
        print(f"  text:        {mine.get('text')!r}")
    print(f"  openai text: {run['openai_text']!r}")


def check_stream(run: dict) -> None:
    """Your stream_metrics on the server's real stream (the notebook's run_stream): the openai client's
    text, the reference timings of the same raw lines."""
    if not isinstance(run, dict) or "mine" not in run:
        raise CheckFailed(f"stream_run is {run!r}: run the cell that calls run_stream (it needs parse_sse and "
                          "stream_metrics, exercises 1 and 2)")
    mine, want = run["mine"], reference_stream_metrics(run["lines"], run["sent_s"])
    if not isinstance(mine, dict) or not {"text", "ttft_s", "itl_s"} <= set(mine):
        raise CheckFailed(f"stream_metrics returned {mine!r}; expected a dict with 'text', 'ttft_s' and 'itl_s'")
    if mine["text"] != run["openai_text"]:
        raise CheckFailed(f"your text {mine['text']!r} is not the openai client's {run['openai_text']!r} for the same "
                          "greedy request: join the content of every chunk (chat: choices[0]['delta']['content'])")
    if not (_number(mine["ttft_s"]) and math.isclose(mine["ttft_s"], want["ttft_s"], abs_tol=1e-9)):
        raise CheckFailed(f"ttft_s = {mine['ttft_s']!r}; the first chunk with text arrived {want['ttft_s']:.4f} s after "
                          "the request was sent (the role-only chunk before it is not a token)")
    if len(mine["itl_s"]) != len(want["itl_s"]) or not all(
            math.isclose(a, b, abs_tol=1e-9) for a, b in zip(mine["itl_s"], want["itl_s"])):
        raise CheckFailed(f"{len(mine['itl_s'])} inter-token gaps; the stream had {len(want['itl_s']) + 1} chunks with "
                          f"text, so {len(want['itl_s'])} gaps between them")
    if not want["ttft_s"] > 0:
        raise CheckFailed("the first token arrived before the request was sent: time with time.perf_counter()")
    passed("your stream timer on the server's stream", 1 + len(want["itl_s"]))


def stream_figure(run: dict, device: str):
    """When each chunk arrived, from the moment the request left: TTFT, then the inter-token gaps."""
    sent = run["sent_s"]
    text_t, text_label, other_t, other_label = [], [], [], []
    for t, line in run["lines"]:
        for event in reference_parse_sse([line]):
            piece = chunk_text(event)
            (text_t if piece else other_t).append((t - sent) * 1e3)
            (text_label if piece else other_label).append(repr(piece) if piece else
                                                          ("usage" if not event.get("choices") else "role / finish"))
    fig = new_figure("One streamed answer, chunk by chunk", "ms since the request was sent", "", device=device, height=300)
    fig.add_scatter(x=text_t, y=[1] * len(text_t), mode="markers+text", text=text_label, textposition="top center",
                    name="chunk with text (a token)", marker=dict(size=10))
    fig.add_scatter(x=other_t, y=[0.6] * len(other_t), mode="markers", text=other_label, name="chunk without text",
                    marker=dict(size=8, symbol="x"))
    if text_t:
        fig.add_vrect(x0=0, x1=text_t[0], fillcolor="orange", opacity=0.15, line_width=0,
                      annotation_text=f"TTFT {text_t[0]:.0f} ms", annotation_position="top left")
    fig.update_yaxes(visible=False, range=[0, 1.6])
    return fig


# =================================================================== the load generator
def chat_dataset(num_records: int = 64, output_tokens: int | None = None) -> list[dict]:
    """Short questions from data/prompts.txt as run_benchmark records (their answers are the long part)."""
    from ..bench.workloads import shipped_prompts

    prompts = shipped_prompts()
    return [{"prompt": prompts[i % len(prompts)], **({"output_tokens": output_tokens} if output_tokens else {})}
            for i in range(num_records)]


def records(result) -> list[dict]:
    """A ServeBenchResult's per-request records as plain dicts: success, ttft_s, tpot_s, e2el_s,
    output_tokens, start_s (seconds; a failed request's times are 0.0, as in vLLM)."""
    out = []
    for r in result.records:
        ok = bool(r.success)
        out.append({"success": ok, "ttft_s": r.ttft_s if ok else 0.0, "tpot_s": r.tpot_s if ok else 0.0,
                    "e2el_s": r.e2el_s if ok else 0.0, "output_tokens": r.output_tokens, "start_s": r.start_s})
    return out


def slo_ms(slo: dict) -> dict:
    """{"ttft_s": 0.5} -> {"ttft": 500.0}: the same SLOs in run_benchmark's goodput= form (milliseconds)."""
    unknown = set(slo) - set(SLO_KEYS)
    if unknown:
        raise ValueError(f"slo keys {sorted(unknown)} unknown; allowed: {SLO_KEYS}")
    return {key[:-2]: value * 1e3 for key, value in slo.items()}


def check_goodput_on(goodput: Callable, result, slo: dict) -> None:
    """Your goodput on the benchmark's records equals the load generator's own (same SLOs)."""
    got = _call(goodput, (records(result), dict(slo), result.duration_s), f"goodput(records(bench), {slo}, ...)")
    num_good = sum(r.meets(slo_ms(slo)) for r in result.records)   # the load generator's own verdicts
    want = num_good / result.duration_s
    if not _number(got) or not math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9):
        raise CheckFailed(f"your goodput on the benchmark's {len(result.records)} records with {slo} is {got!r} req/s; "
                          f"the load generator counts {num_good} good requests in {result.duration_s:.2f} s = "
                          f"{want:.4g} req/s")
    passed("goodput on the measured records", len(result.records))


def requests_figure(result, device: str, slo: dict | None = None):
    """Each request as a bar: sent -> first token (waiting: queue + prefill), first token -> last (decoding)."""
    recs = sorted(records(result), key=lambda r: r["start_s"])
    ok = [r for r in recs if r["success"]]
    fig = new_figure(f"{len(recs)} requests through the server", "seconds since the benchmark started", "request",
                     device=device, height=max(300, 18 * len(recs) + 120))
    y = list(range(len(ok)))
    fig.add_bar(y=y, x=[r["ttft_s"] for r in ok], base=[r["start_s"] for r in ok], orientation="h",
                name="waiting for the first token (TTFT)", marker_color="orange")
    fig.add_bar(y=y, x=[r["e2el_s"] - r["ttft_s"] for r in ok], base=[r["start_s"] + r["ttft_s"] for r in ok],
                orientation="h", name="streaming the answer", marker_color="steelblue")
    fig.update_layout(barmode="overlay")
    fig.update_yaxes(autorange="reversed")
    return fig


def scrape_metrics(url: str) -> dict[str, float]:
    """GET /metrics and read the Prometheus text: {'name{labels}': value} (no HELP / TYPE lines)."""
    import httpx

    text = httpx.get(url.rstrip("/") + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            values[name] = float(value)
        except ValueError:
            continue
    return values


def print_metrics(url: str, prefixes: Sequence[str] = ("num_requests", "kv_", "prefix_cache_hit_rate", "prompt_tokens",
                                                        "generation_tokens", "time_to_first_token_seconds_count",
                                                        "time_to_first_token_seconds_sum")) -> dict[str, float]:
    """The lines of /metrics an operator watches first."""
    values = scrape_metrics(url)
    for name, value in values.items():
        short = name.split("{")[0].removeprefix("minillm_")
        if any(short.startswith(p) for p in prefixes):
            print(f"  {short:42} {value:g}")
    return values


# =================================================================== the batch-size sweep
def serve_batch_sweep(llm, batch_sizes: Sequence[int], rounds: int = 2, max_tokens: int = 16,
                      dataset: list[dict] | None = None) -> list[dict]:
    """For each batch size b: a server on llm.with_levers(max_num_seqs=b) (same weights), and the load
    generator keeping b requests in flight for rounds × b requests of max_tokens tokens each (EOS ignored).
    One row per batch size, raw: {"batch", "records" (records(result): one dict per request), "duration_s"
    (the run's wall time, first request sent -> last answer done), "ttft_p50_s", "ttft_p99_s"}. The
    speeds (aggregate and per-user tokens/s) are the learner's measurement (measure_batch_sweep)."""
    from tqdm.auto import tqdm

    from ..bench.serve import run_benchmark
    from ..serve import serve_in_thread

    for b in batch_sizes:
        if not (isinstance(b, int) and b >= 1):
            raise ValueError(f"batch size {b!r} must be an integer >= 1")
    dataset = dataset or chat_dataset()
    rows = []
    for b in tqdm(list(batch_sizes), desc="batch sizes through the server"):
        engine = llm.with_levers(max_num_seqs=b)
        with serve_in_thread(engine) as handle:
            # first-call costs (allocator, new shapes) out of the timings
            run_benchmark(handle.base_url, endpoint="/v1/chat/completions", num_prompts=b, max_concurrency=b,
                          max_tokens=2, dataset=dataset, progress=False)
            res = run_benchmark(handle.base_url, endpoint="/v1/chat/completions", num_prompts=b * rounds,
                                max_concurrency=b, max_tokens=max_tokens, dataset=dataset, seed=b, progress=False)
        if res.failed:
            raise RuntimeError(f"batch {b}: {res.failed} requests failed: {res.errors}")
        rows.append({"batch": b, "records": records(res), "duration_s": res.duration_s,
                     "ttft_p50_s": res.metrics["ttft"]["median_ms"] / 1e3,
                     "ttft_p99_s": res.metrics["ttft"].get("p99_ms", float("nan")) / 1e3})
        del engine
    return rows


def print_sweep_records(rows: Sequence[dict]) -> None:
    """What the sweep measured, before any speed is computed: per batch size, its requests and their times."""
    print(f"{'batch':>5} {'requests':>9} {'duration_s':>11} {'output tokens':>14}  first request's ttft_s / tpot_s / e2el_s")
    for r in rows:
        recs = r["records"]
        first = recs[0] if recs else None
        shown = (f"{first['ttft_s']:.3f} / {first['tpot_s']:.4f} / {first['e2el_s']:.3f}"
                 if first and _number(first.get("tpot_s")) else "—")
        print(f"{r['batch']:>5} {len(recs):>9} {r['duration_s']:>11.3f} "
              f"{sum(x['output_tokens'] for x in recs if x['success']):>14}  {shown}")


# =================================================================== the learner's measurement: two speeds per batch
def reference_sweep_speeds(row: dict) -> tuple[float, float]:
    """(aggregate_tps, per_user_tps) of one sweep row: the output tokens of the successful requests / the
    run's duration_s, and 1 / the mean TPOT of the successful requests that have one (tpot_s not None)."""
    ok = [r for r in row["records"] if r["success"]]
    tpots = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    aggregate = sum(r["output_tokens"] for r in ok) / row["duration_s"]
    per_user = 1.0 / statistics.fmean(tpots) if tpots else float("nan")
    return aggregate, per_user


def _diagnose_aggregate(row: dict, got: float, per_user_got) -> str:
    ok = [r for r in row["records"] if r["success"]]
    tokens = sum(r["output_tokens"] for r in ok)
    want, _ = reference_sweep_speeds(row)
    guesses = [
        (row["duration_s"] / tokens if tokens else None,
         "tokens per second is tokens / duration_s, not duration_s / tokens"),
        (tokens / sum(r["e2el_s"] for r in ok) if ok else None,
         ("divide by the run's duration_s (its wall time: the requests overlap), not by the sum of the requests' "
          "e2el_s — that sum counts the same second once per request in flight")),
        (per_user_got * row["batch"] if _number(per_user_got) else None,
         ("per_user_tps × batch assumes every user streamed at full speed the whole run; measure it: all output "
          "tokens / duration_s")),
        (tokens / row["duration_s"] / row["batch"],
         "that is per batch slot; aggregate tokens/s is all the output tokens / duration_s"),
        (statistics.fmean(r["output_tokens"] / r["e2el_s"] for r in ok) if ok else None,
         "that is one request's speed; aggregate tokens/s is all the output tokens / duration_s"),
    ]
    for value, why in guesses:
        if value is not None and not math.isclose(value, want, rel_tol=1e-9) and math.isclose(got, value, rel_tol=1e-6):
            return why
    return "aggregate_tps = sum of the successful requests' output_tokens / the row's duration_s"


def _diagnose_per_user(row: dict, got: float) -> str:
    ok = [r for r in row["records"] if r["success"]]
    tpots = [r["tpot_s"] for r in ok if r["tpot_s"] is not None]
    _, want = reference_sweep_speeds(row)
    guesses = [
        (statistics.fmean(1 / t for t in tpots) if tpots else None,
         "per-user tokens/s is 1 / (the mean TPOT), as the benchmark reports it, not the mean of the 1 / TPOT values"),
        (statistics.fmean(r["output_tokens"] / r["e2el_s"] for r in ok) if ok else None,
         ("output_tokens / e2el_s counts the wait for the first token; the reading speed is 1 / TPOT (tpot_s leaves "
          "the TTFT out)")),
        (statistics.fmean(tpots) if tpots else None, "that is the mean TPOT in seconds per token; take 1 / it"),
        (1 / statistics.median(tpots) if tpots else None, "1 / the mean TPOT, not 1 / the median"),
    ]
    for value, why in guesses:
        if value is not None and not math.isclose(value, want, rel_tol=1e-9) and math.isclose(got, value, rel_tol=1e-6):
            return why
    return "per_user_tps = 1 / the mean of the successful requests' tpot_s (leave out a tpot_s of None)"


def check_measure_batch_sweep(sweep, speeds=None) -> None:
    """Your two speeds per sweep row, recomputed from the row's own records and duration_s. ``speeds``: your
    speeds, one dict per row of ``sweep`` in order (sweep_speeds, what the graded test reads beside the grader's
    own sweep); None: the rows' own keys."""
    if not isinstance(sweep, (list, tuple)) or not sweep:
        raise CheckFailed(f"sweep is {sweep!r}: run the sweep cell of section 6 first")
    if speeds is None:
        speeds = sweep
    if not isinstance(speeds, (list, tuple)) or len(speeds) != len(sweep) or not all(isinstance(s, dict) for s in speeds):
        raise CheckFailed(f"sweep_speeds is {repr(speeds)[:200]}: one dict per row of sweep, in order (the line under "
                          "your code makes it from the rows you set)")
    for row, mine in zip(sweep, speeds):
        where = f"batch {row.get('batch')!r}"
        missing = [key for key in ("aggregate_tps", "per_user_tps") if mine.get(key) is None]
        if missing:
            raise CheckFailed(f"{where}: the row has no {missing}: set row['aggregate_tps'] and row['per_user_tps'] "
                              "for every row of sweep")
        want_agg, want_user = reference_sweep_speeds(row)
        agg, user = mine["aggregate_tps"], mine["per_user_tps"]
        if not _number(agg) or not math.isclose(agg, want_agg, rel_tol=1e-6):
            shown = f"{agg:.4g}" if _number(agg) else repr(agg)
            raise CheckFailed(f"{where}: aggregate_tps = {shown}, expected {want_agg:.4g} tokens/s from its "
                              f"{len(row['records'])} records and duration_s = {row['duration_s']:.4g}: "
                              + (_diagnose_aggregate(row, agg, user) if _number(agg) else "a number"))
        if not _number(user) or not math.isclose(user, want_user, rel_tol=1e-6):
            shown = f"{user:.4g}" if _number(user) else repr(user)
            raise CheckFailed(f"{where}: per_user_tps = {shown}, expected {want_user:.4g} tokens/s from its "
                              f"{len(row['records'])} records: "
                              + (_diagnose_per_user(row, user) if _number(user) else "a number"))
    passed("your aggregate and per-user tokens/s", len(sweep))


def print_batch_sweep(rows: Sequence[dict], device: str) -> None:
    print(f"measured on {device}, through the server (HTTP, streaming, chat template)")
    print(f"{'batch':>5} {'aggregate tok/s':>16} {'per-user tok/s':>15} {'TTFT p50':>9} {'$/Mtok':>9}")
    for r in rows:
        cost = f"{r['usd_per_mtok']:.3f}" if _number(r.get("usd_per_mtok")) else "—"
        print(f"{r['batch']:>5} {r['aggregate_tps']:>16.1f} {r['per_user_tps']:>15.1f} {r['ttft_p50_s'] * 1e3:>7.0f}ms "
              f"{cost:>9}")


def batch_figure(rows: Sequence[dict], device: str, floor_tps: float | None = None, chosen: int | None = None):
    """Aggregate and per-user tokens/s against the batch size; the floor as a line, the chosen batch starred."""
    sizes = [r["batch"] for r in rows]
    fig = new_figure("Batch size: what the operator gets vs what each user gets", "batch size (max_num_seqs)",
                     "tokens / s", device=device)
    fig.add_scatter(x=sizes, y=[r["aggregate_tps"] for r in rows], mode="lines+markers", name="aggregate tokens/s")
    fig.add_scatter(x=sizes, y=[r["per_user_tps"] for r in rows], mode="lines+markers",
                    name="per-user tokens/s (1 / TPOT)")
    fig.add_scatter(x=[min(sizes), max(sizes)], y=[floor_tps, floor_tps] if floor_tps is not None else [None, None],
                    mode="lines", name="per-user floor", line=dict(dash="dash", color="gray"))
    star = [r for r in rows if r["batch"] == chosen]
    fig.add_scatter(x=[r["batch"] for r in star], y=[r["aggregate_tps"] for r in star], mode="markers",
                    name="chosen batch", marker=dict(size=16, symbol="star", color="black"))
    fig.update_xaxes(type="log", tickvals=sizes, ticktext=[str(s) for s in sizes])
    return fig


class FloorExplorer:
    """Slider: a per-user floor -> your choose_batch_size's batch, its cost and its throughput."""

    def __init__(self, rows: Sequence[dict], choose: Callable, device: str, floor: float):
        import ipywidgets as widgets

        self.rows, self.choose = [dict(r) for r in rows], choose
        top = max(r["per_user_tps"] for r in self.rows)
        self.slider = widgets.FloatSlider(value=round(floor, 1), min=0.0, max=round(top * 1.2, 1),
                                          step=max(round(top / 100, 1), 0.1), description="floor tok/s per user",
                                          continuous_update=False, style={"description_width": "initial"})
        control_panel(self, [self.slider], batch_figure(self.rows, device, floor))

    def update(self) -> None:
        floor = self.slider.value
        try:
            chosen = self.choose([dict(r) for r in self.rows], floor)
        except NotImplementedError:
            self.label.value = "<b>finish exercise 5 (choose_batch_size) first</b>"
            return
        self.chosen = chosen
        row = next((r for r in self.rows if r["batch"] == chosen), None)
        with self.figure.batch_update():
            self.figure.data[2].y = [floor, floor]
            self.figure.data[3].x = [chosen] if row else []
            self.figure.data[3].y = [row["aggregate_tps"]] if row else []
        if row is None:
            self.label.value = f"floor {floor:.1f} tok/s per user: <b>no measured batch is that fast</b> — promise less"
        else:
            self.label.value = (f"floor {floor:.1f} tok/s per user: <b>batch {chosen}</b> ({row['per_user_tps']:.1f} "
                                f"tok/s each), {row['aggregate_tps']:.1f} tok/s in all, "
                                f"<b>${row['usd_per_mtok']:.3f} per million tokens</b>")

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


# =================================================================== the cost ladder
def print_ladder(ladder: Sequence[dict], device: str) -> None:
    print(f"{'':32}{'here: ' + device:^40}  {'the sources: H100 at 2.50 $/h':^30}")
    print(f"{'stage':32}{'tok/s':>9}{'x naive':>9}{'x prev':>8}{'$/Mtok':>11}   {'tok/s':>8}{'x naive':>9}{'$/Mtok':>9}")
    for r in ladder:
        h100 = (f"{r['h100_tokens_per_s']:>8.1f}{r['h100_gain_vs_naive']:>8.1f}x{r['h100_usd_per_mtok']:>9.2f}"
                if r["h100_tokens_per_s"] else "")
        print(f"{r['stage'][:31]:32}{r['tokens_per_s']:>9.1f}{r['gain_vs_naive']:>8.2f}x{r['gain_vs_previous']:>7.2f}x"
              f"{r['usd_per_mtok']:>11.4f}   {h100}")
    best = min(ladder, key=lambda r: r["usd_per_mtok"])
    print(f"cheapest here: '{best['stage']}', {ladder[0]['usd_per_mtok'] / best['usd_per_mtok']:.1f}x cheaper than "
          f"naive (the H100 ladder: {SOURCE_USD_PER_MTOK[0] / SOURCE_USD_PER_MTOK[-1]:.0f}x)")


def ladder_figure(ladder: Sequence[dict], device: str):
    """Tokens/s gained over the naive engine at each rung, here and on the sources' H100; $/Mtok on the bars."""
    stages = [r["stage"] for r in ladder]
    fig = new_figure("The cost ladder: gain over the naive engine at each rung", "", "x naive tokens/s (log)",
                     device=device, log_y=True)
    fig.add_bar(x=stages, y=[r["gain_vs_naive"] for r in ladder], name=f"here ({device})",
                text=[f"${r['usd_per_mtok']:.3g}/Mtok" for r in ladder], textposition="outside")
    h100 = [r for r in ladder if r["h100_gain_vs_naive"]]
    fig.add_bar(x=[r["stage"] for r in h100], y=[r["h100_gain_vs_naive"] for r in h100], name="the sources' H100",
                text=[f"${r['h100_usd_per_mtok']:.2f}/Mtok" for r in h100], textposition="outside")
    fig.update_layout(barmode="group")
    return fig


# =================================================================== the checked answer: which lever bought the most
# The ladder's rungs after naive, each named by the one word the learner answers with.
LEVER_OF_STAGE = (("batching", "batching"), ("weights", "quantization"), ("speculative", "speculation"))
LADDER_LEVERS = tuple(lever for _, lever in LEVER_OF_STAGE)


def _lever(stage: str) -> str | None:
    return next((lever for key, lever in LEVER_OF_STAGE if key in stage), None)


def check_answer_best_lever(answer, ladder) -> None:
    """answer_best_lever: the lever whose own step of the ladder (x prev: its rung's tokens/s over the rung
    above) was the largest on this machine, read from the learner's ladder."""
    if not isinstance(ladder, (list, tuple)) or len(ladder) < 2:
        raise CheckFailed(f"ladder is {ladder!r}: run the cost ladder cell of section 7 first (it needs cost_per_million)")
    steps = {_lever(r["stage"]): r for r in ladder[1:] if _lever(r["stage"])}
    if not isinstance(answer, str) or answer.strip().lower() not in steps:
        raise CheckFailed(f"answer_best_lever = {answer!r}: answer with one word of {sorted(steps)}")
    chosen = steps[answer.strip().lower()]
    best = max(r["gain_vs_previous"] for r in steps.values())
    table = ", ".join(f"{lever} {r['gain_vs_previous']:.2f}x" for lever, r in steps.items())
    if math.isclose(chosen["gain_vs_previous"], best, rel_tol=1e-9):
        passed("answer_best_lever", 1)
        return
    cheapest = min(ladder, key=lambda r: r["usd_per_mtok"])
    if chosen is cheapest:
        why = (f"'{chosen['stage']}' is the cheapest rung, but the ladder stacks the levers: its price holds every "
               "lever above it too. Which single lever bought the most is its own step, the x prev column")
    elif chosen["gain_vs_previous"] < 1:
        why = f"on your ladder {answer.strip()} made tokens/s slower than the rung above (x prev < 1): it bought nothing"
    else:
        why = "read the x prev column: each lever's own step is its rung's tokens/s over the rung above"
    raise CheckFailed(f"answer_best_lever = {answer!r}: {why} (your ladder's steps: {table})")


def greedy(max_tokens: int):
    """SamplingParams for a short greedy answer."""
    from ..sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0)


__all__ = ["CheckFailed", "SOURCE_STACK", "SOURCE_HOURLY_USD", "SOURCE_USD_PER_MTOK", "SLO_KEYS",
           "check_parse_sse", "check_stream_metrics", "check_goodput", "check_cost_per_million",
           "check_choose_batch_size", "chunk_text", "completion_chunk", "chat_chunk", "usage_chunk", "stream_raw",
           "openai_client", "print_stream", "check_stream", "stream_figure", "chat_dataset", "records",
           "slo_ms", "check_goodput_on", "requests_figure", "scrape_metrics", "print_metrics", "serve_batch_sweep",
           "print_batch_sweep", "batch_figure", "FloorExplorer", "print_ladder", "ladder_figure",
           "greedy", "echo_prediction", "check_parse_sse_edges", "print_sweep_records", "reference_sweep_speeds",
           "check_measure_batch_sweep", "LADDER_LEVERS", "check_answer_best_lever"]


# =================================================================== head-of-line blocking: chunked prefill off and on
# The course's reference run of the notebook's measure_head_of_line (full mode: HOL_LONG_TOKENS = 1000,
# HOL_CHUNK_TOKENS = 128, warmup 1, repeats 3), recorded on the machine named here (shared with other jobs at the
# time: the absolute times are slow, the ratio is the number to compare) with
#   MINILLM_QUICK=0 python: the notebook's cells "measure_head_of_line" and "cell-hol-run" on LLM() (default model)
# -> off: median 38.1 s (34.2 - 40.4), on: median 5.14 s (4.57 - 7.01) for the short request's TTFT.
REFERENCE_HOL = {"off_s": 38.09, "on_s": 5.14, "ratio": 7.40, "long_tokens": 1000, "chunk_tokens": 128,
                 "hardware": "2-core AMD EPYC (AVX2)"}
HOL_NAMES = ("off", "on")


class HeadOfLine:
    """One server's two requests, over HTTP: ``send_long()`` posts a fresh long prompt (its own token ids each time,
    so no prefix cache shares it) in a background thread and returns once the engine has admitted it and
    ``delay_s`` more have passed (inside its prefill); ``short()`` posts the short request (one output token: its
    latency is its TTFT) and returns when its answer is back; ``wait_long()`` waits for the long one."""

    __sandbox_methods__ = ("send_long", "short", "wait_long")   # what the learner's code may call (grading/remote.py)

    def __init__(self, url: str, engine, long_tokens: int, short_prompt: Sequence[int] = (21, 22, 23, 24),
                 delay_s: float = 0.2, timeout_s: float = 600.0):
        if long_tokens < 16:
            raise ValueError(f"long_tokens={long_tokens}: a long prompt needs at least 16 tokens")
        self.url, self.engine, self.long_tokens = url, engine, long_tokens
        self.short_prompt, self.delay_s, self.timeout_s = list(short_prompt), delay_s, timeout_s
        self.rounds = 0
        self._long = None

    def _post(self, body: dict) -> dict:
        import httpx

        response = httpx.post(self.url + "/v1/completions", json=body, timeout=self.timeout_s)
        response.raise_for_status()
        return response.json()

    def send_long(self) -> None:
        import threading

        if self._long is not None:
            raise RuntimeError("send_long() twice: wait_long() for the previous long request first")
        salt = self.rounds = self.rounds + 1
        ids = [(i * 7919 + salt * 104729) % 40000 + 100 for i in range(self.long_tokens)]
        box = {}
        thread = threading.Thread(target=lambda: box.update(out=self._post({"prompt": ids, "max_tokens": 1})),
                                  daemon=True)
        thread.start()
        self._long = (thread, box)
        scheduler = getattr(getattr(self.engine, "engine", self.engine), "scheduler")
        deadline = time.perf_counter() + 60
        while not scheduler.running and thread.is_alive() and time.perf_counter() < deadline:
            time.sleep(0.01)
        time.sleep(self.delay_s)

    def short(self) -> dict:
        return self._post({"prompt": self.short_prompt, "max_tokens": 1, "ignore_eos": True})

    def wait_long(self) -> None:
        if self._long is None:
            raise RuntimeError("wait_long() without send_long()")
        thread, box = self._long
        thread.join(self.timeout_s)
        self._long = None
        if "out" not in box:
            raise RuntimeError("the long request did not come back")


class FakeHeadOfLine:
    """What the check hands your harness instead of a server: short() moves the FakeClock by the next scripted TTFT;
    send_long() and wait_long() move it too (they are not the short request's latency: keep them outside your
    timed span)."""

    __sandbox_methods__ = ("send_long", "short", "wait_long")

    def __init__(self, clock, costs: Sequence[float], long_s: float = 7.0):
        self.clock, self.costs, self.long_s = clock, list(costs), long_s
        self.shorts = self.longs = self.waits = 0
        self.pending = False

    def send_long(self) -> None:
        if self.pending:
            raise CheckFailed("send_long() twice in a row: wait_long() for the previous long request first")
        self.pending = True
        self.longs += 1
        self.clock.advance(0.2 * self.long_s)

    def short(self) -> dict:
        if not self.pending:
            raise CheckFailed("short() with no long request in front of it: call send_long() first in every round")
        if self.shorts >= len(self.costs):
            raise CheckFailed(f"short() called {self.shorts + 1} times: warmup + repeats = {len(self.costs)}")
        self.clock.advance(self.costs[self.shorts])
        self.shorts += 1
        return {"choices": [{"text": "x"}]}

    def wait_long(self) -> None:
        if not self.pending:
            raise CheckFailed("wait_long() without send_long()")
        self.pending = False
        self.waits += 1
        self.clock.advance(0.8 * self.long_s)


def check_measure_head_of_line(measure_head_of_line: Callable, warmup: int = 1, repeats: int = 5, seed: int = 0) -> None:
    """Your harness on two fake servers and a FakeClock: per server, every round sends the long request, times the
    short one alone, waits for the long one; warm-up rounds dropped; the median (min, max, n) of the short request's
    TTFT; the ratio off / on. Real times are never compared."""
    from .common import FakeClock, scripted_costs, timing_mistake, timing_summary

    base = {"off": 6.0, "on": 0.5}
    costs = {name: scripted_costs(base[name], warmup, repeats, seed + i) for i, name in enumerate(HOL_NAMES)}
    clock = FakeClock()
    servers = {name: FakeHeadOfLine(clock, costs[name]) for name in HOL_NAMES}
    call = f"measure_head_of_line(two fake servers, clock=FakeClock(), warmup={warmup}, repeats={repeats})"
    got = call_learner(lambda: measure_head_of_line(servers, clock=clock, warmup=warmup, repeats=repeats), (), call)
    if clock.reads == 0:
        raise CheckFailed(f"{call}: the FakeClock was never read: time with the `clock` argument, not "
                          "time.perf_counter() directly")
    for name, server in servers.items():
        if server.shorts != warmup + repeats or server.longs != warmup + repeats or server.waits != warmup + repeats:
            raise CheckFailed(f"{call}: server {name!r} saw {server.longs} send_long, {server.shorts} short and "
                              f"{server.waits} wait_long calls; each of warmup + repeats = {warmup + repeats} rounds "
                              "makes one of each")
    if not isinstance(got, dict) or any(k not in got for k in (*HOL_NAMES, "ratio")):
        raise CheckFailed(f"{call} returned {got!r:.120}; expected a dict with 'off', 'on' (each "
                          "{'median', 'min', 'max', 'n'}) and 'ratio'")
    for name in HOL_NAMES:
        want, row = timing_summary(costs[name][warmup:]), got[name]
        if not isinstance(row, dict) or any(k not in row for k in ("median", "min", "max", "n")):
            raise CheckFailed(f"{call}[{name!r}] = {row!r:.100}: a dict with median, min, max and n")
        value = float(row["median"])
        if not math.isclose(value, want["median"], rel_tol=1e-6):
            why = timing_mistake(value, costs[name], warmup)
            long_s = servers[name].long_s
            if not why and any(math.isclose(value, want["median"] + extra, rel_tol=1e-6)
                               for extra in (0.2 * long_s, 0.8 * long_s, long_s)):
                why = "the short request's time plus the long one's: start the clock after send_long(), stop it after short()"
            raise CheckFailed(f"{call}[{name!r}]['median'] = {value:.4g} s, expected {want['median']:.4g} s"
                              + (f": that is {why}" if why else ""))
        for key in ("min", "max"):
            if not math.isclose(float(row[key]), want[key], rel_tol=1e-6):
                raise CheckFailed(f"{call}[{name!r}][{key!r}] = {float(row[key]):.4g}, expected {want[key]:.4g}: the "
                                  f"spread is the {key} of the timed rounds (warm-up dropped)")
        if int(row["n"]) != repeats:
            raise CheckFailed(f"{call}[{name!r}]['n'] = {row['n']}: the number of timed rounds, {repeats}")
    ratio = timing_summary(costs["off"][warmup:])["median"] / timing_summary(costs["on"][warmup:])["median"]
    if not math.isclose(float(got["ratio"]), ratio, rel_tol=1e-6):
        hint = ("inverted: off over on (how many times longer the short request waits without chunking)"
                if math.isclose(float(got["ratio"]), 1 / ratio, rel_tol=1e-6) else "the off median over the on median")
        raise CheckFailed(f"{call}['ratio'] = {float(got['ratio']):.4g}, expected {ratio:.4g}: {hint}")
    passed("measure_head_of_line on two scripted servers", 2 * repeats + 1)


def print_head_of_line(result: dict, long_tokens: int, chunk_tokens: int) -> None:
    """Your measurement beside the course's reference run."""
    from .common import print_beside_reference

    print(f"a {long_tokens}-token prompt in front; chunked prefill on: {chunk_tokens} tokens per step")
    for name in HOL_NAMES:
        row = result[name]
        print(f"  chunked prefill {name:>3}: short request TTFT median {format_seconds(row['median'])}, spread "
              f"{format_seconds(row['min'])} - {format_seconds(row['max'])} over {row['n']} rounds")
    print_beside_reference("TTFT off / on", result["ratio"], REFERENCE_HOL["ratio"], REFERENCE_HOL["hardware"], "x")


def head_of_line_figure(result: dict, device: str):
    """The short request's TTFT with chunked prefill off and on: median bars, min-max whiskers."""
    import plotly.graph_objects as go

    fig = new_figure("A short request behind a long prompt", "chunked prefill", "short request TTFT (s)", device=device)
    med = [result[n]["median"] for n in HOL_NAMES]
    fig.add_trace(go.Bar(x=list(HOL_NAMES), y=med, name="yours (median)",
                         error_y={"type": "data", "symmetric": False,
                                  "array": [result[n]["max"] - m for n, m in zip(HOL_NAMES, med)],
                                  "arrayminus": [m - result[n]["min"] for n, m in zip(HOL_NAMES, med)]}))
    fig.add_trace(go.Bar(x=list(HOL_NAMES), y=[REFERENCE_HOL["off_s"], REFERENCE_HOL["on_s"]],
                         name=f"reference ({REFERENCE_HOL['hardware']}, {REFERENCE_HOL['long_tokens']} tokens)"))
    return fig


__all__ += ["REFERENCE_HOL", "HeadOfLine", "FakeHeadOfLine", "check_measure_head_of_line", "print_head_of_line",
            "head_of_line_figure"]

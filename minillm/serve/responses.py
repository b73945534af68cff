"""Response building: a request's StreamEvents -> OpenAI's answer, one JSON body or server-sent event chunks.

`complete` waits for every choice and returns the chat.completion / text_completion body;
`stream_events` yields the chunks (chat.completion.chunk / text_completion) as the tokens come,
then the usage and `data: [DONE]`. Both build the same choices, usage and logprobs objects.
"""

from __future__ import annotations

import asyncio
import json
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse

from .errors import ApiError
from .parsing import ParsedRequest
from .stream import RequestStream, StreamEvent


def _usage(num_prompt_tokens: int, finals: list[StreamEvent]) -> dict:
    """Usage over every choice: each prompt once (it is prefilled once for its n choices), the completion tokens
    of all choices."""
    completion = sum(e.num_output_tokens for e in finals)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion}


def _finish_reason(reason: str | None) -> str | None:
    return reason  # minillm's "stop" / "length" are OpenAI's; "abort" reaches no client


def _chat_logprobs(entries: list, decode) -> dict:
    """OpenAI chat's logprobs object: {"content": [{token, logprob, bytes, top_logprobs: [...]}]}."""
    def item(token: int, logprob: float) -> dict:
        text = decode(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(token, logprob), "top_logprobs": [item(t, v) for t, v in top]}
                        for token, logprob, _rank, top in entries]}


def _completion_logprobs(entries: list, decode, offset: int) -> dict:
    """The completions API's logprobs object: tokens, token_logprobs, top_logprobs ({token: logprob}, the sampled
    token among them, as vLLM) and text_offset (each token's start in the text, from `offset`)."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, logprob, _rank, top in entries:   # an echoed prompt's first token has no logprob: None, None
        text = decode(token)
        out["tokens"].append(text)
        out["token_logprobs"].append(logprob)
        out["top_logprobs"].append(None if top is None else {**{decode(t): v for t, v in top}, text: logprob})
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

def _decoder(tokenizer) -> Callable[[int], str]:
    def decode(token: int) -> str:
        return str(token) if tokenizer is None else tokenizer.decode([token])

    return decode


def _echoed(req: ParsedRequest, event: StreamEvent, tokenizer) -> tuple[str, list]:
    """The prompt's text and logprob entries for echo=true (the first prompt token has no logprob)."""
    ids = event.prompt_token_ids or []
    inputs = req.prompts[event.index // req.params.n]   # choice p * n + j belongs to prompt p
    text = inputs["prompt"] if "prompt" in inputs else (
        "" if tokenizer is None else tokenizer.decode(ids))
    entries = [(ids[0], None, None, None)] + list(event.prompt_logprobs or []) if ids and req.logprobs else []
    return text, entries


def _logprobs_object(req: ParsedRequest, entries: list, decode, offset: int = 0) -> dict | None:
    if not req.logprobs:
        return None
    return _chat_logprobs(entries, decode) if req.kind == "chat" else _completion_logprobs(entries, decode, offset)


async def complete(request: Request, req: ParsedRequest, stream: RequestStream, base: dict, watcher: asyncio.Task,
                   tokenizer):
    """The whole answer in one body (stream=false), once every choice has finished; 499 if the client left."""
    decode = _decoder(tokenizer)
    n = stream.num_choices   # every prompt's n choices
    texts, ids, entries = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
    prompts, finals = [("", [])] * n, [None] * n
    try:
        while not stream.finished:
            event = await stream.get()
            i = event.index
            if event.finished:
                finals[i] = event
            if event.prompt_token_ids is not None and req.echo:
                prompts[i] = _echoed(req, event, tokenizer)
            if req.echo_only:
                continue
            texts[i].append(event.text)
            ids[i].extend(event.token_ids)
            entries[i].extend(event.logprobs)
    finally:
        watcher.cancel()
        stream.abort()  # no-op once finished; a cancelled handler frees its blocks
    reasons = [e.finish_reason for e in finals]
    failed = next((e for e in finals if e.finish_reason in ("error", "abort")), None)
    if failed is not None and "abort" in reasons and await request.is_disconnected():
        return PlainTextResponse("", status_code=499)  # nobody reads it
    if failed is not None and failed.finish_reason == "error":
        raise ApiError(f"the request failed inside the engine: {failed.error}", None, "engine_error", 500,
                       "server_error")
    if failed is not None:  # the server is shutting down
        raise ApiError(f"the request was aborted: {failed.error}", None, "aborted", 503, "server_error")
    usage = _usage(stream.num_prompt_tokens, [] if req.echo_only else finals)
    choices = []
    for i, final in enumerate(finals):
        text = prompts[i][0] + "".join(texts[i])
        logprobs = _logprobs_object(req, prompts[i][1] + entries[i], decode)
        if req.kind == "chat":
            choice = {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                      "finish_reason": _finish_reason(final.finish_reason)}
        else:
            choice = {"index": i, "text": text, "logprobs": logprobs,
                      "finish_reason": _finish_reason(final.finish_reason)}
        if req.return_token_ids:
            choice["token_ids"] = ids[i]
        choices.append(choice)
    return JSONResponse({**base, "choices": choices, "usage": usage})


async def stream_events(req: ParsedRequest, stream: RequestStream, base: dict, watcher: asyncio.Task, tokenizer):
    """The answer as server-sent events (stream=true): a chunk per new piece of each choice, then the usage
    (stream_options.include_usage) and `data: [DONE]`; an engine failure is one error event."""
    decode = _decoder(tokenizer)
    chunk_base = {**base, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion"}

    def chunk(index: int, piece: str | None, ids: list[int], finish: str | None, entries: list = (),
              first: bool = False) -> dict:
        logprobs = _logprobs_object(req, list(entries), decode, offsets[index]) if entries else None
        if req.kind == "chat":
            delta = {} if piece is None else {"content": piece}
            if first:
                delta = {"role": "assistant", **delta}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": index, "text": piece or "", "logprobs": logprobs, "finish_reason": finish}
        if req.return_token_ids:
            choice["token_ids"] = ids
        out = {**chunk_base, "choices": [choice]}
        if req.include_usage:
            out["usage"] = None
        return out

    n = stream.num_choices   # every prompt's n choices
    offsets = [0] * n   # where each choice's next token's text starts (completions' text_offset)
    finals: list[StreamEvent] = []
    try:  # Starlette cancels this generator when the client disconnects; the watcher catches it too
        # A chat stream opens each choice with the role, sent (as vLLM does) with the choice's first output:
        # until then nothing has gone out, so a fleet's router may still retry the request elsewhere.
        opened = [req.kind != "chat"] * n
        failed = False
        while not stream.finished:
            event = await stream.get()
            i = event.index
            if not opened[i] and event.finish_reason not in ("error", "abort"):
                opened[i] = True
                yield _sse(chunk(i, "", [], None, first=True))
            if event.prompt_token_ids is not None and req.echo:
                text, entries = _echoed(req, event, tokenizer)
                yield _sse(chunk(i, text, event.prompt_token_ids, None, entries))
                offsets[i] += len(text)
            if req.echo_only:   # the one generated token is not part of the answer
                event = StreamEvent(event.request_id, "", [], event.num_prompt_tokens, 0, event.finish_reason,
                                    event.error, index=i)
            if event.finish_reason in ("error", "abort"):
                what = "failed inside the engine" if event.finish_reason == "error" else "was aborted"
                error = {"message": f"the request {what}: {event.error}", "type": "server_error", "param": None,
                         "code": "engine_error" if event.finish_reason == "error" else "aborted"}
                yield _sse({"error": error})
                failed = True
                break
            if event.text or event.token_ids or event.finished:
                # The last token's text comes with the finish reason in one chunk.
                yield _sse(chunk(i, event.text if (event.text or not event.finished) else None,
                                 event.token_ids, _finish_reason(event.finish_reason), event.logprobs))
                offsets[i] += len(event.text or "")
            if event.finished:
                finals.append(event)
        if req.include_usage and not failed:   # echo_only: 0 completion tokens
            yield _sse({**chunk_base, "choices": [], "usage": _usage(stream.num_prompt_tokens, finals)})
        yield "data: [DONE]\n\n"
    finally:  # the client went away (cancellation / GeneratorExit) or we are done
        watcher.cancel()
        stream.abort("the client disconnected")

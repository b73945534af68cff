"""The OpenAI-compatible HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

`build_app(async_engine, model_name)` returns a FastAPI app. Requests are parsed by hand (not
by pydantic models) so that every refusal is a 400 in OpenAI's shape whose message names the
value and the allowed range, reusing the engine's own validation messages. Unset sampling
fields take minillm's SamplingParams defaults: temperature 0 (greedy), top_p 1, top_k off.
OpenAI's sampling fields: temperature, top_p, max_tokens / max_completion_tokens, stop, seed, presence_penalty,
frequency_penalty, logit_bias, logprobs (chat: logprobs=true + top_logprobs; completions: logprobs=N), echo
(completions), response_format (text, json_object, json_schema: structured output through xgrammar), n (the
prompt prefilled once, its KV blocks shared; choice i draws with seed + i), best_of (completions; not streamed).
Extensions beyond them, as vLLM names them: top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, return_token_ids, structured_outputs ({"json" | "regex" | "choice" | "grammar": ...}).
user, metadata, store, service_tier and parallel_tool_calls are accepted: they do not change the answer. Any
other field this server does not know or implement is a 400 naming it, never ignored.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..sampling import MAX_LOGPROBS, SamplingParams
from ..structured import FIELDS as STRUCTURED_FIELDS
from ..structured import StructuredOutputs
from .async_engine import AsyncEngine, EngineStoppedError, RequestStream, StreamEvent

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                   "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "min_tokens", "logprobs", "structured_outputs", "n", "best_of")
# Fields that would change the answer in a way this server does not implement: refused, not ignored.
UNSUPPORTED = {
    "suffix": "suffix (insertion) is not supported",
    "tools": "tool calling is not supported",
    "functions": "function calling is not supported",
    "tool_choice": "tool calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
}
COMMON_FIELDS = {"model", "stream", "stream_options", "n", "best_of", "user", "return_token_ids", "metadata", "store",
                 "service_tier", "parallel_tool_calls", "response_format", "structured_outputs", *SAMPLING_FIELDS,
                 *UNSUPPORTED}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "modalities"}


class ApiError(Exception):
    """An OpenAI-style error: {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = message, param, code, status, type_

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status)


# ---------------------------------------------------------------------------- request parsing
def _type_name(value: Any) -> str:
    return "null" if value is None else {bool: "boolean", int: "integer", float: "number", str: "string",
                                         list: "array", dict: "object"}.get(type(value), type(value).__name__)


def _bad_type(name: str, value: Any, expected: str) -> ApiError:
    shown = json.dumps(value)[:80]
    return ApiError(f"{name}={shown} must be {expected} (got {_type_name(value)})", name, "invalid_type")


def _int(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad_type(name, value, "an integer")
    return value


def _number(body: dict, name: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad_type(name, value, "a number")
    return value


def _bool(body: dict, name: str, default: bool = False) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad_type(name, value, "true or false")
    return value


@dataclass
class ParsedRequest:
    kind: str                                   # "completion" | "chat"
    inputs: dict                                # prompt= | prompt_token_ids= | messages= for AsyncEngine
    params: SamplingParams
    fill_context: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    logprobs: bool = False                      # return logprobs in the response (params.logprobs = top N)
    echo: bool = False                          # completions: the prompt comes back before the completion
    echo_only: bool = False                     # echo with max_tokens=0: score the prompt, generate nothing
    model: str | None = None                    # the `model` the client named (None: the base model)
    lora_request: object | None = None          # the LoRARequest that name selects (--lora-modules); None: base


def _sampling(body: dict, max_tokens_field: str, default_max_tokens: int | None) -> tuple[SamplingParams, bool]:
    """SamplingParams from the request's fields; a bad value is a 400 naming the field and its range."""
    max_tokens = _int(body, max_tokens_field)
    if max_tokens_field != "max_tokens" and max_tokens is None:
        max_tokens_field, max_tokens = "max_tokens", _int(body, "max_tokens")
    fill_context = max_tokens is None and default_max_tokens is None
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise _bad_type("stop", stop, "a string or a list of strings")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is not None and not isinstance(stop_token_ids, list):
        raise _bad_type("stop_token_ids", stop_token_ids, "a list of integers")
    logit_bias = body.get("logit_bias")
    if logit_bias is not None and not isinstance(logit_bias, dict):
        raise _bad_type("logit_bias", logit_bias, "an object mapping token ids to biases, like {\"50256\": -100}")
    for key, bias in (logit_bias or {}).items():
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise _bad_type(f"logit_bias[{json.dumps(key)}]", bias, "a number in [-100, 100]")
    defaults = SamplingParams()
    kwargs = dict(
        max_tokens=1 if fill_context else (max_tokens if max_tokens is not None else default_max_tokens),
        temperature=_number(body, "temperature", defaults.temperature),
        top_p=_number(body, "top_p", defaults.top_p),
        top_k=_int(body, "top_k", defaults.top_k),
        seed=_int(body, "seed"),
        stop=stop,
        stop_token_ids=stop_token_ids or [],
        ignore_eos=_bool(body, "ignore_eos"),
        min_p=_number(body, "min_p", defaults.min_p),
        presence_penalty=_number(body, "presence_penalty", defaults.presence_penalty),
        frequency_penalty=_number(body, "frequency_penalty", defaults.frequency_penalty),
        repetition_penalty=_number(body, "repetition_penalty", defaults.repetition_penalty),
        min_tokens=_int(body, "min_tokens", defaults.min_tokens),
        logit_bias=logit_bias,
        logprobs=_logprobs(body),
        structured_outputs=_structured(body),
        n=_int(body, "n", 1),
        best_of=_int(body, "best_of"),
    )
    try:
        params = SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        message = str(exc)
        param = next((f for f in SAMPLING_FIELDS if message.startswith((f + "=", f + "[", f + " ", f + "."))), None)
        if param == "max_tokens":
            param = max_tokens_field
            message = max_tokens_field + message[len("max_tokens"):]
        raise ApiError(message, param, "invalid_value") from None
    return params, fill_context


def _logprobs(body: dict) -> int | None:
    """The number of top logprobs asked for, or None. Chat: logprobs=true with top_logprobs=N (0..20);
    completions: logprobs=N (OpenAI allows 0..5, this server up to 20, as vLLM)."""
    if "messages" in body:
        wanted = _bool(body, "logprobs")
        top = _int(body, "top_logprobs")
        if top is not None and not wanted:
            raise ApiError(f"top_logprobs={top} needs logprobs=true", "top_logprobs", "invalid_value")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise ApiError(f"top_logprobs={top} must be an integer in [0, {MAX_LOGPROBS}]", "top_logprobs",
                           "invalid_value")
        return (top or 0) if wanted else None
    value = body.get("logprobs")
    if value is None or value is False:
        return None
    if value is True:
        raise ApiError("logprobs=true is the chat API's form; completions take logprobs=N, the number of top "
                       f"tokens (0 to {MAX_LOGPROBS})", "logprobs", "invalid_value")
    return _int(body, "logprobs")


def _structured(body: dict) -> StructuredOutputs | None:
    """response_format (OpenAI: {"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ...}})
    or structured_outputs (vLLM's extension: {"json" | "regex" | "choice" | "grammar": ...})."""
    response_format, structured = body.get("response_format"), body.get("structured_outputs")
    if response_format is not None and structured is not None:
        raise ApiError("give response_format or structured_outputs, not both", "structured_outputs", "invalid_value")
    if structured is not None:
        if not isinstance(structured, dict):
            raise _bad_type("structured_outputs", structured, "an object like {\"regex\": \"[0-9]+\"}")
        unknown = sorted(set(structured) - set(STRUCTURED_FIELDS))
        if unknown:
            raise ApiError(f"structured_outputs.{unknown[0]} is not a constraint; give one of "
                           f"{', '.join(STRUCTURED_FIELDS)}", "structured_outputs", "invalid_value")
        try:
            return StructuredOutputs(**structured)
        except ValueError as exc:
            raise ApiError(str(exc), "structured_outputs", "invalid_value") from None
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError("response_format.json_schema.schema is missing: give "
                           "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                           "response_format", "invalid_value")
        return StructuredOutputs(json=schema)
    raise ApiError(f"response_format={json.dumps(response_format)[:80]}: type must be \"text\", \"json_object\" "
                   "or \"json_schema\"", "response_format", "invalid_value")


def _unknown_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(set(body) - known)
    if unknown:
        raise ApiError(f"{unknown[0]} is not a field this server knows (unknown: {', '.join(unknown)}); it would be "
                       "ignored, so it is refused", unknown[0], "unknown_field")


def _common(body: dict, model_name: str, loras: dict | None = None) -> tuple[bool, bool, bool]:
    model = body.get("model")
    if model is not None and model != model_name and model not in (loras or {}):
        served = f"the served model is {model_name!r}" if not loras else \
            f"the served models are {[model_name, *loras]} (the base model and its LoRA adapters)"
        raise ApiError(f"model={json.dumps(model)[:80]} is not served here; {served} (GET /v1/models lists "
                       f"{'them' if loras else 'it'})", "model", "model_not_found")
    if "messages" in body and body.get("best_of") is not None:
        raise ApiError("best_of is a field of /v1/completions; the chat API has n only", "best_of", "unsupported")
    n, best_of = _int(body, "n", 1), _int(body, "best_of")
    if best_of is not None and best_of > n and _bool(body, "stream"):
        raise ApiError(f"best_of={best_of} > n={n} cannot stream: the best choices are known only when all have "
                       "finished (as OpenAI's API)", "best_of", "invalid_value")
    for name, why in UNSUPPORTED.items():
        if body.get(name) not in (None, False, 0, [], {}):
            raise ApiError(f"{name}={json.dumps(body[name])[:80]}: {why}", name, "unsupported")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad_type("stream_options", options, "an object like {\"include_usage\": true}")
    include_usage = _bool(options or {}, "include_usage")
    if options is not None and not stream:
        raise ApiError("stream_options is only allowed with stream=true", "stream_options", "invalid_value")
    return stream, include_usage, _bool(body, "return_token_ids")


def _select_model(req: ParsedRequest, body: dict, loras: dict | None) -> ParsedRequest:
    """The request's `model` picks a LoRA adapter (--lora-modules) or the base model (its own name, or none)."""
    req.model = body.get("model")
    req.lora_request = (loras or {}).get(req.model)
    return req


def parse_completion(body: dict, model_name: str, loras: dict | None = None) -> ParsedRequest:
    if "prompt" not in body:
        raise ApiError("prompt is missing: give a string or a list of token ids", "prompt", "missing_field")
    _unknown_fields(body, COMPLETION_FIELDS)
    stream, include_usage, return_ids = _common(body, model_name, loras)
    original = body
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:  # a batch of prompts
            raise ApiError(f"prompt is a list of {len(prompt)} prompts; this server takes one prompt per request "
                           f"(send {len(prompt)} requests: they are batched together on the server)",
                           "prompt", "invalid_value")
        prompt = prompt[0]
    if isinstance(prompt, str):
        inputs = {"prompt": prompt}
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        inputs = {"prompt_token_ids": prompt}
    else:
        raise _bad_type("prompt", prompt, "a string or a list of integer token ids")
    echo = _bool(body, "echo")
    echo_only = echo and body.get("max_tokens") == 0   # what evaluation harnesses send to score a prompt
    if echo_only:   # one token is generated (a step reads the prompt) and dropped, as vLLM does
        body = {**body, "max_tokens": 1}
    params, fill = _sampling(body, "max_tokens", default_max_tokens=16)  # OpenAI's default for completions
    if echo and params.logprobs is not None:
        params.prompt_logprobs = params.logprobs
    return _select_model(ParsedRequest("completion", inputs, params, fill, stream, include_usage, return_ids,
                                       params.logprobs is not None, echo, echo_only), original, loras)


def _message_text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ApiError(f"messages[{i}].content: only text parts {{\"type\": \"text\", \"text\": ...}} are "
                               f"supported, got {json.dumps(part)[:80]}", "messages", "invalid_value")
            parts.append(part["text"])
        return "".join(parts)
    raise _bad_type(f"messages[{i}].content", content, "a string or a list of text parts")


def parse_chat(body: dict, model_name: str, loras: dict | None = None) -> ParsedRequest:
    if "messages" not in body:
        raise ApiError("messages is missing: give a list like [{\"role\": \"user\", \"content\": \"Hi\"}]",
                       "messages", "missing_field")
    _unknown_fields(body, CHAT_FIELDS)
    stream, include_usage, return_ids = _common(body, model_name, loras)
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise ApiError(f"modalities={json.dumps(modalities)[:80]}: only [\"text\"] is supported", "modalities",
                       "unsupported")
    if "messages" not in body:
        raise ApiError("messages is missing: give a list like [{\"role\": \"user\", \"content\": \"Hi\"}]",
                       "messages", "missing_field")
    raw = body["messages"]
    if not isinstance(raw, list):
        raise _bad_type("messages", raw, "a list of {\"role\": ..., \"content\": ...} objects")
    if not raw:
        raise ApiError("messages is empty: give at least one message", "messages", "invalid_value")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise _bad_type(f"messages[{i}]", m, "an object with role and content")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise _bad_type(f"messages[{i}].role", role, "a string such as \"system\", \"user\" or \"assistant\"")
        messages.append({"role": role, "content": _message_text(i, m.get("content"))})
    params, fill = _sampling(body, "max_completion_tokens", default_max_tokens=None)
    return _select_model(ParsedRequest("chat", {"messages": messages}, params, fill, stream, include_usage,
                                       return_ids, params.logprobs is not None), body, loras)


# ---------------------------------------------------------------------------- responses
def _usage(num_prompt_tokens: int, finals: list[StreamEvent]) -> dict:
    """Usage over every choice: the prompt once (it is prefilled once), the completion tokens of all choices."""
    completion = sum(e.num_output_tokens for e in finals)
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": num_prompt_tokens + completion}


def _finish_reason(reason: str | None) -> str | None:
    return reason  # minillm's "stop" / "length" are OpenAI's; "abort" reaches no client


def _engine_error(exc: Exception, req: ParsedRequest) -> ApiError:
    message = str(exc)
    param = next((f for f in SAMPLING_FIELDS if message.startswith((f + "=", f + "[", f + " ", f + "."))), None)
    if param is None:
        param = "messages" if req.kind == "chat" else "prompt"
    return ApiError(message, param, "invalid_value")


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


def build_app(async_engine: AsyncEngine, model_name: str, lora_modules: dict | None = None) -> FastAPI:
    """The FastAPI app serving `async_engine` under the name `model_name`; `lora_modules` {name: LoRARequest}:
    adapters a request selects with its `model` field (the engine needs enable_lora=True)."""
    loras = dict(lora_modules or {})
    app = FastAPI(title="minillm", description="OpenAI-compatible API on the minillm engine")
    app.state.async_engine = async_engine
    app.state.model_name = model_name
    created_at = int(time.time())
    watchers: set[asyncio.Task] = set()
    tokenizer = async_engine.tokenizer

    def decode(token: int) -> str:
        return str(token) if tokenizer is None else tokenizer.decode([token])

    def echoed(req: ParsedRequest, event: StreamEvent) -> tuple[str, list]:
        """The prompt's text and logprob entries for echo=true (the first prompt token has no logprob)."""
        ids = event.prompt_token_ids or []
        text = req.inputs["prompt"] if "prompt" in req.inputs else (
            "" if tokenizer is None else tokenizer.decode(ids))
        entries = [(ids[0], None, None, None)] + list(event.prompt_logprobs or []) if ids and req.logprobs else []
        return text, entries

    def logprobs_object(req: ParsedRequest, entries: list, offset: int = 0) -> dict | None:
        if not req.logprobs:
            return None
        return _chat_logprobs(entries, decode) if req.kind == "chat" else _completion_logprobs(entries, decode, offset)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        shown = json.dumps(first.get("input"), default=str)[:80] if "input" in first else "?"
        return ApiError(f"{param or 'request'}={shown}: {first.get('msg', 'invalid value')}", param,
                        "invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(f"{request.method} {request.url.path}: {exc.detail}", None, None, exc.status_code,
                        type_).response()

    async def read_body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(f"the request body is not valid JSON ({exc}); send an object like "
                           "{\"model\": ..., \"prompt\": ...}", None, "invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(f"the request body must be a JSON object, got a {_type_name(body)}", None, "invalid_json")
        return body

    async def admit(req: ParsedRequest, request_id: str) -> RequestStream:
        try:
            return await async_engine.add_request(req.params, request_id=request_id, fill_context=req.fill_context,
                                                  lora_request=req.lora_request, **req.inputs)
        except (ValueError, TypeError) as exc:
            raise _engine_error(exc, req) from None
        except EngineStoppedError as exc:
            raise ApiError(str(exc), None, "engine_stopped", 503, "server_error") from None

    async def watch_disconnect(request: Request, stream: RequestStream) -> None:
        """Abort the request as soon as its client goes away (the engine then frees its KV blocks)."""
        while not stream.finished:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                stream.abort("the client disconnected")
                return

    async def run(request: Request, req: ParsedRequest):
        prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        stream = await admit(req, request_id)
        base = {"id": request_id, "object": "chat.completion" if req.kind == "chat" else "text_completion",
                "created": created, "model": req.model if req.lora_request is not None else model_name}
        # Started here, not inside the SSE generator: a client that leaves before the first chunk is seen too.
        watcher = asyncio.create_task(watch_disconnect(request, stream))
        watchers.add(watcher)  # asyncio keeps only weak references to tasks
        watcher.add_done_callback(watchers.discard)
        if req.stream:
            return StreamingResponse(stream_events(req, stream, base, watcher), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        n = req.params.n
        texts, ids, entries = [[] for _ in range(n)], [[] for _ in range(n)], [[] for _ in range(n)]
        prompts, finals = [("", [])] * n, [None] * n
        try:
            while not stream.finished:
                event = await stream.get()
                i = event.index
                if event.finished:
                    finals[i] = event
                if event.prompt_token_ids is not None and req.echo:
                    prompts[i] = echoed(req, event)
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
        usage = _usage(finals[0].num_prompt_tokens, [] if req.echo_only else finals)
        choices = []
        for i, final in enumerate(finals):
            text = prompts[i][0] + "".join(texts[i])
            logprobs = logprobs_object(req, prompts[i][1] + entries[i])
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

    async def stream_events(req: ParsedRequest, stream: RequestStream, base: dict, watcher: asyncio.Task):
        chunk_base = {**base, "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion"}

        def chunk(index: int, piece: str | None, ids: list[int], finish: str | None, entries: list = (),
                  first: bool = False) -> dict:
            logprobs = logprobs_object(req, list(entries), offsets[index]) if entries else None
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

        n = req.params.n
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
                    text, entries = echoed(req, event)
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await run(request, parse_completion(await read_body(request), model_name, loras))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await run(request, parse_chat(await read_body(request), model_name, loras))

    @app.get("/v1/models")
    async def models():
        base = {"id": model_name, "object": "model", "created": created_at, "owned_by": "minillm",
                "root": model_name, "parent": None, "max_model_len": async_engine.max_model_len}
        # vLLM's listing: each LoRA adapter under its name, its base model as "parent", its path as "root"
        adapters = [{**base, "id": name, "root": lora.path, "parent": model_name} for name, lora in loras.items()]
        return {"object": "list", "data": [base, *adapters]}

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            return JSONResponse({"status": "stopped", "reason": async_engine.stopped_reason()}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(async_engine.render_metrics(model_name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app

"""The routes of the OpenAI-compatible API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
and vLLM's /tokenize and /detokenize (minillm/serve/tokens.py).

`build_app(async_engine, model_name)` returns a FastAPI app. A completion request (its `prompt` a string,
token ids, or a list of either: one engine request per prompt) is parsed (minillm/serve/parsing.py: every
refusal a 400 in OpenAI's shape, minillm/serve/errors.py), admitted to the AsyncEngine (all its prompts or none), watched for its client leaving (the engine then frees its KV blocks),
and answered in one body or as server-sent events (minillm/serve/responses.py). The routes are
module-level functions over the app's ServerState (`app.state.server`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .async_engine import AsyncEngine, EngineStoppedError
from .errors import ApiError, add_error_handlers, type_name
from .parsing import ParsedRequest, engine_error, parse_chat, parse_completion
from .responses import complete, stream_events
from .stream import RequestStream
from .tokens import detokenize, tokenize

DISCONNECT_POLL_S = 0.25  # how often a waiting handler checks whether its client is still there


@dataclass
class ServerState:
    """What the routes share: the engine, the names it is served under, the tasks watching for disconnects."""

    async_engine: AsyncEngine
    model_name: str
    loras: dict                      # {name: LoRARequest}: adapters a request selects with its `model` field
    created_at: int
    watchers: set[asyncio.Task] = field(default_factory=set)   # asyncio keeps only weak references to tasks


router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.server


async def read_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(f"the request body is not valid JSON ({exc}); send an object like "
                       "{\"model\": ..., \"prompt\": ...}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(f"the request body must be a JSON object, got a {type_name(body)}", None, "invalid_json")
    return body


async def admit(state: ServerState, req: ParsedRequest, request_id: str) -> RequestStream:
    try:
        return await state.async_engine.add_requests(req.params, req.prompts, request_id=request_id,
                                                     fill_context=req.fill_context, lora_request=req.lora_request)
    except (ValueError, TypeError) as exc:
        raise engine_error(exc, req) from None
    except EngineStoppedError as exc:
        raise ApiError(str(exc), None, "engine_stopped", 503, "server_error") from None


async def watch_disconnect(request: Request, stream: RequestStream) -> None:
    """Abort the request as soon as its client goes away (the engine then frees its KV blocks)."""
    while not stream.finished:
        await asyncio.sleep(DISCONNECT_POLL_S)
        if await request.is_disconnected():
            stream.abort("the client disconnected")
            return


async def run(state: ServerState, request: Request, req: ParsedRequest):
    prefix = "chatcmpl" if req.kind == "chat" else "cmpl"
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    created = int(time.time())
    stream = await admit(state, req, request_id)
    base = {"id": request_id, "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": created, "model": req.model if req.lora_request is not None else state.model_name}
    # Started here, not inside the SSE generator: a client that leaves before the first chunk is seen too.
    watcher = asyncio.create_task(watch_disconnect(request, stream))
    state.watchers.add(watcher)  # asyncio keeps only weak references to tasks
    watcher.add_done_callback(state.watchers.discard)
    tokenizer = state.async_engine.tokenizer
    if req.stream:
        return StreamingResponse(stream_events(req, stream, base, watcher, tokenizer), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await complete(request, req, stream, base, watcher, tokenizer)


@router.post("/v1/completions")
async def completions(request: Request):
    state = _state(request)
    return await run(state, request, parse_completion(await read_body(request), state.model_name, state.loras))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    state = _state(request)
    return await run(state, request, parse_chat(await read_body(request), state.model_name, state.loras))


@router.post("/tokenize")
async def tokenize_route(request: Request):
    state = _state(request)
    return tokenize(state.async_engine.llm, await read_body(request), state.model_name)


@router.post("/detokenize")
async def detokenize_route(request: Request):
    state = _state(request)
    return detokenize(state.async_engine.llm, await read_body(request), state.model_name)


@router.get("/v1/models")
async def models(request: Request):
    state = _state(request)
    model_name = state.model_name
    base = {"id": model_name, "object": "model", "created": state.created_at, "owned_by": "minillm",
            "root": model_name, "parent": None, "max_model_len": state.async_engine.max_model_len}
    # vLLM's listing: each LoRA adapter under its name, its base model as "parent", its path as "root"
    adapters = [{**base, "id": name, "root": lora.path, "parent": model_name} for name, lora in state.loras.items()]
    return {"object": "list", "data": [base, *adapters]}


@router.get("/health")
async def health(request: Request):
    async_engine = _state(request).async_engine
    if not async_engine.is_running:
        return JSONResponse({"status": "stopped", "reason": async_engine.stopped_reason()}, status_code=503)
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request):
    state = _state(request)
    return PlainTextResponse(state.async_engine.render_metrics(state.model_name),
                             media_type="text/plain; version=0.0.4; charset=utf-8")


def build_app(async_engine: AsyncEngine, model_name: str, lora_modules: dict | None = None) -> FastAPI:
    """The FastAPI app serving `async_engine` under the name `model_name`; `lora_modules` {name: LoRARequest}:
    adapters a request selects with its `model` field (the engine needs enable_lora=True)."""
    app = FastAPI(title="minillm", description="OpenAI-compatible API on the minillm engine")
    app.state.async_engine = async_engine
    app.state.model_name = model_name
    app.state.server = ServerState(async_engine, model_name, dict(lora_modules or {}), int(time.time()))
    add_error_handlers(app)
    app.include_router(router)
    return app

"""The fleet's Ray actors: engine replicas serving minillm's app, the ingress that routes and retries, the event log.

`FleetIngress` (one replica, no CPU of its own) receives every HTTP request from Ray's proxy and passes it, as
method + path + headers + body, to an `EngineReplica` through a DeploymentHandle with `.options(stream=True)`;
Ray's router picks the replica (power of two choices on queue length) and counts the ongoing requests the
autoscaler reads. Each `EngineReplica` owns an LLM, its AsyncEngine thread and the very app `minillm serve`
runs (minillm/serve/app.py's build_app), driven in-process as an ASGI app, and reports its start-up to the
`FleetLog` actor; the ingress reports its retries and mid-stream losses there (see ray_fleet.py).

The classes are plain classes: build_deployments() makes them a Ray actor class and Serve deployments on first use,
so importing this module does not import Ray.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

APP_NAME = "minillm-fleet"
ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "FleetIngress"
LOG_NAMESPACE = "minillm-fleet"
REPLICA_HEADER = "x-minillm-replica"   # which replica answered (the ingress passes it on to the client)
MAX_ATTEMPTS = 3                 # a request goes to at most this many replicas before the client gets the error


class FleetLog:
    """What happened inside the fleet, kept in one place: replica start-ups, retries, mid-stream losses."""

    def __init__(self):
        self.startups: list[dict] = []
        self.events: list[tuple[float, str]] = []

    def startup(self, record: dict) -> None:
        self.startups.append(record)
        self.events.append((record["ready_at"], f"replica {record['replica']} ready: process start "
                                                f"{record['process_start_s']:.1f} s + weight load "
                                                f"{record['weight_load_s']:.1f} s"))

    def event(self, at: float, text: str) -> None:
        self.events.append((at, text))

    def read(self) -> tuple[list[dict], list[tuple[float, str]]]:
        return list(self.startups), list(self.events)


class EngineReplica:
    """One engine: an LLM, its AsyncEngine thread, and minillm serve's app driven as an ASGI app."""

    def __init__(self, levers: dict, threads: int, log_name: str, model_name: str | None = None):
        constructed_at = time.time()
        import ray
        import torch
        from ray import serve

        process_start_s = max(0.0, constructed_at - _process_started_at())
        torch.set_num_threads(threads)
        from minillm.llm import LLM
        from minillm.serve.app import build_app
        from minillm.serve.async_engine import AsyncEngine
        from minillm.serve.server import default_model_name

        t0 = time.perf_counter()
        llm = LLM(**levers)
        weight_load_s = time.perf_counter() - t0
        self.async_engine = AsyncEngine(llm)
        self.app = build_app(self.async_engine, model_name or default_model_name(llm))
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        record = {"replica": self.replica, "actor": ray.get_runtime_context().get_actor_name(),
                  "node": ray.get_runtime_context().get_node_id()[:8], "pid": os.getpid(),
                  "process_start_s": process_start_s, "weight_load_s": weight_load_s,
                  "total_s": process_start_s + weight_load_s, "ready_at": time.time()}
        # waited for: Serve counts the replica as running only once the log holds its start-up
        ray.get(ray.get_actor(log_name, namespace=LOG_NAMESPACE).startup.remote(record))

    async def forward(self, method: str, path: str, query: bytes, headers: list, body: bytes):
        """Run one HTTP request through the app; yields ("start", status, headers), then ("body", bytes)..."""
        messages: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()      # app.py polls this to notice a client that left
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            await messages.put(message)

        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                 "query_string": query, "headers": [(k.encode(), v.encode()) for k, v in headers],
                 "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
        app_task = asyncio.ensure_future(self.app(scope, receive, send))
        app_task.add_done_callback(lambda _: messages.put_nowait(None))
        try:
            while True:
                message = await messages.get()
                if message is None:
                    app_task.result()   # the app's own exception, if it raised
                    return
                if message["type"] == "http.response.start":
                    out = [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])]
                    yield ("start", message["status"], out + [(REPLICA_HEADER, self.replica)])
                elif message["type"] == "http.response.body":
                    if message.get("body"):
                        yield ("body", bytes(message["body"]))
                    if not message.get("more_body", False):
                        return
        finally:   # done, or the ingress cancelled us (its client left): the app aborts the request
            gone.set()
            if not app_task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(app_task), timeout=5.0)
                except BaseException:  # noqa: BLE001 - cancelled or timed out: stop the app's task
                    app_task.cancel()

    def __del__(self):
        engine = getattr(self, "async_engine", None)
        if engine is not None:
            engine.shutdown(timeout_s=5.0)


class FleetIngress:
    """Every HTTP request: to an EngineReplica (Ray's router picks it), retried on another if it died early."""

    def __init__(self, engine, log_name: str):
        import ray

        self.engine = engine.options(stream=True)
        self.log = ray.get_actor(log_name, namespace=LOG_NAMESPACE)
        self._actor_died = _actor_died_errors()

    def _note(self, text: str) -> None:
        self.log.event.remote(time.time(), text)

    async def __call__(self, request):
        from starlette.responses import Response, StreamingResponse

        body = await request.body()
        path = request.url.path
        query = request.url.query.encode()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in ("host", "content-length")]
        died = []
        for attempt in range(1, MAX_ATTEMPTS + 1):
            chunks = self.engine.forward.remote(request.method, path, query, headers, body)
            try:
                head = await chunks.__anext__()
                first = await _next_or_none(chunks)
            except self._actor_died as exc:   # died before anything reached the client: send it elsewhere
                died.append(_short(exc))
                self._note(f"{request.method} {path}: its replica died before the first byte "
                           f"(attempt {attempt} of {MAX_ATTEMPTS}); retried on another replica")
                continue
            _, status, out_headers = head
            if first is None or not _streams(out_headers):   # whole body in one chunk (or none)
                rest = [first[1]] if first is not None else []
                async for _, data in chunks:
                    rest.append(data)
                return Response(b"".join(rest), status_code=status, headers=_without_length(out_headers))
            replica = dict(out_headers).get(REPLICA_HEADER, "?")
            return StreamingResponse(self._relay(chunks, first[1], path, replica), status_code=status,
                                     headers=_without_length(out_headers))
        message = (f"every replica tried ({MAX_ATTEMPTS}) died before answering {request.method} {path}: "
                   + "; ".join(died))
        self._note(message)
        return Response(json.dumps({"error": {"message": message, "type": "server_error", "param": None,
                                              "code": "replica_died"}}),
                        status_code=503, media_type="application/json")

    async def _relay(self, chunks, first: bytes, path: str, replica: str):
        yield first
        try:
            async for _, data in chunks:
                yield data
        except self._actor_died as exc:
            message = (f"replica {replica}, which served this stream, died mid-stream ({_short(exc)}); the "
                       "tokens above are all it produced: send the request again")
            self._note(f"POST {path}: a stream lost replica {replica} mid-stream, ended with an error event")
            error = {"message": message, "type": "server_error", "param": None, "code": "replica_died"}
            yield f"data: {json.dumps({'error': error})}\n\n".encode()
            yield b"data: [DONE]\n\n"
        finally:
            chunks.cancel()   # the client left (or we are done): the replica aborts the request


_DEPLOYMENTS: dict[str, Any] = {}


def build_deployments() -> dict[str, Any]:
    """{"FleetLog": the Ray actor class, "EngineReplica" / "FleetIngress": the Serve deployments}, built once."""
    if _DEPLOYMENTS:
        return _DEPLOYMENTS
    import ray
    from ray import serve

    _DEPLOYMENTS.update(
        FleetLog=ray.remote(num_cpus=0)(FleetLog),
        EngineReplica=serve.deployment(name=ENGINE_DEPLOYMENT)(EngineReplica),
        FleetIngress=serve.deployment(name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=100_000,
                                      ray_actor_options={"num_cpus": 0})(FleetIngress))
    return _DEPLOYMENTS


def _actor_died_errors() -> tuple[type[BaseException], ...]:
    import ray.exceptions

    return (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


_IMPORTED_AT = time.time()


def _process_started_at() -> float:
    """When this process was created (Linux: /proc, as psutil reads it); elsewhere when this module was imported."""
    try:
        with open("/proc/self/stat") as f:
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot_s = next(int(line.split()[1]) for line in f if line.startswith("btime "))
        return boot_s + int(after_name[19]) / os.sysconf("SC_CLK_TCK")   # field 22: start time in clock ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_AT


async def _next_or_none(chunks):
    try:
        return await chunks.__anext__()
    except StopAsyncIteration:
        return None


def _streams(headers: list) -> bool:
    return any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)


def _without_length(headers: list) -> dict:
    return {k: v for k, v in headers if k.lower() not in ("content-length", "transfer-encoding")}


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]

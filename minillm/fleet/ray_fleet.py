"""A fleet of minillm replicas on Ray Serve: Ray's router spreads requests, its autoscaler adds and removes replicas.

    from minillm.fleet.ray_fleet import start_fleet, AutoscalingConfig
    with start_fleet(num_replicas=2) as fleet:                 # a local Ray cluster on loopback
        print(fleet.base_url, fleet.num_replicas(), fleet.startup_times())
        # OpenAI routes under fleet.base_url + "/v1": minillm.bench.serve.run_benchmark(fleet.base_url, ...)
    fleet = start_fleet(autoscaling=AutoscalingConfig(min_replicas=1, max_replicas=2, target_ongoing_requests=4))

Two deployments. `FleetIngress` (one replica, no CPU of its own) receives every HTTP request from Ray's proxy and
passes it, as method + path + headers + body, to an `EngineReplica` through a DeploymentHandle with
`.options(stream=True)`; Ray's router picks the replica (power of two choices on queue length) and counts the
ongoing requests the autoscaler reads. Each `EngineReplica` owns an LLM, its AsyncEngine thread and the very app
`minillm serve` runs (minillm/serve/app.py's build_app), driven in-process as an ASGI app: the fleet answers every
route exactly as one server does (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics; SSE
streaming; the same 400s), and the response comes back chunk by chunk.

A replica that dies (killed, out of memory, its machine gone): the ingress sees Ray's actor-died error. Before the
first body byte reached the client it sends the request again to another replica (at most MAX_ATTEMPTS times), so
nothing is lost; once bytes went out it ends the stream with an SSE error event that says which replica died, then
`data: [DONE]` (a non-streaming request's body is one chunk, so it is always retried).

Every replica measures its own start-up (`process_start_s`: from its worker process's creation to the constructor;
`weight_load_s`: building the LLM) and reports it to a small `FleetLog` actor, with the ingress's retries and
mid-stream errors; a monitor thread in the driver records the replica count and Serve's scaling status with
timestamps (`fleet.timeline()`).

`minillm fleet` (main() below) is the command line: a fleet in the foreground, or `--demo-autoscale`, a load ramp
up then down that prints the 1 -> 2 -> 1 timeline. Multi-machine: `ray start --head` on one machine, `ray start
--address=HEAD:6379` on the others (minillm installed on each), then the same command with `--address HEAD:6379`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any

APP_NAME = "minillm-fleet"
ENGINE_DEPLOYMENT = "EngineReplica"
INGRESS_DEPLOYMENT = "FleetIngress"
LOG_NAMESPACE = "minillm-fleet"
REPLICA_HEADER = "x-minillm-replica"   # which replica answered (the ingress passes it on to the client)
MAX_ATTEMPTS = 3                 # a request goes to at most this many replicas before the client gets the error
MONITOR_INTERVAL_S = 0.2         # how often the driver's monitor thread reads the replica count
STARTUP_TIMEOUT_S = 600.0        # serve.run waits this long for every replica to load its weights


# ---------------------------------------------------------------------------- configuration
@dataclass(frozen=True)
class AutoscalingConfig:
    """Ray Serve's autoscaling_config for the engine replicas, checked here with errors that name the range.

    Serve keeps `ongoing requests per replica` (running + queued in the replica, averaged over `look_back_period_s`)
    near `target_ongoing_requests`: it asks for ceil(total ongoing / target) replicas, clipped to
    [min_replicas, max_replicas], once that wish has held for `upscale_delay_s` (more) or `downscale_delay_s` (fewer).
    """

    min_replicas: int = 1
    max_replicas: int = 2
    target_ongoing_requests: float = 4.0
    upscale_delay_s: float = 5.0
    downscale_delay_s: float = 30.0
    initial_replicas: int | None = None     # None: min_replicas
    metrics_interval_s: float = 1.0         # how often replicas and handles report their queue lengths
    look_back_period_s: float = 5.0         # the window those reports are averaged over

    def __post_init__(self):
        def check(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"AutoscalingConfig {name}={getattr(self, name)!r} is out of range: {allowed}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN

        check("min_replicas", is_int(self.min_replicas) and self.min_replicas >= 1,
              "an integer >= 1 (a fleet scaled to zero has nobody to answer the first request)")
        check("max_replicas", is_int(self.max_replicas) and self.max_replicas >= self.min_replicas,
              f"an integer >= min_replicas ({self.min_replicas})")
        check("target_ongoing_requests", is_num(self.target_ongoing_requests) and self.target_ongoing_requests > 0,
              "a number > 0 (requests running or queued per replica)")
        check("upscale_delay_s", is_num(self.upscale_delay_s) and 0 <= self.upscale_delay_s < float("inf"),
              "seconds >= 0")
        check("downscale_delay_s", is_num(self.downscale_delay_s) and 0 <= self.downscale_delay_s < float("inf"),
              "seconds >= 0")
        if self.initial_replicas is not None:
            check("initial_replicas", is_int(self.initial_replicas)
                  and self.min_replicas <= self.initial_replicas <= self.max_replicas,
                  f"None or an integer in [min_replicas, max_replicas] = [{self.min_replicas}, {self.max_replicas}]")
        check("metrics_interval_s", is_num(self.metrics_interval_s) and 0 < self.metrics_interval_s < float("inf"),
              "seconds > 0")
        check("look_back_period_s", is_num(self.look_back_period_s) and 0 < self.look_back_period_s < float("inf"),
              "seconds > 0")

    def to_ray(self) -> dict:
        """The dict Ray Serve's `autoscaling_config` takes (ray.serve.config.AutoscalingConfig's field names)."""
        out = dataclasses.asdict(self)
        if out["initial_replicas"] is None:
            del out["initial_replicas"]
        return out


def _check_fleet_args(num_replicas, autoscaling, port, threads_per_replica, max_ongoing_requests) -> None:
    if (num_replicas is None) == (autoscaling is None):
        raise ValueError(f"give num_replicas (a fixed fleet) or autoscaling (an AutoscalingConfig), exactly one "
                         f"(got num_replicas={num_replicas!r}, autoscaling={autoscaling!r})")
    if num_replicas is not None and (not isinstance(num_replicas, int) or isinstance(num_replicas, bool)
                                     or num_replicas < 1):
        raise ValueError(f"num_replicas={num_replicas!r} must be an integer >= 1")
    if autoscaling is not None and not isinstance(autoscaling, AutoscalingConfig):
        raise ValueError(f"autoscaling={autoscaling!r} must be an AutoscalingConfig")
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"port={port!r} must be an integer in [0, 65535] (0: a free port)")
    if not isinstance(threads_per_replica, int) or threads_per_replica < 1:
        raise ValueError(f"threads_per_replica={threads_per_replica!r} must be an integer >= 1")
    if not isinstance(max_ongoing_requests, int) or max_ongoing_requests < 1:
        raise ValueError(f"max_ongoing_requests={max_ongoing_requests!r} must be an integer >= 1")


# ---------------------------------------------------------------------------- the actors and deployments
# Built lazily: importing this module must not import Ray (the floor check and `minillm --help` stay light).
_DEPLOYMENTS: dict[str, Any] = {}


def _deployments() -> dict[str, Any]:
    if _DEPLOYMENTS:
        return _DEPLOYMENTS
    import ray
    from ray import serve

    actor_died = _actor_died_errors()

    @ray.remote(num_cpus=0)
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

    @serve.deployment(name=ENGINE_DEPLOYMENT)
    class EngineReplica:
        """One engine: an LLM, its AsyncEngine thread, and minillm serve's app driven as an ASGI app."""

        def __init__(self, levers: dict, threads: int, log_name: str, model_name: str | None = None):
            constructed_at = time.time()
            import torch

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

    @serve.deployment(name=INGRESS_DEPLOYMENT, num_replicas=1, max_ongoing_requests=100_000,
                      ray_actor_options={"num_cpus": 0})
    class FleetIngress:
        """Every HTTP request: to an EngineReplica (Ray's router picks it), retried on another if it died early."""

        def __init__(self, engine, log_name: str):
            self.engine = engine.options(stream=True)
            self.log = ray.get_actor(log_name, namespace=LOG_NAMESPACE)

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
                except actor_died as exc:   # died before anything reached the client: send it elsewhere
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
            except actor_died as exc:
                message = (f"replica {replica}, which served this stream, died mid-stream ({_short(exc)}); the "
                           "tokens above are all it produced: send the request again")
                self._note(f"POST {path}: a stream lost replica {replica} mid-stream, ended with an error event")
                error = {"message": message, "type": "server_error", "param": None, "code": "replica_died"}
                yield f"data: {json.dumps({'error': error})}\n\n".encode()
                yield b"data: [DONE]\n\n"
            finally:
                chunks.cancel()   # the client left (or we are done): the replica aborts the request

    _DEPLOYMENTS.update(FleetLog=FleetLog, EngineReplica=EngineReplica, FleetIngress=FleetIngress)
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


# ---------------------------------------------------------------------------- the driver's side
def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class Fleet:
    """A running fleet (start_fleet returns it): base_url, num_replicas(), startup_times(), timeline(),
    kill_replica(), shutdown(); also a context manager."""

    def __init__(self, *, base_url: str, log, log_name: str, started_ray: bool, temp_dir: str | None,
                 started_at: float, autoscaling: AutoscalingConfig | None, fixed_replicas: int | None):
        self.base_url = base_url
        self.autoscaling = autoscaling
        self.fixed_replicas = fixed_replicas
        self._log = log
        self._log_name = log_name
        self._started_ray = started_ray
        self._temp_dir = temp_dir
        self.started_at = started_at
        self._monitor_events: list[tuple[float, int, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closed = False
        self._monitor = threading.Thread(target=self._watch, name="minillm-fleet-monitor", daemon=True)

    # -------------------------------------------------------------- reading the fleet
    def _deployment_status(self):
        from ray import serve

        app = serve.status().applications.get(APP_NAME)
        return None if app is None else app.deployments.get(ENGINE_DEPLOYMENT)

    def num_replicas(self) -> int:
        """Engine replicas running now (Serve's RUNNING state: loaded and taking requests)."""
        status = self._deployment_status()
        return 0 if status is None else int(status.replica_states.get("RUNNING", 0))

    def startup_times(self) -> list[dict]:
        """Per replica, in the order they became ready: {"replica", "node", "pid", "process_start_s",
        "weight_load_s", "total_s"}; process_start_s runs from the worker process's creation to the replica's
        constructor (Python + Ray + torch imports), weight_load_s is building the LLM."""
        import ray

        startups, _ = ray.get(self._log.read.remote())
        keys = ("replica", "node", "pid", "process_start_s", "weight_load_s", "total_s")
        return [{k: s[k] for k in keys} for s in sorted(startups, key=lambda s: s["ready_at"])]

    def timeline(self) -> list[tuple[float, int, str]]:
        """[(seconds since start_fleet, running replicas, event)]: the monitor's replica counts and Serve's
        scaling decisions, merged with what the replicas and the ingress reported (start-ups, retries, losses)."""
        import ray

        _, events = ray.get(self._log.read.remote())
        with self._lock:
            own = list(self._monitor_events)
        merged = own + [(at - self.started_at, self._count_at(own, at - self.started_at), text)
                        for at, text in events]
        return sorted(merged, key=lambda e: e[0])

    @staticmethod
    def _count_at(events: list, t: float) -> int:
        count = 0
        for at, n, _ in events:
            if at > t:
                break
            count = n
        return count

    def _watch(self) -> None:
        last = None
        while not self._stop.wait(MONITOR_INTERVAL_S):
            try:
                status = self._deployment_status()
            except Exception:  # noqa: BLE001 - Ray going down under us at shutdown
                continue
            if status is None:
                continue
            states = dict(status.replica_states)
            running = int(states.get("RUNNING", 0))
            scaling = getattr(status.status, "value", str(status.status))
            key = (running, tuple(sorted(states.items())), scaling)
            if key == last:
                continue
            t = time.time() - self.started_at
            parts = [f"{running} running"] + [f"{n} {s.lower()}" for s, n in sorted(states.items())
                                              if s != "RUNNING" and n]
            text = f"replicas: {', '.join(parts)} (Serve: {scaling})"
            if last is not None and scaling != last[2] and scaling in ("UPSCALING", "DOWNSCALING"):
                text = f"autoscaler decided: {scaling.lower()} -> " + text
            with self._lock:
                self._monitor_events.append((t, running, text))
            last = key

    # -------------------------------------------------------------- acting on it
    def replica_actor_names(self) -> list[str]:
        """The Ray actor names of the engine replicas, oldest first (by when they reported ready)."""
        import ray

        prefix = f"SERVE_REPLICA::{APP_NAME}#{ENGINE_DEPLOYMENT}#"
        alive = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if a["name"].startswith(prefix)}
        startups, _ = ray.get(self._log.read.remote())
        ordered = [s["actor"] for s in sorted(startups, key=lambda s: s["ready_at"]) if s["actor"] in alive]
        return ordered + sorted(alive - set(ordered))

    def kill_replica(self, index: int = 0) -> str:
        """ray.kill one engine replica (index into replica_actor_names(), oldest first); returns its actor name.
        Serve starts a replacement; requests it held are retried or end with an error (see the module's doc)."""
        import ray

        names = self.replica_actor_names()
        if not isinstance(index, int) or not -len(names) <= index < len(names):
            raise ValueError(f"index={index!r} must be in [0, {len(names) - 1}] ({len(names)} replicas alive)")
        name = names[index]
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        ray.get(self._log.event.remote(time.time(), f"replica actor {name.rsplit('#', 1)[-1]} killed (ray.kill)"))
        return name

    def wait_for_replicas(self, count: int, timeout_s: float = 120.0) -> float:
        """Block until `count` replicas run; returns the seconds waited. TimeoutError naming the count seen."""
        t0 = time.monotonic()
        while True:
            running = self.num_replicas()
            if running == count:
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"{running} replicas running after {timeout_s:.0f} s, waiting for {count}")
            time.sleep(MONITOR_INTERVAL_S)

    def shutdown(self) -> None:
        """serve.shutdown(), then ray.shutdown() if start_fleet started Ray; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._monitor.is_alive():
            self._monitor.join(5.0)
        import ray
        from ray import serve

        try:
            serve.shutdown()
        finally:
            if self._started_ray:
                ray.shutdown()
                if self._temp_dir:
                    shutil.rmtree(self._temp_dir, ignore_errors=True)
            else:
                try:
                    ray.kill(self._log)
                except Exception:  # noqa: BLE001 - already gone with the cluster
                    pass

    def __enter__(self) -> "Fleet":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"Fleet({self.base_url}, {'closed' if self._closed else 'running'})"


def start_fleet(levers: dict | None = None, *, num_replicas: int | None = 2,
                autoscaling: AutoscalingConfig | None = None, port: int = 0, threads_per_replica: int = 1,
                max_ongoing_requests: int = 16, address: str | None = None, host: str = "127.0.0.1",
                model_name: str | None = None, progress: bool = True) -> Fleet:
    """Start engine replicas behind Ray Serve and return the Fleet once every initial replica is ready.

    levers: LLM(**levers) in each replica (model=..., any EngineConfig field). num_replicas: a fixed fleet; or
    autoscaling=AutoscalingConfig(...) (then num_replicas is ignored). port: the HTTP port (0: a free one).
    threads_per_replica: torch threads (and Ray CPUs) per replica. max_ongoing_requests: what Ray's router sends
    one replica at most (the rest wait in the ingress's queue). address: an existing Ray cluster ("HOST:6379" or
    "auto"); None starts a local one on loopback (and shutdown() stops it). host: where the HTTP proxy listens.
    model_name: the name clients pass as `model` (default: as `minillm serve` names it). progress: a tqdm bar of
    replicas loaded (start-up takes 30-45 s on 2 cores)."""
    if autoscaling is not None:
        num_replicas = None
    _check_fleet_args(num_replicas, autoscaling, port, threads_per_replica, max_ongoing_requests)
    levers = dict(levers or {})
    if address is None:   # a bad lever fails here, in words, not after Ray retried every replica's constructor
        from ..config import EngineConfig
        from ..engine.builder import EngineParts

        EngineConfig.from_kwargs(**{k: v for k, v in levers.items() if k not in EngineParts.names()})
    import ray
    from ray import serve

    started_at = time.time()
    started_ray, temp_dir = False, None
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # nothing leaves this machine unasked
    # Each replica's own worker processes get these (an actor-level runtime_env: also on a cluster we only joined).
    env = {"OMP_NUM_THREADS": str(threads_per_replica), "MKL_NUM_THREADS": str(threads_per_replica),
           "TOKENIZERS_PARALLELISM": "false"}
    if not ray.is_initialized():
        if address is None:
            temp_dir = tempfile.mkdtemp(prefix="minillm-ray-")
            most = autoscaling.max_replicas if autoscaling is not None else num_replicas
            ray.init(num_cpus=max(os.cpu_count() or 1, most * threads_per_replica), include_dashboard=False,
                     logging_level="ERROR", log_to_driver=False, _temp_dir=temp_dir,
                     object_store_memory=256 * 1024 ** 2, runtime_env={"env_vars": env})
        else:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False, runtime_env={"env_vars": env})
        started_ray = True
    for name in ("ray.serve", "ray"):   # Serve's INFO lines ("Started Serve ...") would interleave with ours
        logging.getLogger(name).setLevel(logging.WARNING)
    deployments = _deployments()
    log_name = f"fleet-log-{uuid.uuid4().hex[:8]}"
    log = deployments["FleetLog"].options(name=log_name, namespace=LOG_NAMESPACE).remote()
    http_port = port or _free_port(host)
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    # The monitor runs from here on: the timeline shows the replicas starting, not only the fleet once up.
    fleet = Fleet(base_url=f"http://{shown}:{http_port}", log=log, log_name=log_name, started_ray=started_ray,
                  temp_dir=temp_dir, started_at=started_at, autoscaling=autoscaling, fixed_replicas=num_replicas)
    try:
        serve.start(proxy_location="HeadOnly", http_options={"host": host, "port": http_port},
                    logging_config={"log_level": "ERROR"})
        fleet._monitor.start()
        options = {"max_ongoing_requests": max_ongoing_requests,
                   "ray_actor_options": {"num_cpus": threads_per_replica, "runtime_env": {"env_vars": env}},
                   "health_check_period_s": 2.0, "health_check_timeout_s": 30.0,
                   "graceful_shutdown_timeout_s": 5.0}
        if autoscaling is not None:
            options["autoscaling_config"] = autoscaling.to_ray()
        else:
            options["num_replicas"] = num_replicas
        with warnings.catch_warnings():   # Ray 2.60 deprecates metrics_interval_s (for an env variable) but obeys it
            warnings.filterwarnings("ignore", message=".*metrics_interval_s.*", category=DeprecationWarning)
            engine = deployments["EngineReplica"].options(**options).bind(levers, threads_per_replica, log_name,
                                                                         model_name)
        app = deployments["FleetIngress"].bind(engine, log_name)
        deploy_error: list[BaseException] = []

        def deploy() -> None:   # serve.run returns once every replica is up: the bar below counts them meanwhile
            try:
                serve.run(app, name=APP_NAME, route_prefix="/", blocking=False)
            except BaseException as exc:  # noqa: BLE001 - re-raised in this thread by _wait_running
                deploy_error.append(exc)

        deployer = threading.Thread(target=deploy, name="minillm-fleet-deploy", daemon=True)
        deployer.start()
        initial = num_replicas if autoscaling is None else (autoscaling.initial_replicas or autoscaling.min_replicas)
        _wait_running(STARTUP_TIMEOUT_S, initial, progress, deployer, deploy_error)
    except BaseException:
        fleet.shutdown()
        raise
    return fleet


def _wait_running(timeout_s: float, replicas: int, progress: bool, deployer: threading.Thread,
                  deploy_error: list) -> None:
    """Wait for serve.run (in `deployer`) and the application to be RUNNING, with a progress bar of replicas."""
    from ray import serve
    from tqdm.auto import tqdm

    deadline = time.monotonic() + timeout_s
    with tqdm(total=replicas, desc="fleet: replicas loaded", unit="replica", disable=not progress) as bar:
        while True:
            app = serve.status().applications.get(APP_NAME)
            state = getattr(app.status, "value", str(app.status)) if app is not None else "MISSING"
            engine = app.deployments.get(ENGINE_DEPLOYMENT) if app is not None else None
            running = int(engine.replica_states.get("RUNNING", 0)) if engine is not None else 0
            if min(running, replicas) > bar.n:
                bar.update(min(running, replicas) - bar.n)
            if deploy_error:
                raise deploy_error[0]
            if state == "RUNNING" and not deployer.is_alive():
                return
            if state in ("DEPLOY_FAILED", "UNHEALTHY"):
                raise RuntimeError(f"the fleet did not start ({state}): {app.message}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fleet is still {state} after {timeout_s:.0f} s")
            time.sleep(0.2)


# ---------------------------------------------------------------------------- the autoscale demo
def replica_count_path(timeline: list[tuple[float, int, str]]) -> list[int]:
    """The running-replica counts the monitor saw, repeats dropped: [1, 2, 1] for a scale up then down."""
    path: list[int] = []
    for _, running, text in timeline:
        if text.startswith(("replicas:", "autoscaler decided:")) and running and (not path or path[-1] != running):
            path.append(running)
    return path


def _print_new(fleet: Fleet, printed: int, out) -> int:
    events = fleet.timeline()
    for t, running, text in events[printed:]:
        print(f"  t={t:7.2f} s  [{running} running]  {text}", file=out, flush=True)
    return len(events)


def autoscale_demo(fleet: Fleet, *, high_clients: int = 8, max_tokens: int = 32, low_s: float = 3.0,
                   hold_s: float = 4.0, timeout_s: float = 240.0, out=sys.stdout) -> list[int]:
    """A load ramp against an autoscaling fleet: one client for `low_s`, then `high_clients` clients until a second
    replica runs (plus `hold_s`), then none until the fleet is back to its minimum. Prints the timeline as it
    happens; returns replica_count_path(fleet.timeline()), e.g. [1, 2, 1]."""
    if fleet.autoscaling is None:
        raise ValueError("autoscale_demo needs a fleet started with autoscaling=AutoscalingConfig(...)")
    import httpx

    low, high = fleet.autoscaling.min_replicas, fleet.autoscaling.max_replicas
    clients = {"n": 1}
    stop = threading.Event()
    done = {"requests": 0, "failed": 0}

    async def client(index: int) -> None:
        async with httpx.AsyncClient(timeout=120.0) as http:
            while not stop.is_set():
                if index >= clients["n"]:
                    await asyncio.sleep(0.05)
                    continue
                body = {"prompt": [100 + (index * 7 + k) % 300 for k in range(12)], "max_tokens": max_tokens,
                        "ignore_eos": True, "stream": True}
                try:
                    async with http.stream("POST", fleet.base_url + "/v1/completions", json=body) as response:
                        async for _ in response.aiter_lines():
                            pass
                    done["requests"] += 1
                except httpx.HTTPError:
                    done["failed"] += 1

    async def load() -> None:
        await asyncio.gather(*(client(i) for i in range(high_clients)))

    loader = threading.Thread(target=asyncio.run, args=(load(),), name="minillm-fleet-load", daemon=True)
    printed = _print_new(fleet, 0, out)
    t0 = time.monotonic()

    def phase(text: str) -> None:
        print(f"  t={time.time() - fleet.started_at:7.2f} s  load: {text}", file=out, flush=True)

    def wait(predicate, seconds: float) -> bool:
        nonlocal printed
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            printed = _print_new(fleet, printed, out)
            if predicate():
                return True
            time.sleep(0.5)
        return predicate()

    try:
        phase(f"1 streaming client ({max_tokens} tokens per request) for {low_s:.0f} s")
        loader.start()
        wait(lambda: False, low_s)
        clients["n"] = high_clients
        phase(f"{high_clients} streaming clients (target {fleet.autoscaling.target_ongoing_requests:g} ongoing "
              f"requests per replica) until {high} replicas run")
        if not wait(lambda: fleet.num_replicas() >= high, timeout_s):
            raise TimeoutError(f"the fleet did not scale to {high} replicas within {timeout_s:.0f} s")
        wait(lambda: False, hold_s)
        clients["n"] = 0
        phase(f"no clients until the fleet is back to {low} replica(s)")
        if not wait(lambda: fleet.num_replicas() <= low, timeout_s):
            raise TimeoutError(f"the fleet did not scale back to {low} replica(s) within {timeout_s:.0f} s")
        wait(lambda: False, 1.0)
    finally:
        stop.set()
        loader.join(30.0)
        _print_new(fleet, printed, out)
    path = replica_count_path(fleet.timeline())
    print(f"replica count: {' -> '.join(map(str, path))} over {time.monotonic() - t0:.0f} s "
          f"({done['requests']} requests served, {done['failed']} failed)", file=out, flush=True)
    return path


# ---------------------------------------------------------------------------- minillm fleet
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minillm fleet", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="multi-machine: `ray start --head` on one machine, `ray start "
                                       "--address=HEAD:6379` on the others, then this command with --address HEAD:6379")
    p.add_argument("--model", default=None, help="HF directory, hub id or random:PRESET (default: SmolLM2-135M)")
    p.add_argument("--num-replicas", type=int, default=None, help="a fixed fleet of N replicas (default 2)")
    p.add_argument("--min-replicas", type=int, default=None, help="autoscale: fewest replicas (default 1)")
    p.add_argument("--max-replicas", type=int, default=None, help="autoscale: most replicas (default 2)")
    p.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscale: requests running or queued per replica that Serve aims at (default 4; demo 2)")
    p.add_argument("--upscale-delay-s", type=float, default=None, help="autoscale: default 5 (demo 1)")
    p.add_argument("--downscale-delay-s", type=float, default=None, help="autoscale: default 30 (demo 3)")
    p.add_argument("--max-ongoing-requests", type=int, default=16, help="most requests one replica is sent at once")
    p.add_argument("--threads-per-replica", type=int, default=1, help="torch threads (and Ray CPUs) per replica")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: a free one)")
    p.add_argument("--host", default="127.0.0.1", help="where Ray's HTTP proxy listens (0.0.0.0: every interface)")
    p.add_argument("--address", default=None, help="an existing Ray cluster (HOST:6379 or auto); default: a local one")
    p.add_argument("--set", nargs="*", metavar="LEVER=VALUE", help="engine levers, e.g. max_num_seqs=8")
    p.add_argument("--demo-autoscale", action="store_true",
                   help="autoscale 1..2 replicas, run a load ramp up then down, print the 1 -> 2 -> 1 timeline, exit")
    p.add_argument("--run-s", type=float, default=None, help="serve this many seconds, then stop (default: Ctrl-C)")
    return p


AUTOSCALE_FLAGS = ("min_replicas", "max_replicas", "target_ongoing_requests", "upscale_delay_s", "downscale_delay_s")


def fleet_kwargs(args: argparse.Namespace) -> dict:
    """start_fleet's keyword arguments from the parsed flags; ValueError naming a bad value or a conflict."""
    from ..levers import parse_levers

    levers = parse_levers(args.set or [])
    if args.model is not None:
        levers["model"] = args.model
    given = {name: getattr(args, name) for name in AUTOSCALE_FLAGS if getattr(args, name) is not None}
    if given and args.num_replicas is not None:
        flag = "--" + next(iter(given)).replace("_", "-")
        raise ValueError(f"--num-replicas={args.num_replicas} is a fixed fleet; {flag} is for an autoscaling one: "
                         "give one or the other")
    kwargs = dict(levers=levers, port=args.port, host=args.host, address=args.address,
                  threads_per_replica=args.threads_per_replica, max_ongoing_requests=args.max_ongoing_requests)
    if given or args.demo_autoscale:
        defaults = dict(target_ongoing_requests=2.0, upscale_delay_s=1.0, downscale_delay_s=3.0,
                        metrics_interval_s=0.5, look_back_period_s=2.0) if args.demo_autoscale else {}
        kwargs["autoscaling"] = AutoscalingConfig(**{**defaults, **given})
        kwargs["num_replicas"] = None
    else:
        kwargs["num_replicas"] = args.num_replicas if args.num_replicas is not None else 2
    return kwargs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        kwargs = fleet_kwargs(args)
        _check_fleet_args(kwargs["num_replicas"], kwargs.get("autoscaling"), kwargs["port"],
                          kwargs["threads_per_replica"], kwargs["max_ongoing_requests"])
    except ValueError as exc:
        print(f"minillm fleet: {exc}", file=sys.stderr)
        return 2
    what = (f"{kwargs['num_replicas']} replicas" if kwargs["num_replicas"] is not None else
            "autoscaling " + json.dumps(kwargs["autoscaling"].to_ray()))
    print(f"starting a fleet ({what}) on {'Ray at ' + args.address if args.address else 'a local Ray cluster'}...",
          flush=True)
    t0 = time.monotonic()
    try:
        fleet = start_fleet(**kwargs)
    except (ValueError, TypeError) as exc:   # a bad lever (--set, --model): refused before any replica starts
        print(f"minillm fleet: {exc}", file=sys.stderr)
        return 2
    with fleet:
        print(f"ready in {time.monotonic() - t0:.1f} s at {fleet.base_url} (OpenAI routes under /v1)")
        print("replica start-up (process start + weight load):")
        for s in fleet.startup_times():
            print(f"  {s['replica']} on node {s['node']} (pid {s['pid']}): {s['process_start_s']:.1f} s + "
                  f"{s['weight_load_s']:.1f} s = {s['total_s']:.1f} s")
        if args.demo_autoscale:
            path = autoscale_demo(fleet)
            low, high = fleet.autoscaling.min_replicas, fleet.autoscaling.max_replicas
            return 0 if path[:1] == [low] and high in path and path[-1] == low else 1
        print("timeline (Ctrl-C stops the fleet):")
        printed = 0
        deadline = None if args.run_s is None else time.monotonic() + args.run_s
        try:
            while deadline is None or time.monotonic() < deadline:
                printed = _print_new(fleet, printed, sys.stdout)
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
        print("stopping the fleet")
    return 0


if __name__ == "__main__":
    sys.exit(main())

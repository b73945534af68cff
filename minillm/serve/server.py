"""serve_in_thread: an OpenAI-compatible server on an existing LLM, in a background thread.

    from minillm import LLM
    from minillm.serve import serve_in_thread

    llm = LLM()
    with serve_in_thread(llm) as server:          # port 0: a free port
        client = openai.OpenAI(base_url=server.base_url, api_key="none")
        ...

The server chunks long prompts (chunked_prefill=True, as the engine does by default; minillm/serve/chunking.py
adds a cap per prompt) so that no request waits behind another's whole prefill; `llm` gets its own levers back
at close(). Uvicorn runs its own event loop in its own thread, so this works inside a Jupyter kernel
(whose loop is already running in the main thread). While the server runs, its engine thread
owns `llm.engine`: do not call llm.generate() until close().
"""

from __future__ import annotations

import os
import socket
import threading
import time
from typing import TYPE_CHECKING

from .app import build_app
from .async_engine import AsyncEngine
from .chunking import server_levers

if TYPE_CHECKING:
    from ..llm import LLM

STARTUP_TIMEOUT_S = 30.0


def default_model_name(llm: "LLM") -> str:
    """The name clients pass as `model`: the model argument as given, else the model directory's name."""
    model = llm.config.model
    if model:
        return model.rstrip("/") if not os.path.isdir(model) else os.path.basename(os.path.normpath(model))
    return os.path.basename(os.path.normpath(str(llm.engine.model_path)))


def _bind(host: str, port: int) -> socket.socket:
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({exc}); pick another --port, or 0 for a free one") from None
    sock.set_inheritable(True)
    return sock


class ServerHandle:
    """A running server: `.base_url` ("http://127.0.0.1:54321/v1") for OpenAI clients, `.url`, `.port`, `.close()`."""

    def __init__(self, llm: "LLM", host: str = "127.0.0.1", port: int = 0, model_name: str | None = None,
                 log_level: str = "warning", lora_modules=None, chunked_prefill: bool | None = True,
                 max_num_batched_tokens: int | None = None):
        import uvicorn

        self.llm = llm
        self.model_name = model_name or default_model_name(llm)
        self.lora_modules = lora_modules_from(lora_modules, llm, self.model_name)
        self.async_engine = AsyncEngine(llm, levers=server_levers(llm.engine, chunked_prefill, max_num_batched_tokens))
        self.app = build_app(self.async_engine, self.model_name, self.lora_modules)
        try:
            self._socket = _bind(host, port)
        except OSError:
            self.async_engine.shutdown()
            raise
        self.host = host
        self.port = self._socket.getsockname()[1]
        shown_host = "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)
        self.url = f"http://{shown_host}:{self.port}"
        self.base_url = self.url + "/v1"
        config = uvicorn.Config(self.app, log_level=log_level, lifespan="off", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name="minillm-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the server on {self.url} did not start: {self._error!r}")
            time.sleep(0.01)

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._socket])  # its own event loop, in this thread
        except BaseException as exc:
            self._error = exc

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and self.async_engine.is_running

    def close(self, timeout_s: float = 30.0) -> None:
        """Abort what is in flight, stop the server and the engine thread; `llm` is usable again after."""
        self.async_engine.shutdown(timeout_s)       # open streams get their last event and end
        self._server.should_exit = True
        self._thread.join(timeout_s)
        self._socket.close()

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "running" if self.running else "closed"
        return f"ServerHandle({self.model_name!r} at {self.base_url}, {state})"


def serve_in_thread(llm: "LLM", host: str = "127.0.0.1", port: int = 0, model_name: str | None = None,
                    log_level: str = "warning", lora_modules=None, chunked_prefill: bool | None = True,
                    max_num_batched_tokens: int | None = None) -> ServerHandle:
    """Start the OpenAI-compatible server on `llm` in a background thread; returns once it accepts connections.
    `lora_modules`: {name: path}, ["name=path", ...] or [LoRARequest, ...] (an LLM built with enable_lora=True): a
    request's `model` field selects an adapter by its name. `chunked_prefill` (default True, as vLLM serves,
    with long_prefill_token_threshold at half the budget; None: as `llm` was built) and `max_num_batched_tokens`
    (None: as built, or 512 on a CPU and 2048 on a GPU when the server turns chunking on) hold while the server
    runs; close() gives `llm` back with its own levers."""
    return ServerHandle(llm, host, port, model_name, log_level, lora_modules, chunked_prefill, max_num_batched_tokens)


def lora_modules_from(modules, llm: "LLM", model_name: str) -> dict:
    """{name: LoRARequest} from {name: path} or ["name=path", ...] (vLLM's --lora-modules), ids 1, 2, ... in order;
    each adapter is read and checked against the model now. ValueError naming a bad entry."""
    from ..lora import LoRARequest

    if not modules:
        return {}
    if not isinstance(modules, dict) and all(isinstance(m, LoRARequest) for m in modules):
        requests = {m.lora_name: m for m in modules}   # LoRARequests as they are (their own ids)
        for request in requests.values():
            llm.engine.validate_lora(request)
        return requests
    if not isinstance(modules, dict):
        pairs = {}
        for entry in modules:
            name, sep, path = str(entry).partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules entry {entry!r} must be name=path")
            if name in pairs:
                raise ValueError(f"--lora-modules names {name!r} twice")
            pairs[name] = path
        modules = pairs
    if model_name in modules:
        raise ValueError(f"--lora-modules name {model_name!r} is the base model's name; give the adapter another")
    requests = {name: LoRARequest(name, i, path) for i, (name, path) in enumerate(modules.items(), start=1)}
    for request in requests.values():
        llm.engine.validate_lora(request)
    return requests

"""An ASGI app served by uvicorn in a daemon thread on a free loopback port, for the fake servers the
benchmark tests point `minillm bench serve` at (pytest puts tests/ on sys.path)."""

from __future__ import annotations

import socket
import threading
import time


class AppInThread:
    """`with Subclass(...) as server:` serves `self._app` (set by the subclass) on 127.0.0.1:`server.port`."""

    _app = None
    name = "the fake server"

    def __enter__(self):
        import uvicorn

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self._app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, f"{self.name} did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)

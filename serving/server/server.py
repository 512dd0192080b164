"""Running the OpenAI-compatible server under uvicorn: blocking (`serve`) or in a thread
(`ServerThread`, for tests and the load benchmark).

Graceful shutdown (SIGINT/SIGTERM, or `ServerThread.stop`): the server marks itself
draining at once (new requests get 503, /health says "draining"), stops accepting
connections, lets in-flight requests finish for up to `graceful_timeout_s`, then stops the
engine worker, which fails whatever is still queued.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import uvicorn

from specheads.serving.server.app import create_app
from specheads.serving.server.state import ServeConfig, ServerState


class _Server(uvicorn.Server):
    """uvicorn's server, draining the app before its own shutdown steps."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.specheads_state = state

    async def shutdown(self, sockets=None) -> None:
        self.specheads_state.draining = True
        await super().shutdown(sockets)


def make_server(config: ServeConfig, loader: Callable[[], tuple], *, host: str = "127.0.0.1", port: int = 8000,
                graceful_timeout_s: float = 30.0, log_level: str = "info") -> tuple[_Server, ServerState]:
    """A uvicorn server for the app; the model loads once it runs."""
    state = ServerState(config=config, loader=loader)
    uv_config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level, lifespan="on",
                               timeout_graceful_shutdown=int(max(1, graceful_timeout_s)), access_log=False)
    return _Server(uv_config, state), state


def serve(config: ServeConfig, loader: Callable[[], tuple], *, host: str = "127.0.0.1", port: int = 8000,
          graceful_timeout_s: float = 30.0, log_level: str = "info") -> None:
    """Serve until SIGINT/SIGTERM (blocking)."""
    server, _ = make_server(config, loader, host=host, port=port, graceful_timeout_s=graceful_timeout_s,
                            log_level=log_level)
    server.run()


class ServerThread:
    """A server on 127.0.0.1 and a free port, in a background thread."""

    def __init__(self, config: ServeConfig, loader: Callable[[], tuple], *, graceful_timeout_s: float = 5.0,
                 log_level: str = "warning"):
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.server, self.state = make_server(config, loader, host="127.0.0.1", port=self.port,
                                              graceful_timeout_s=graceful_timeout_s, log_level=log_level)
        self._thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._socket]},
                                        name="specheads-uvicorn", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0, wait_ready: bool = True) -> "ServerThread":
        """Start; with wait_ready, block until the model is loaded (or raise why not)."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.server.started and (not wait_ready or self.state.status != "loading"):
                break
            if not self._thread.is_alive():
                raise RuntimeError("the server thread exited during startup")
            time.sleep(0.02)
        else:
            raise TimeoutError(f"the server did not start within {timeout_s}s")
        if wait_ready and self.state.status != "ready":
            self.stop()
            raise RuntimeError(f"the model failed to load: {self.state.error}")
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Graceful shutdown: in-flight requests finish (up to the graceful timeout)."""
        self.server.should_exit = True
        self._thread.join(timeout_s)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

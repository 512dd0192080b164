"""Running the OpenAI-compatible server under uvicorn: blocking (`serve`) or in a thread
(`ServerThread`, for tests and the load benchmark).

Graceful shutdown (SIGINT/SIGTERM, or `ServerThread.stop`): the server marks itself
draining at once (new requests get 503, /health says "draining"), stops accepting
connections and lets in-flight requests finish for up to `graceful_timeout_s`. Requests
still running then get a 503 with an OpenAI error body, code "shutting_down" (a stream: an
error event, then `data: [DONE]`), and their work is dropped; then the engine worker stops.
uvicorn would cancel them instead, answering a plain-text 500 or cutting a stream off; it
still does so CUTOFF_MARGIN_S later for a response that cannot be sent (a client that stopped
reading). `serve` then returns, so `specheads serve` exits 0 after SIGTERM or Ctrl-C (uvicorn
alone would re-raise the signal: exit status 143, or a KeyboardInterrupt); a second Ctrl-C
skips the wait. A model that fails to load stops `serve` the same way, and its state says so
(`specheads serve` then exits non-zero).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
import socket
import threading
import time
from typing import Callable

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from specheads.serving.server.app import create_app
from specheads.serving.server.state import ServeConfig, ServerState


log = logging.getLogger("specheads.serve")
CUTOFF_MARGIN_S = 5  # after the grace period, how long the 503s get to be sent before uvicorn cancels


class _Server(uvicorn.Server):
    """uvicorn's server, draining the app before its own shutdown steps and answering what
    still runs when the grace period ends (module doc)."""

    def __init__(self, config: uvicorn.Config, state: ServerState, graceful_timeout_s: float):
        super().__init__(config)
        self.specheads_state = state
        self.graceful_timeout_s = graceful_timeout_s

    async def shutdown(self, sockets=None) -> None:
        self.specheads_state.draining = True
        cutoff = asyncio.create_task(self._cut_off_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            cutoff.cancel()

    async def _cut_off_after_grace(self) -> None:
        await asyncio.sleep(self.graceful_timeout_s)
        count = self.specheads_state.cut_off_in_flight()
        if count:
            log.warning("the shutdown grace period (%gs) ended: %d request(s) still running got a 503",
                        self.graceful_timeout_s, count)

    @contextlib.contextmanager
    def capture_signals(self):
        """SIGINT/SIGTERM start the graceful shutdown (a second SIGINT forces it), and `run`
        then returns instead of re-raising the signal as uvicorn does: the exit status is 0."""
        if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def make_server(config: ServeConfig, loader: Callable[[], tuple], *, host: str = "127.0.0.1", port: int = 8000,
                graceful_timeout_s: float = 30.0, log_level: str = "info") -> tuple[_Server, ServerState]:
    """A uvicorn server for the app; the model loads once it runs."""
    if not graceful_timeout_s > 0:
        raise ValueError(f"graceful_timeout_s must be > 0, got {graceful_timeout_s}")
    state = ServerState(config=config, loader=loader)
    uv_config = uvicorn.Config(create_app(state), host=host, port=port, log_level=log_level, lifespan="on",
                               timeout_graceful_shutdown=math.ceil(graceful_timeout_s) + CUTOFF_MARGIN_S,
                               access_log=False)
    return _Server(uv_config, state, graceful_timeout_s), state


def serve(config: ServeConfig, loader: Callable[[], tuple], *, host: str = "127.0.0.1", port: int = 8000,
          graceful_timeout_s: float = 30.0, log_level: str = "info") -> ServerState:
    """Serve until SIGINT/SIGTERM, or until the model fails to load (blocking); returns the
    state once drained (module doc): its status is "failed" when the model did not load."""
    server, state = make_server(config, loader, host=host, port=port, graceful_timeout_s=graceful_timeout_s,
                                log_level=log_level)
    state.on_failed = lambda: setattr(server, "should_exit", True)
    server.run()
    return state


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

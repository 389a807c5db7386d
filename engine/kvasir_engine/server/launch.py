"""`run_server`: load the engine, open the port, serve, and drain on SIGTERM.

The model loads (and a configuration that cannot work fails) before the port opens, on a helper
thread that has ended before the engine thread steps it (`run_in_own_thread`). SIGTERM turns
`/ready` and new requests to 503 at once, lets in-flight requests finish for up to
`--shutdown-grace-seconds`, aborts what is left, then stops uvicorn and exits 0. A second signal
falls back to uvicorn's own handling.

A tensor-parallel rank that dies (even while the server is idle) is fatal: the executor's watchdog
reports it, `/health` and `/ready` turn 503 and open streams fail at once, and the process exits
1 a moment later, so the orchestrator restarts it instead of routing to a server that cannot
generate. So is an engine loop that dies (a step raised an error that is not one request's:
those fail alone, `RequestError`).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

import uvicorn

from kvasir_engine.config import EngineConfig
from kvasir_engine.server.api import create_app
from kvasir_engine.server.config import ServerConfig
from kvasir_engine.server.connections import uvicorn_config
from kvasir_engine.server.state import ServerState

logger = logging.getLogger(__name__)

# Between a fatal engine failure and the exit: long enough for a probe to read the 503.
FATAL_EXIT_DELAY_S = 1.0

T = TypeVar("T")


def run_in_own_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on a new thread that has ended when this returns (or raises).

    Why the model loads this way: OpenMP (libgomp, in torch's CPU build) gives each thread that
    runs a parallel region a worker pool of its own, and while the process holds more pool
    threads than cores its workers spin only ~100 times before sleeping on a futex. A pool left
    on the main thread by the load made every parallel region of the engine thread wake a
    sleeping worker (~45 us each on this 2-core VM): a decode step took ~29 ms instead of the
    offline ~18 ms. A thread's pool is freed when the thread ends, so the engine thread's is
    then the only one.
    """
    outcome: list[T] = []
    failure: list[BaseException] = []

    def target() -> None:
        try:
            outcome.append(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - re-raised on the calling thread
            failure.append(e)

    # Daemon: Ctrl-C during a long load still ends the process at once.
    thread = threading.Thread(target=target, name="kvasir-load", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]


class FailureRelay:
    """Hands an executor failure to the server; it may be reported (from the executor's
    watchdog thread) before the server exists, and reaches the handler exactly once."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._message: str | None = None
        self._handler: Callable[[str], None] | None = None

    def report(self, message: str) -> None:
        with self._lock:
            if self._message is not None:
                return
            self._message, handler = message, self._handler
        if handler is not None:
            handler(message)

    def attach(self, handler: Callable[[str], None]) -> None:
        with self._lock:
            self._handler, message = handler, self._message
        if message is not None:
            handler(message)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self.exit_code = 0

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def fail(self, message: str) -> None:
        """From any thread: the engine cannot go on; turn unhealthy now, exit 1 shortly."""
        logger.error("fatal engine failure, exiting: %s", message)
        self.exit_code = 1
        self.state.async_engine.mark_dead(RuntimeError(message))
        timer = threading.Timer(FATAL_EXIT_DELAY_S, self._exit_now)
        timer.daemon = True
        timer.start()

    def _exit_now(self) -> None:
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.state.is_draining and self._loop is not None:
            self.state.is_draining = True
            logger.info("SIGTERM: draining for up to %gs",
                        self.state.server_config.shutdown_grace_seconds)
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.drain()))
            return
        super().handle_exit(sig, frame)

    async def drain(self) -> None:
        engine = self.state.async_engine
        grace = self.state.server_config.shutdown_grace_seconds
        if not await engine.wait_groups_done(grace):
            logger.warning("grace period over: aborting %d requests", engine.num_active_groups)
            engine.abort_all()
            await engine.wait_groups_done(5.0)
        logger.info("drained; stopping")
        self.should_exit = True


def check_port_free(host: str, port: int) -> None:
    """Fails with one line before the model loads when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            reason = "address already in use" if e.errno == errno.EADDRINUSE else e.strerror
            raise ValueError(f"--host {host} --port {port}: cannot bind: {reason}") from None


def run_server(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvasir_engine.frontend.llm_engine import LLMEngine

    check_port_free(server_config.host, server_config.port)
    relay = FailureRelay()
    engine = run_in_own_thread(LLMEngine.from_config, engine_config,
                               on_executor_failure=relay.report)
    try:
        app = create_app(engine_config, server_config, engine, on_fatal=relay.report)
        config = uvicorn_config(app, server_config, log_level="info",
                                access_log=server_config.log_requests,
                                timeout_graceful_shutdown=5)
        server = DrainingServer(config, app.state.kvasir)
        relay.attach(server.fail)
        server.run()
    finally:
        engine.shutdown()
    return server.exit_code

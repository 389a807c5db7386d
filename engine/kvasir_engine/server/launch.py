"""`run_server`: load the engine, open the port, serve, and drain on SIGTERM.

The model loads (and a configuration that cannot work fails) before the port opens. SIGTERM turns
`/ready` and new requests to 503 at once, lets in-flight requests finish for up to
`--shutdown-grace-seconds`, aborts what is left, then stops uvicorn and exits 0. A second signal
falls back to uvicorn's own handling.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
from types import FrameType

import uvicorn

from kvasir_engine.config import EngineConfig
from kvasir_engine.server.api import create_app
from kvasir_engine.server.config import ServerConfig
from kvasir_engine.server.state import ServerState

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

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
    from kvasir_engine.llm_engine import LLMEngine

    check_port_free(server_config.host, server_config.port)
    engine = LLMEngine.from_config(engine_config)
    try:
        app = create_app(engine_config, server_config, engine)
        config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                                log_level="info", access_log=server_config.log_requests,
                                timeout_graceful_shutdown=5, lifespan="on")
        server = DrainingServer(config, app.state.kvasir)
        server.run()
    finally:
        engine.shutdown()
    return 0

"""`kvasir-gateway`: parse the flags, build the app, serve it; a bad flag is one line, exit 2."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Sequence
from types import FrameType

import uvicorn

from kvasir_gateway.app import create_app
from kvasir_gateway.config import config_from_args


class _Server(uvicorn.Server):
    """uvicorn re-raises a SIGTERM it caught once it has shut down, so a clean drain would still
    end the process by the signal (exit 143 to the kubelet). SIGTERM is how a pod is told to
    stop: after the graceful shutdown the process exits 0."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM:
            self.should_exit = True
            return
        super().handle_exit(sig, frame)


def main(argv: Sequence[str] | None = None) -> None:
    try:
        config = config_from_args(argv)
        app = create_app(config)
    except (ValueError, OSError) as exc:
        print(f"kvasir-gateway: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    _Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                           timeout_graceful_shutdown=30)).run()


if __name__ == "__main__":
    main()

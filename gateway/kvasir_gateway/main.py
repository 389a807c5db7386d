"""`kvasir-gateway`: parse the flags, build the app, serve it; a bad flag is one line, exit 2."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

import uvicorn

from kvasir_gateway.app import create_app
from kvasir_gateway.config import config_from_args


def main(argv: Sequence[str] | None = None) -> None:
    try:
        config = config_from_args(argv)
        app = create_app(config)
    except (ValueError, OSError) as exc:
        print(f"kvasir-gateway: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=config.host, port=config.port, log_level=config.log_level,
                timeout_graceful_shutdown=30)


if __name__ == "__main__":
    main()

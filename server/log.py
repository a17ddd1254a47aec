"""The engine server's log format, set up once per process: the API's and the engine core's
(server/api/cli.py, server/engine/core_proc.py) write the same lines to the same stream."""

from __future__ import annotations

import logging


def configure_logging(level: int) -> None:
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%dT%H:%M:%S",
    )

"""Run the server: one process, one uvloop event loop shared by uvicorn and the engine.

SIGTERM (or Ctrl-C) stops accepting connections, lets running requests finish for up to
--shutdown-timeout seconds, then shuts the engine down; the process exits 0.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import logging
import signal
import socket
import time
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from asyncserve.config import ServerConfig
from asyncserve.gc_heap import freeze_startup_heap
from asyncserve.http.app import build_app
from asyncserve.http.engine_client import EngineClient
from asyncserve.http.listener import EagerAcceptServer, timed_protocol
from asyncserve.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class AccessLogFilter(logging.Filter):
    """Drops uvicorn access-log lines for the given paths (query strings ignored)."""

    def __init__(self, paths: tuple[str, ...]) -> None:
        super().__init__()
        self.paths = frozenset(paths)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], str):
            return args[2].split("?", 1)[0] not in self.paths
        return True


def log_config(level: str) -> dict[str, Any]:
    config = copy.deepcopy(LOGGING_CONFIG)
    config["loggers"]["asyncserve"] = {
        "handlers": ["default"],
        "level": level.upper(),
        "propagate": False,
    }
    return config


def uvicorn_config(app: Any, config: ServerConfig) -> uvicorn.Config:
    fast = importlib.util.find_spec("uvloop") is not None
    uv = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop="uvloop" if fast else "asyncio",
        http=timed_protocol(config.timeout_request_header),  # type: ignore[arg-type]
        timeout_keep_alive=config.timeout_keep_alive,  # type: ignore[arg-type]
        limit_concurrency=config.limit_concurrency,
        lifespan="on",
        log_config=log_config(config.log_level),
        log_level=config.log_level,
        access_log=not config.disable_access_log,
        ssl_keyfile=config.ssl_keyfile,
        ssl_certfile=config.ssl_certfile,
        # Past --shutdown-timeout streams end themselves (ServerState.shutdown_deadline);
        # uvicorn cancels what is left shortly after.
        timeout_graceful_shutdown=config.shutdown_timeout + 0.5,  # type: ignore[arg-type]
        backlog=4096,
    )
    if config.disable_access_log_for_endpoints:
        logging.getLogger("uvicorn.access").addFilter(
            AccessLogFilter(config.disable_access_log_for_endpoints)
        )
    return uv


def _swallow(signum: int, frame: FrameType | None) -> None:
    """Installed under uvicorn's handlers: uvicorn re-raises the signal it shut down for once
    it is done; this keeps that from killing the process after a clean shutdown."""


def run_server(
    engine: EngineClient,
    config: ServerConfig,
    metrics: ServerMetrics | None = None,
    sock: socket.socket | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code (0 after a graceful shutdown, 1 when
    the engine failed for good). `sock`: config's host:port, bound already."""
    start = time.perf_counter()
    app = build_app(engine, config, metrics)
    logger.debug("app built in %.2f s", time.perf_counter() - start)
    server = EagerAcceptServer(uvicorn_config(app, config))
    server.bound = sock
    state = app.state.asyncserve
    state.request_exit = lambda: setattr(server, "should_exit", True)

    def start_deadline() -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(config.shutdown_timeout, state.shutdown_deadline.set)

    server.on_shutdown = start_deadline
    previous = {sig: signal.signal(sig, _swallow) for sig in (signal.SIGTERM, signal.SIGINT)}
    # The model is loaded: keep full collections from walking it while serving.
    start = time.perf_counter()
    frozen = freeze_startup_heap()
    logger.debug(
        "froze %d startup objects for the garbage collector in %.2f s",
        frozen, time.perf_counter() - start,
    )  # fmt: skip
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if not server.started:
        logger.error("the server did not start (is %s:%d in use?)", config.host, config.port)
        return 1
    if state.fatal_error is not None:
        logger.error("exiting with status 1: the engine stopped (%s)", state.fatal_error)
        return 1
    return 0

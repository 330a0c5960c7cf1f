"""`python -m meshlm.gateway [flags]`: serve the gateway with uvicorn.

SIGTERM/SIGINT: uvicorn stops accepting connections and gives in-flight requests up to
--grace-period-s (timeout_graceful_shutdown) before cancelling them (which cancels their gRPC calls,
so the tokenizers abort them).
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from meshlm.common import event_loop
from meshlm.common.cpus import batch_scheduling, serial_tokenizers
from meshlm.common.gc_heap import freeze_startup_heap
from meshlm.common.grpc_env import prefer_classic_endpoints
from meshlm.common.launcher_watch import exit_with_launcher

if TYPE_CHECKING:
    import uvicorn

    from meshlm.gateway.config import GatewayConfig

logger = logging.getLogger("meshlm.gateway")


def build_parser(prog: str = "python -m meshlm.gateway") -> argparse.ArgumentParser:
    from meshlm.gateway.config import GatewayConfig

    parser = argparse.ArgumentParser(prog=prog, description="meshlm gateway: OpenAI-compatible and SGLang-native HTTP")
    GatewayConfig.add_cli_args(parser)
    return parser


def uvicorn_config(app: Any, config: GatewayConfig) -> uvicorn.Config:
    """uvicorn's settings for the gateway: HTTP/1.1 through httptools (C parser and writer; a
    dependency of the gateway, so never h11's pure Python), the event loop of the other
    services (common/event_loop.py), our logging, the drain grace."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        http="httptools",
        loop=event_loop.loop_name(),
        log_config=None,  # our root logger (setup_logging) formats uvicorn's records too
        log_level=config.log_level.lower(),
        timeout_graceful_shutdown=math.ceil(config.grace_period_s),
        timeout_keep_alive=30,
    )


def main(argv: Sequence[str] | None = None) -> int:
    prefer_classic_endpoints()  # before the gateway's imports load grpc
    exit_with_launcher()
    serial_tokenizers()
    import uvicorn

    from meshlm.common.log import setup_logging
    from meshlm.common.telemetry import setup_telemetry, shutdown_telemetry
    from meshlm.gateway.app import create_app
    from meshlm.gateway.config import GatewayConfig

    args = build_parser().parse_args(argv)
    try:
        config = GatewayConfig.from_cli_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if config.batch_scheduling:
        batch_scheduling()
    setup_logging("gateway", config.log_level, config.log_format)
    setup_telemetry("meshlm-gateway", config.otlp_endpoint)
    logger.info("gateway on %s:%d -> tokenizers %s", config.host, config.port, ",".join(config.tokenizer_addrs))
    server = uvicorn.Server(uvicorn_config(create_app(config), config))
    freeze_startup_heap()
    # uvicorn drains on SIGTERM/SIGINT, restores the previous handlers and re-raises the signal; with
    # these the re-raise is a no-op, so a drained gateway exits 0 like the gRPC services.
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        shutdown_telemetry()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())

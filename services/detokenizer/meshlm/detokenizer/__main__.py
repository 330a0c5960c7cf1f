"""`python -m meshlm.detokenizer [flags]` (and `meshlm serve detokenizer [flags]` via `main`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from meshlm.common import event_loop
from meshlm.common.cpus import batch_scheduling, serial_tokenizers
from meshlm.common.grpc_env import prefer_classic_endpoints
from meshlm.common.launcher_watch import exit_with_launcher


def build_parser() -> argparse.ArgumentParser:
    from meshlm.detokenizer.config import DetokenizerConfig

    parser = argparse.ArgumentParser(
        prog="meshlm-detokenizer",
        description="meshlm detokenizer: incremental detokenization of scheduler outputs, "
        "streamed to each request's tokenizer replica. Every flag can also be set with the "
        "env var MESHLM_DETOKENIZER_<FLAG> (upper case, dashes as underscores); a flag wins.",
    )
    DetokenizerConfig.add_cli_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, configure logging, serve until SIGTERM/SIGINT; returns the exit status."""
    prefer_classic_endpoints()  # before the config's imports load grpc
    exit_with_launcher()
    serial_tokenizers()
    from meshlm.common.log import setup_logging
    from meshlm.detokenizer.config import DetokenizerConfig
    from meshlm.detokenizer.service import serve

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = DetokenizerConfig.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))
    if config.batch_scheduling:
        batch_scheduling()
    setup_logging("detokenizer", config.log_level, config.log_format)
    event_loop.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())

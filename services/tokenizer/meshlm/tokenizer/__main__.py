"""`python -m meshlm.tokenizer [flags]`: run the tokenizer service until SIGTERM (exit 0 after draining).

Flags: see `--help` (every TokenizerConfig field; env fallback MESHLM_TOKENIZER_<FIELD>).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from meshlm.common import event_loop
from meshlm.common.cpus import batch_scheduling, serial_tokenizers
from meshlm.common.grpc_env import prefer_classic_endpoints
from meshlm.common.launcher_watch import exit_with_launcher


def build_parser(prog: str = "python -m meshlm.tokenizer") -> argparse.ArgumentParser:
    from meshlm.tokenizer.config import TokenizerConfig

    parser = argparse.ArgumentParser(
        prog=prog,
        description="meshlm tokenizer service: TokenizerManager + meshlm.v1.TokenizerService",
    )
    TokenizerConfig.add_cli_args(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    prefer_classic_endpoints()  # before the config's imports load grpc
    exit_with_launcher()
    serial_tokenizers()
    from meshlm.tokenizer.config import TokenizerConfig

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = TokenizerConfig.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))
    if config.batch_scheduling:
        batch_scheduling()
    from meshlm.tokenizer.service import serve

    return event_loop.run(serve(config))


if __name__ == "__main__":
    sys.exit(main())

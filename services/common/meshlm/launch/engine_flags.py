"""Engine flags for CLI parsers, taken from SchedulerConfig without importing torch eagerly."""

from __future__ import annotations

import argparse


def add_engine_flags(parser: argparse.ArgumentParser) -> None:
    """Add every SchedulerConfig field as a flag (needs the scheduler extra installed)."""
    try:
        from meshlm.scheduler.config import SchedulerConfig
    except ImportError as e:  # a gateway-only install has no scheduler
        raise SystemExit(f"this command needs the scheduler component: pip install 'meshlm[scheduler]' ({e})") from e
    SchedulerConfig.add_cli_args(parser)

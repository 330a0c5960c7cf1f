"""SchedulerServiceConfig: the scheduler service's own flags (the engine's are SchedulerConfig).

Every flag of both can also come from the environment: MESHLM_SCHEDULER_<FIELD> (e.g.
MESHLM_SCHEDULER_DETOKENIZER_ADDRS=detok:30020, MESHLM_SCHEDULER_MAX_TOTAL_TOKENS=8192), the
meshlm.common.flags way. Precedence: command line > environment > default. The shared fields
(host, port, logging, OTLP, grace period, metrics/health ports, tls) are GrpcServiceConfig's;
`tls` secures the gRPC server and the Push client to the detokenizers.
"""

from __future__ import annotations

import argparse
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from meshlm.common.addresses import parse_addresses
from meshlm.common.flags import Flag
from meshlm.common.service_config import GrpcServiceConfig, need
from meshlm.scheduler.config import SchedulerConfig

ENV_PREFIX = "MESHLM_SCHEDULER_"
DEFAULT_PORT = 30010


@dataclass(frozen=True)
class SchedulerServiceConfig(GrpcServiceConfig):
    """The scheduler service's own fields after the shared ones. Invariants: address lists are
    host:port, load_report_interval_s and detokenizer_timeout_s are > 0."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX
    COMPONENT: ClassVar[str] = "scheduler service"
    FLAGS: ClassVar[Mapping[str, Flag]] = MappingProxyType(
        {
            **GrpcServiceConfig.FLAGS,
            "scheduler_id": Flag("this scheduler's id; unset = <hostname>-<port>"),
            "detokenizer_addrs": Flag(
                "comma-separated host:port list of detokenizers (names are re-resolved: headless services)"
            ),
            "decode_addrs": Flag(
                "with --disaggregation-mode prefill: comma-separated host:port list of decode "
                "schedulers to hand prefilled requests to (names are re-resolved: headless "
                "services)"
            ),
            "load_report_interval_s": Flag("SchedulerLoad period on Connect streams while busy; idle 4x"),
            "detokenizer_timeout_s": Flag("fail requests whose outputs found no detokenizer for this long"),
        }
    )

    port: int = DEFAULT_PORT
    scheduler_id: str | None = None  # default <hostname>-<port>
    detokenizer_addrs: tuple[str, ...] = ()  # host:port list; headless-service names re-resolved
    decode_addrs: tuple[str, ...] = ()  # prefill role: decode schedulers (host:port, re-resolved)
    load_report_interval_s: float = 0.5  # SchedulerLoad on Connect streams while busy (idle: 4x)
    detokenizer_timeout_s: float = 10.0  # fail outputs that found no detokenizer for this long

    def __post_init__(self) -> None:
        for name in ("detokenizer_addrs", "decode_addrs"):
            object.__setattr__(self, name, tuple(parse_addresses(list(getattr(self, name)))))
        super().__post_init__()
        need(
            self.load_report_interval_s > 0,
            f"load_report_interval_s must be > 0, got {self.load_report_interval_s}",
        )
        need(
            self.detokenizer_timeout_s > 0,
            f"detokenizer_timeout_s must be > 0, got {self.detokenizer_timeout_s}",
        )

    def resolved_scheduler_id(self, port: int | None = None) -> str:
        return self.scheduler_id or f"{socket.gethostname()}-{self.port if port is None else port}"


def build_parser(
    prog: str = "meshlm serve scheduler", environ: Mapping[str, str] | None = None
) -> argparse.ArgumentParser:
    """The service's flags and the engine's, every one defaulting to MESHLM_SCHEDULER_<FLAG>."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="The meshlm scheduler service (engine + gRPC).",
    )
    SchedulerServiceConfig.add_cli_args(parser, environ)
    SchedulerConfig.add_cli_args(parser, ENV_PREFIX, environ)
    return parser


def parse_args(
    argv: Sequence[str] | None = None,
) -> tuple[SchedulerServiceConfig, SchedulerConfig]:
    ns = build_parser().parse_args(argv)
    try:
        return SchedulerServiceConfig.from_cli_args(ns), SchedulerConfig.from_cli_args(ns)
    except ValueError as e:
        raise SystemExit(f"invalid configuration: {e}") from None

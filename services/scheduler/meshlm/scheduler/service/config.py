"""SchedulerServiceConfig: the scheduler service's own flags (the engine's are SchedulerConfig).

Every flag of both can also come from the environment: MESHLM_SCHEDULER_<FIELD> (e.g.
MESHLM_SCHEDULER_DETOKENIZER_ADDRS=detok:30020, MESHLM_SCHEDULER_MAX_TOTAL_TOKENS=8192).
Precedence: command line > environment > default. `tls` is the three --tls-* flags of
meshlm.common.tls (the gRPC server and the Push client to the detokenizers).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from dataclasses import dataclass, fields
from typing import Any, Optional, Sequence

from meshlm.common.addresses import parse_addresses
from meshlm.common.tls import (
    PLAINTEXT,
    TlsConfig,
    add_health_port_cli_arg,
    add_tls_cli_args,
    validate_health_port,
)
from meshlm.scheduler.config import SchedulerConfig

ENV_PREFIX = "MESHLM_SCHEDULER_"
DEFAULT_PORT = 30010
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class SchedulerServiceConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    scheduler_id: Optional[str] = None  # default <hostname>-<port>
    detokenizer_addrs: tuple[str, ...] = ()  # host:port list; headless-service names re-resolved
    decode_addrs: tuple[str, ...] = ()  # prefill role: decode schedulers (host:port list, re-resolved)
    metrics_port: Optional[int] = None  # Prometheus /metrics over HTTP; None = off
    log_level: str = "info"
    log_format: str = "text"  # text | json
    otlp_endpoint: Optional[str] = None  # OTLP/gRPC span exporter; None = no export
    grace_period_s: float = 30.0  # SIGTERM: how long running requests may finish
    load_report_interval_s: float = 0.5  # SchedulerLoad on Connect streams while busy (idle: 4x)
    detokenizer_timeout_s: float = 10.0  # fail requests whose outputs found no detokenizer for this long
    health_port: Optional[int] = None  # plaintext grpc.health.v1-only port for probes; None = off
    tls: TlsConfig = PLAINTEXT  # of the gRPC server and the Push client

    def __post_init__(self) -> None:
        object.__setattr__(self, "detokenizer_addrs", tuple(parse_addresses(list(self.detokenizer_addrs))))
        object.__setattr__(self, "decode_addrs", tuple(parse_addresses(list(self.decode_addrs))))
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s}")
        if self.load_report_interval_s <= 0:
            raise ValueError(f"load_report_interval_s must be > 0, got {self.load_report_interval_s}")
        if self.detokenizer_timeout_s <= 0:
            raise ValueError(f"detokenizer_timeout_s must be > 0, got {self.detokenizer_timeout_s}")
        validate_health_port(self.health_port, self.port)

    def replace(self, **changes: Any) -> "SchedulerServiceConfig":
        return dataclasses.replace(self, **changes)

    def resolved_scheduler_id(self, port: Optional[int] = None) -> str:
        return self.scheduler_id or f"{socket.gethostname()}-{port if port is not None else self.port}"

    # ---- CLI ------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = SchedulerServiceConfig()
        parser.add_argument("--host", default=d.host, help=f"address to bind (default: {d.host})")
        parser.add_argument("--port", type=int, default=d.port, help=f"gRPC port (default: {d.port})")
        parser.add_argument("--scheduler-id", default=None, help="this scheduler's id (default: <hostname>-<port>)")
        parser.add_argument(
            "--detokenizer-addrs", default="",
            help="comma-separated host:port list of detokenizers (names are re-resolved: headless services)",
        )
        parser.add_argument(
            "--decode-addrs", default="",
            help="with --disaggregation-mode prefill: comma-separated host:port list of decode "
            "schedulers to hand prefilled requests to (names are re-resolved: headless services)",
        )
        parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
        parser.add_argument("--log-level", default=d.log_level, help=f"logging level (default: {d.log_level})")
        parser.add_argument("--log-format", default=d.log_format, choices=("text", "json"), help="log line format")
        parser.add_argument("--otlp-endpoint", default=None, help="export OpenTelemetry spans to this OTLP/gRPC endpoint")
        parser.add_argument(
            "--grace-period-s", type=float, default=d.grace_period_s,
            help=f"on SIGTERM, time running requests get to finish (default: {d.grace_period_s})",
        )
        parser.add_argument(
            "--load-report-interval-s", type=float, default=d.load_report_interval_s,
            help=f"SchedulerLoad period on Connect streams while busy; idle 4x (default: {d.load_report_interval_s})",
        )
        parser.add_argument(
            "--detokenizer-timeout-s", type=float, default=d.detokenizer_timeout_s,
            help="fail requests whose outputs found no detokenizer for this long "
            f"(default: {d.detokenizer_timeout_s})",
        )
        add_health_port_cli_arg(parser, ENV_PREFIX)
        add_tls_cli_args(parser, ENV_PREFIX)

    @staticmethod
    def from_cli_args(ns: argparse.Namespace) -> "SchedulerServiceConfig":
        kw = {f.name: getattr(ns, f.name) for f in fields(SchedulerServiceConfig) if f.name != "tls"}
        kw["tls"] = TlsConfig.from_cli_args(ns)
        kw["detokenizer_addrs"] = tuple(parse_addresses(kw["detokenizer_addrs"] or ""))
        kw["decode_addrs"] = tuple(parse_addresses(kw["decode_addrs"] or ""))
        return SchedulerServiceConfig(**kw)


def build_parser(prog: str = "meshlm serve scheduler") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="The meshlm scheduler service (engine + gRPC). Every flag can also be set "
        f"as {ENV_PREFIX}<FLAG> (dashes as underscores, upper case).",
    )
    SchedulerServiceConfig.add_cli_args(parser)
    SchedulerConfig.add_cli_args(parser)
    apply_env_defaults(parser, ENV_PREFIX)
    return parser


def apply_env_defaults(parser: argparse.ArgumentParser, prefix: str, environ: Optional[dict[str, str]] = None) -> None:
    """Make PREFIX<DEST> environment variables the defaults of the parser's flags."""
    env = os.environ if environ is None else environ
    defaults: dict[str, Any] = {}
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help",):
            continue
        raw = env.get(prefix + action.dest.upper())
        if raw is None:
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            low = raw.strip().lower()
            if low not in _TRUE | _FALSE:
                raise SystemExit(f"{prefix}{action.dest.upper()} must be true or false, got {raw!r}")
            defaults[action.dest] = low in _TRUE
        elif action.type is not None:
            try:
                defaults[action.dest] = action.type(raw)  # type: ignore[misc]
            except (TypeError, ValueError):
                raise SystemExit(f"{prefix}{action.dest.upper()}: invalid value {raw!r}") from None
        else:
            defaults[action.dest] = raw
    parser.set_defaults(**defaults)


def parse_args(argv: Optional[Sequence[str]] = None) -> tuple[SchedulerServiceConfig, SchedulerConfig]:
    ns = build_parser().parse_args(argv)
    try:
        return SchedulerServiceConfig.from_cli_args(ns), SchedulerConfig.from_cli_args(ns)
    except ValueError as e:
        raise SystemExit(f"invalid configuration: {e}") from None

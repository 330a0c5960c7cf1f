"""DetokenizerConfig: the detokenizer's flags, each with an env-var fallback, frozen after parsing.

Precedence: command-line flag, then `MESHLM_DETOKENIZER_<FIELD>` (e.g. MESHLM_DETOKENIZER_PORT),
then the default. `tls` is the three --tls-* flags of meshlm.common.tls.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from meshlm.common.tls import (
    PLAINTEXT,
    TlsConfig,
    add_health_port_cli_arg,
    add_tls_cli_args,
    validate_health_port,
)

ENV_PREFIX = "MESHLM_DETOKENIZER_"
LOG_FORMATS = ("text", "json")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


@dataclass(frozen=True)
class DetokenizerConfig:
    """Every field is a flag (`--tokenizer-path` style; tls: the --tls-* flags). Invariants:
    tokenizer_path is set, ports are in [0, 65535] (health_port: off or [1, 65535], not port),
    max_states >= 1, hold and grace times are >= 0, tls is a validated TlsConfig."""

    tokenizer_path: str = ""
    host: str = "0.0.0.0"
    port: int = 50053
    metrics_port: Optional[int] = None
    log_level: str = "info"
    log_format: str = "text"
    otlp_endpoint: Optional[str] = None
    grace_period_s: float = 10.0
    max_states: int = 65536
    undelivered_hold_s: float = 10.0
    health_port: Optional[int] = None
    tls: TlsConfig = PLAINTEXT

    def __post_init__(self) -> None:
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        need(
            bool(self.tokenizer_path),
            f"tokenizer_path is required: pass --tokenizer-path or set {env_name('tokenizer_path')} "
            f"(a Hugging Face tokenizer directory with tokenizer.json)",
        )
        need(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None:
            need(
                0 <= self.metrics_port <= 65535,
                f"metrics_port must be in [0, 65535], got {self.metrics_port}",
            )
        need(
            self.log_format in LOG_FORMATS,
            f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}",
        )
        need(self.grace_period_s >= 0, f"grace_period_s must be >= 0, got {self.grace_period_s}")
        need(self.max_states >= 1, f"max_states must be >= 1, got {self.max_states}")
        need(
            self.undelivered_hold_s >= 0,
            f"undelivered_hold_s must be >= 0, got {self.undelivered_hold_s}",
        )
        validate_health_port(self.health_port, self.port)

    # ---- CLI ------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser, env: Optional[Mapping[str, str]] = None
    ) -> None:
        """One flag per field; a flag's default is its env var when set, else the field default."""
        environ = os.environ if env is None else env
        helps = {
            "tokenizer_path": "Hugging Face tokenizer directory (holding tokenizer.json); required",
            "host": "address to bind the gRPC server to",
            "port": "gRPC port (0: any free port)",
            "metrics_port": "serve Prometheus /metrics over HTTP on this port (unset: off)",
            "log_level": "debug | info | warning | error",
            "log_format": "text | json",
            "otlp_endpoint": "export OpenTelemetry spans to this OTLP/gRPC endpoint (host:port)",
            "grace_period_s": "seconds to drain on SIGTERM before stopping",
            "max_states": "most requests with a decode state (least recently used are evicted)",
            "undelivered_hold_s": "seconds to hold outputs for an origin with no subscriber",
        }
        types: dict[str, Callable[[str], Any]] = {
            "port": int,
            "metrics_port": int,
            "max_states": int,
            "grace_period_s": float,
            "undelivered_hold_s": float,
        }
        group = parser.add_argument_group("detokenizer")
        for f in dataclasses.fields(DetokenizerConfig):
            if f.name in ("health_port", "tls"):  # meshlm.common.tls defines them
                continue
            var = env_name(f.name)
            default = environ.get(var, f.default)
            kwargs: dict[str, Any] = {
                "type": types.get(f.name, str),
                "default": default,
                "dest": f.name,
            }
            if f.name == "log_format":
                kwargs["choices"] = LOG_FORMATS
            shown = "unset" if f.default in (None, "") else f.default
            group.add_argument(
                "--" + f.name.replace("_", "-"),
                **kwargs,
                help=f"{helps[f.name]} (env {var}; default: {shown})",
            )
        add_health_port_cli_arg(parser, ENV_PREFIX, environ)
        add_tls_cli_args(parser, ENV_PREFIX, environ)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "DetokenizerConfig":
        names = {f.name for f in dataclasses.fields(cls)} - {"tls"}
        values = {k: v for k, v in vars(args).items() if k in names}
        return cls(**values, tls=TlsConfig.from_cli_args(args))

"""The config fields every meshlm service shares, declared once, with their flags.

    ServiceConfig      host, port, log_level, log_format, otlp_endpoint, grace_period_s,
                       batch_scheduling, tls, auth (all four services; the gateway's port is
                       HTTP, its tls its client's)
    GrpcServiceConfig  + metrics_port, health_port (tokenizer, scheduler, detokenizer)

A service's config is a frozen subclass adding its own fields, flag help (FLAGS), environment
prefix (ENV_PREFIX, MESHLM_<COMPONENT>_) and defaults (a redeclared field, e.g. its port).
Flags and environment variables come from meshlm.common.flags, the one mechanism: field foo_bar
is --foo-bar and <ENV_PREFIX>FOO_BAR, flag > environment > default, both named in --help; tls is
the three --tls-* flags (<ENV_PREFIX>TLS_CERT_FILE, ...); auth is the --internal-token[-file]
flags and, where PUBLIC_API, --api-key[-file] (<ENV_PREFIX>INTERNAL_TOKEN, <ENV_PREFIX>API_KEY,
...; meshlm.common.auth). Invariants of a built config: ports in
[0, 65535], log_level and log_format known, grace_period_s >= 0, an empty otlp_endpoint is None,
health_port off or a fixed port other than port, tls validated (its files read), auth's secrets
read and checked; to_json shows whether each secret is set, never the secret.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar, TypeVar

from meshlm.common.auth import NO_AUTH, AuthConfig, add_auth_cli_args
from meshlm.common.flags import Flag, add_config_flags, config_values, env_values
from meshlm.common.tls import PLAINTEXT, TlsConfig, add_tls_cli_args, validate_health_port

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")

C = TypeVar("C", bound="ServiceConfig")


def need(ok: bool, message: str) -> None:
    """Raise ValueError(message) unless ok: how a config's __post_init__ states its invariants."""
    if not ok:
        raise ValueError(message)


def check_port(name: str, port: int | None) -> None:
    if port is not None:
        need(0 <= port <= 65535, f"{name} must be in [0, 65535], got {port}")


@dataclass(frozen=True)
class ServiceConfig:
    """Fields of every service; subclasses set ENV_PREFIX, COMPONENT, FLAGS (help of every
    field but tls and auth, which are the --tls-* and auth flags) and PUBLIC_API (the service
    has a public API, guarded by --api-key)."""

    ENV_PREFIX: ClassVar[str] = "MESHLM_"
    COMPONENT: ClassVar[str] = "service"
    PUBLIC_API: ClassVar[bool] = False
    FLAGS: ClassVar[Mapping[str, Flag]] = MappingProxyType(
        {
            "host": Flag("address to bind the server to"),
            "port": Flag("port of the server (0: any free port)"),
            "log_level": Flag("logging level: " + " | ".join(LOG_LEVELS)),
            "log_format": Flag("log line format: " + " | ".join(LOG_FORMATS)),
            "otlp_endpoint": Flag("export OpenTelemetry spans to this OTLP/gRPC endpoint (host:port)"),
            "grace_period_s": Flag("on SIGTERM, seconds in-flight requests get to finish"),
            "batch_scheduling": Flag(
                "run under Linux's SCHED_BATCH policy (its wake-ups do not preempt busy threads): for a "
                "relay on the cores of a scheduler; `meshlm launch --batch-relays` sets it on the gateway, "
                "tokenizers and detokenizers"
            ),
        }
    )

    host: str = "0.0.0.0"
    port: int = 0  # every service redeclares it with its own default
    log_level: str = "info"
    log_format: str = "text"
    otlp_endpoint: str | None = None
    grace_period_s: float = 30.0
    batch_scheduling: bool = False
    tls: TlsConfig = PLAINTEXT
    auth: AuthConfig = NO_AUTH

    def __post_init__(self) -> None:
        check_port("port", self.port)
        need(
            self.log_level.lower() in LOG_LEVELS,
            f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}",
        )
        need(
            self.log_format in LOG_FORMATS,
            f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}",
        )
        need(self.grace_period_s >= 0, f"grace_period_s must be >= 0, got {self.grace_period_s}")
        if self.otlp_endpoint == "":
            object.__setattr__(self, "otlp_endpoint", None)

    def replace(self: C, **changes: Any) -> C:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        values = dataclasses.asdict(self)
        values["auth"] = self.auth.describe()  # never the secrets
        return json.dumps(values, sort_keys=True)

    # ---- flags and environment ------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
        """One flag per field (FLAGS), the --tls-* and the auth flags, each defaulting to its environment
        variable (environ, default os.environ) when set, else to the field's default."""
        group = parser.add_argument_group(
            cls.COMPONENT,
            f"every flag can also be set as {cls.ENV_PREFIX}<FLAG> (upper case, dashes as underscores); a flag wins",
        )
        add_config_flags(group, cls, cls.FLAGS, env_prefix=cls.ENV_PREFIX, environ=environ)
        add_tls_cli_args(parser, cls.ENV_PREFIX, environ)
        add_auth_cli_args(parser, cls.ENV_PREFIX, cls.PUBLIC_API, environ)

    @classmethod
    def from_cli_args(cls: type[C], ns: argparse.Namespace) -> C:
        """The config of flags added by add_cli_args; ValueError names a field out of range."""
        return cls(
            **config_values(cls.FLAGS, ns),
            tls=TlsConfig.from_cli_args(ns),
            auth=AuthConfig.from_cli_args(ns, cls.PUBLIC_API),
        )

    @classmethod
    def from_env(cls: type[C], environ: Mapping[str, str] | None = None, **overrides: Any) -> C:
        """The config of the environment alone (no command line); overrides win."""
        values: dict[str, Any] = {
            "tls": TlsConfig.from_env(cls.ENV_PREFIX, environ),
            "auth": AuthConfig.from_env(cls.ENV_PREFIX, cls.PUBLIC_API, environ),
            **env_values(cls, cls.FLAGS, cls.ENV_PREFIX, environ),
        }
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True)
class GrpcServiceConfig(ServiceConfig):
    """Fields of the gRPC services: a Prometheus port and the plaintext health-only port."""

    FLAGS: ClassVar[Mapping[str, Flag]] = MappingProxyType(
        {
            **ServiceConfig.FLAGS,
            "port": Flag("gRPC port (0: any free port)"),
            "metrics_port": Flag("serve Prometheus /metrics over HTTP on this port"),
            "health_port": Flag(
                "also serve grpc.health.v1, and nothing else, in plaintext on this port: "
                "Kubernetes' native gRPC probes cannot speak TLS, so with --tls-cert-file point "
                "them here",
                metavar="PORT",
            ),
        }
    )

    metrics_port: int | None = None
    health_port: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_port("metrics_port", self.metrics_port)
        validate_health_port(self.health_port, self.port)


__all__ = [
    "GrpcServiceConfig",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "ServiceConfig",
    "check_port",
    "need",
]

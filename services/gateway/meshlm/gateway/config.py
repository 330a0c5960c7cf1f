"""GatewayConfig: the gateway's flags, frozen after parsing.

Every field is a CLI flag (`--tokenizer-addrs` style) with an environment fallback
`MESHLM_GATEWAY_<FIELD>` (e.g. MESHLM_GATEWAY_TOKENIZER_ADDRS). Precedence: flag > env > default.
`tls` is the three --tls-* flags of meshlm.common.tls: they secure the gRPC client to the
tokenizers only (the HTTP side stays as it is).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any, Optional

from meshlm.common.addresses import parse_addresses
from meshlm.common.tls import PLAINTEXT, TlsConfig, add_tls_cli_args

ENV_PREFIX = "MESHLM_GATEWAY_"

_HELP = {
    "host": "address to bind the HTTP server to",
    "port": "HTTP port",
    "tokenizer_addrs": "tokenizer replicas, comma-separated host:port list (re-resolved while running)",
    "api_key": "require `Authorization: Bearer <key>` on every route but /health, /health_generate, /metrics",
    "served_model_name": "model name of /v1/* (default: the tokenizer's GetModelInfo.served_model_name)",
    "request_timeout_s": "deadline of one generate/embed call to a tokenizer, in seconds",
    "log_level": "logging level: debug | info | warning | error",
    "log_format": "log format: text | json",
    "otlp_endpoint": "OTLP/gRPC endpoint for traces (e.g. localhost:4317); empty = not exported",
    "grace_period_s": "on SIGTERM, seconds in-flight requests get to finish",
}


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 30000
    tokenizer_addrs: tuple[str, ...] = ("localhost:50051",)
    api_key: Optional[str] = None
    served_model_name: Optional[str] = None
    request_timeout_s: float = 600.0
    log_level: str = "info"
    log_format: str = "text"
    otlp_endpoint: Optional[str] = None
    grace_period_s: float = 30.0
    tls: TlsConfig = PLAINTEXT  # of the gRPC client to the tokenizers

    def __post_init__(self) -> None:
        addrs = self.tokenizer_addrs
        if isinstance(addrs, str) or isinstance(addrs, list):
            object.__setattr__(self, "tokenizer_addrs", tuple(parse_addresses(addrs)))
        else:
            parse_addresses(list(addrs))  # validates host:port
        if not self.tokenizer_addrs:
            raise ValueError("tokenizer_addrs must name at least one tokenizer (host:port)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if self.grace_period_s < 0:
            raise ValueError(f"grace_period_s must be >= 0, got {self.grace_period_s}")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        for name in ("api_key", "served_model_name", "otlp_endpoint"):
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field. Flag defaults are None so env fallbacks can apply in from_cli_args."""
        for f in fields(GatewayConfig):
            if f.name == "tls":
                continue
            flag = "--" + f.name.replace("_", "-")
            default = f.default if not isinstance(f.default, tuple) else ",".join(f.default)
            env = ENV_PREFIX + f.name.upper()
            parser.add_argument(
                flag,
                dest=f.name,
                type=_parser_type(f.name),
                default=None,
                help=f"{_HELP[f.name]} (env {env}; default: {default})",
            )
        add_tls_cli_args(parser, ENV_PREFIX, environ={})  # env fallbacks apply in from_cli_args

    @staticmethod
    def from_cli_args(ns: argparse.Namespace, env: Optional[dict[str, str]] = None) -> "GatewayConfig":
        env = os.environ if env is None else env
        values: dict[str, Any] = {"tls": TlsConfig.from_cli_args(ns, ENV_PREFIX, env)}
        for f in fields(GatewayConfig):
            if f.name == "tls":
                continue
            value = getattr(ns, f.name, None)
            if value is None and (ENV_PREFIX + f.name.upper()) in env:
                value = _parser_type(f.name)(env[ENV_PREFIX + f.name.upper()])
            if value is not None:
                values[f.name] = value
        return GatewayConfig(**values)


def _parser_type(name: str):
    if name == "port":
        return int
    if name in ("request_timeout_s", "grace_period_s"):
        return float
    if name == "tokenizer_addrs":
        return addresses
    return str


def addresses(value: str) -> tuple[str, ...]:
    """argparse type of --tokenizer-addrs: "a:1,b:2" -> ("a:1", "b:2")."""
    try:
        return tuple(parse_addresses(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None

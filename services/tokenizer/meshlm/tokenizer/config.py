"""TokenizerConfig: the tokenizer service's flags, frozen after parsing.

Every field is a CLI flag (`--scheduler-addrs`, underscores become dashes) with an environment
fallback `MESHLM_TOKENIZER_<FIELD>` (e.g. MESHLM_TOKENIZER_SCHEDULER_ADDRS="s0:50052,s1:50052").
Precedence: flag > environment > default. `tls` is the three --tls-* flags (meshlm.common.tls),
used by the server and by the scheduler / detokenizer clients alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import socket
import string
from dataclasses import dataclass, fields
from typing import Any, Mapping, Optional

from meshlm.common.addresses import parse_addresses
from meshlm.common.tls import (
    PLAINTEXT,
    TlsConfig,
    add_health_port_cli_arg,
    add_tls_cli_args,
    validate_health_port,
)

ENV_PREFIX = "MESHLM_TOKENIZER_"
ROUTING_POLICIES = ("round_robin", "shortest_queue")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
LOG_FORMATS = ("text", "json")


def default_tokenizer_id() -> str:
    """`<hostname>-<pid>-<random>`: unique per replica process (docs/ring.md "Identities")."""
    suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=6))
    return f"{socket.gethostname()}-{os.getpid()}-{suffix}"


@dataclass(frozen=True)
class TokenizerConfig:
    host: str = "0.0.0.0"
    port: int = 50051
    # This replica's origin id; outputs are routed back to it. Empty = generated.
    tokenizer_id: str = ""
    # HF tokenizer directory (tokenizer.json, tokenizer_config.json, chat template).
    # None = the tokenizer_path a scheduler reports in GetModelInfo (shared file system).
    tokenizer_path: Optional[str] = None
    scheduler_addrs: tuple[str, ...] = ("localhost:30010",)
    detokenizer_addrs: tuple[str, ...] = ("localhost:50053",)
    routing_policy: str = "round_robin"
    # Most in-flight requests (after n>1 / batch fan-out) per tokenizer; more -> 503.
    max_queued_requests: int = 4096
    # No output for this long -> DEADLINE_EXCEEDED (the request is aborted at its scheduler).
    request_timeout_s: float = 300.0
    # How long a request waits for a scheduler / detokenizer connection before UNAVAILABLE.
    connect_timeout_s: float = 5.0
    # n>1: first run one max_new_tokens=0 request per prompt to warm the radix prefix cache.
    parallel_sample_warmup: bool = True
    metrics_port: Optional[int] = None
    log_level: str = "info"
    log_format: str = "text"
    otlp_endpoint: Optional[str] = None
    grace_period_s: float = 30.0
    # Model name reported by GetModelInfo (default: the scheduler's).
    served_model_name: Optional[str] = None
    # TLS / mTLS of the gRPC server and of the scheduler and detokenizer clients.
    tls: TlsConfig = PLAINTEXT
    # Plaintext grpc.health.v1-only port for Kubernetes probes (None = off).
    health_port: Optional[int] = None

    def __post_init__(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        if not self.tokenizer_id:
            object.__setattr__(self, "tokenizer_id", default_tokenizer_id())
        object.__setattr__(
            self, "scheduler_addrs", tuple(parse_addresses(list(self.scheduler_addrs)))
        )
        object.__setattr__(
            self, "detokenizer_addrs", tuple(parse_addresses(list(self.detokenizer_addrs)))
        )
        need(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        need(len(self.scheduler_addrs) > 0, "scheduler_addrs must name at least one host:port")
        need(len(self.detokenizer_addrs) > 0, "detokenizer_addrs must name at least one host:port")
        need(
            self.routing_policy in ROUTING_POLICIES,
            f"routing_policy must be one of {ROUTING_POLICIES}, got {self.routing_policy!r}",
        )
        need(
            self.max_queued_requests >= 1,
            f"max_queued_requests must be >= 1, got {self.max_queued_requests}",
        )
        need(
            self.request_timeout_s > 0,
            f"request_timeout_s must be > 0, got {self.request_timeout_s}",
        )
        need(
            self.connect_timeout_s > 0,
            f"connect_timeout_s must be > 0, got {self.connect_timeout_s}",
        )
        need(self.grace_period_s >= 0, f"grace_period_s must be >= 0, got {self.grace_period_s}")
        need(
            self.log_level.lower() in LOG_LEVELS,
            f"log_level must be one of {LOG_LEVELS}, got {self.log_level!r}",
        )
        need(
            self.log_format in LOG_FORMATS,
            f"log_format must be one of {LOG_FORMATS}, got {self.log_format!r}",
        )
        if self.metrics_port is not None:
            need(
                0 <= self.metrics_port <= 65535,
                f"metrics_port must be in [0, 65535], got {self.metrics_port}",
            )
        validate_health_port(self.health_port, self.port)

    def replace(self, **changes: Any) -> TokenizerConfig:
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    # ---- CLI ------------------------------------------------------------------------------
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """One flag per field; defaults come from the environment, then the dataclass."""
        helps = {
            "host": "address to bind the gRPC server to",
            "port": "gRPC port",
            "tokenizer_id": "origin id of this replica; empty = <hostname>-<pid>-<random>",
            "tokenizer_path": "HF tokenizer directory; None = the tokenizer_path a scheduler reports",
            "scheduler_addrs": "scheduler host:port list, comma separated (DNS re-resolved)",
            "detokenizer_addrs": "detokenizer host:port list, comma separated (DNS re-resolved)",
            "routing_policy": "round_robin | shortest_queue",
            "max_queued_requests": "most in-flight requests of this replica; more get RESOURCE_EXHAUSTED",
            "request_timeout_s": "seconds without output before a request fails with DEADLINE_EXCEEDED",
            "connect_timeout_s": "seconds a request waits for a scheduler/detokenizer before UNAVAILABLE",
            "parallel_sample_warmup": "n>1: prefill each prompt once before fanning out (true|false)",
            "metrics_port": "serve Prometheus /metrics on this port (default: off)",
            "log_level": "debug | info | warning | error",
            "log_format": "text | json",
            "otlp_endpoint": "OTLP/gRPC endpoint for traces (default: off)",
            "grace_period_s": "seconds to finish in-flight requests on SIGTERM",
            "served_model_name": "model name to report; None = the scheduler's",
        }
        env = os.environ
        for f in fields(TokenizerConfig):
            if f.name in _SHARED_FLAGS:
                continue
            flag = "--" + f.name.replace("_", "-")
            env_name = ENV_PREFIX + f.name.upper()
            default = f.default
            if env_name in env:
                default = _parse_value(f.name, env[env_name])
            help_text = f"{helps.get(f.name, f.name)} (env {env_name}; default: {_show(default)})"
            if f.name in ("scheduler_addrs", "detokenizer_addrs"):
                parser.add_argument(flag, type=_addr_list, default=default, help=help_text)
            elif f.name == "parallel_sample_warmup":
                parser.add_argument(flag, type=_parse_bool, default=default, help=help_text)
            else:
                parser.add_argument(
                    flag, type=_FIELD_TYPES[f.name], default=default, help=help_text
                )
        add_health_port_cli_arg(parser, ENV_PREFIX)
        add_tls_cli_args(parser, ENV_PREFIX)

    @staticmethod
    def from_cli_args(args: argparse.Namespace) -> TokenizerConfig:
        values = {f.name: getattr(args, f.name) for f in fields(TokenizerConfig) if f.name != "tls"}
        return TokenizerConfig(**values, tls=TlsConfig.from_cli_args(args))

    @staticmethod
    def from_env(
        environ: Optional[Mapping[str, str]] = None, **overrides: Any
    ) -> TokenizerConfig:
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {"tls": TlsConfig.from_env(ENV_PREFIX, environ)}
        for f in fields(TokenizerConfig):
            if f.name == "tls":
                continue
            key = ENV_PREFIX + f.name.upper()
            if key in environ:
                values[f.name] = _parse_value(f.name, environ[key])
        values.update(overrides)
        return TokenizerConfig(**values)


def _parse_bool(value: str) -> bool:
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def _addr_list(value: str) -> tuple[str, ...]:
    try:
        return tuple(parse_addresses(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _opt(conv):
    def parse(value: str):
        return None if value in ("", "none", "None") else conv(value)

    return parse


# Flags meshlm.common.tls defines, identical in every component.
_SHARED_FLAGS = ("tls", "health_port")

_FIELD_TYPES = {
    "host": str,
    "port": int,
    "tokenizer_id": str,
    "tokenizer_path": _opt(str),
    "routing_policy": str,
    "max_queued_requests": int,
    "request_timeout_s": float,
    "connect_timeout_s": float,
    "metrics_port": _opt(int),
    "log_level": str,
    "log_format": str,
    "otlp_endpoint": _opt(str),
    "grace_period_s": float,
    "served_model_name": _opt(str),
    "health_port": _opt(int),
}


def _parse_value(name: str, raw: str) -> Any:
    if name in ("scheduler_addrs", "detokenizer_addrs"):
        return tuple(parse_addresses(raw))
    if name == "parallel_sample_warmup":
        return _parse_bool(raw)
    return _FIELD_TYPES[name](raw)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    return str(value)


__all__ = ["TokenizerConfig", "ROUTING_POLICIES", "ENV_PREFIX", "default_tokenizer_id"]

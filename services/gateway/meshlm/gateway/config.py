"""GatewayConfig: the gateway's flags, frozen after parsing.

Every field is a CLI flag (`--tokenizer-addrs` style) with an environment fallback
`MESHLM_GATEWAY_<FIELD>` (e.g. MESHLM_GATEWAY_TOKENIZER_ADDRS), the meshlm.common.flags way.
Precedence: flag > env > default. The shared fields (host, port, logging, OTLP, grace period,
tls, auth) are ServiceConfig's: `port` is the HTTP port, and the three --tls-* flags secure the
gRPC client to the tokenizers only (the HTTP side stays as it is). auth: --api-key[-file] guards
every HTTP route but /health, /health_generate and /metrics; the client to the tokenizers sends
the internal token (--internal-token[-file]) or, without one, the API key.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from meshlm.common.addresses import parse_addresses
from meshlm.common.flags import Flag
from meshlm.common.input_limits import MAX_REQUEST_BYTES
from meshlm.common.service_config import ServiceConfig, need

ENV_PREFIX = "MESHLM_GATEWAY_"


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    """The gateway's own fields after the shared ones. Invariants: one or more tokenizer
    addresses (host:port), request_timeout_s > 0, max_request_bytes >= 1, an empty
    served_model_name is None."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX
    COMPONENT: ClassVar[str] = "gateway"
    PUBLIC_API: ClassVar[bool] = True
    FLAGS: ClassVar[Mapping[str, Flag]] = MappingProxyType(
        {
            **ServiceConfig.FLAGS,
            "host": Flag("address to bind the HTTP server to"),
            "port": Flag("HTTP port"),
            "tokenizer_addrs": Flag("tokenizer replicas, comma-separated host:port list (re-resolved while running)"),
            "served_model_name": Flag("model name of /v1/* (default: the tokenizer's GetModelInfo.served_model_name)"),
            "request_timeout_s": Flag("deadline of one generate/embed call to a tokenizer, in seconds"),
            "max_request_bytes": Flag("largest HTTP request body in bytes; a larger one gets 413"),
        }
    )

    port: int = 30000
    tokenizer_addrs: tuple[str, ...] = ("localhost:50051",)
    served_model_name: str | None = None
    request_timeout_s: float = 600.0
    max_request_bytes: int = MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        addrs = self.tokenizer_addrs
        if isinstance(addrs, (str, list)):
            object.__setattr__(self, "tokenizer_addrs", tuple(parse_addresses(addrs)))
        else:
            parse_addresses(list(addrs))  # validates host:port
        need(
            bool(self.tokenizer_addrs),
            "tokenizer_addrs must name at least one tokenizer (host:port)",
        )
        super().__post_init__()
        need(
            self.request_timeout_s > 0,
            f"request_timeout_s must be > 0, got {self.request_timeout_s}",
        )
        need(
            self.max_request_bytes >= 1,
            f"max_request_bytes must be >= 1, got {self.max_request_bytes}",
        )
        if self.served_model_name == "":
            object.__setattr__(self, "served_model_name", None)

    @property
    def tokenizer_token(self) -> str | None:
        """What the client to the tokenizers sends as its bearer token: the internal token, or
        without one the API key (a tokenizer given the same key accepts it)."""
        return self.auth.internal_token_value or self.auth.api_key_value


__all__ = ["ENV_PREFIX", "GatewayConfig"]

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
from meshlm.gateway.function_call.registry import PARSERS
from meshlm.gateway.reasoning.registry import STYLES

ENV_PREFIX = "MESHLM_GATEWAY_"


@dataclass(frozen=True)
class GatewayConfig(ServiceConfig):
    """The gateway's own fields after the shared ones. Invariants: one or more tokenizer
    addresses (host:port), request_timeout_s > 0, max_request_bytes >= 1, stream_stall_timeout_s > 0, an empty
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
            "tool_call_parser": Flag(
                "turn model output into message.tool_calls for tool_choice auto: "
                "hermes | qwen25 | llama3_json | mistral | pythonic (default: none; tool_choice auto is then a 400)"
            ),
            "reasoning_parser": Flag(
                "split thinking into reasoning_content: deepseek-r1 (output starts inside <think>) | "
                "qwen3 (an optional leading <think> block) (default: none)"
            ),
            "strict_api": Flag(
                "reject requests with fields meshlm does not support (400 naming them) instead of logging them"
            ),
            "stream_stall_timeout_s": Flag(
                "seconds an SSE stream may wait for its client to accept data (a client that does not read);"
                " then the request is aborted and the connection closed"
            ),
        }
    )

    port: int = 30000
    tokenizer_addrs: tuple[str, ...] = ("localhost:50051",)
    served_model_name: str | None = None
    request_timeout_s: float = 600.0
    max_request_bytes: int = MAX_REQUEST_BYTES
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    strict_api: bool = False
    # A streaming client that accepts nothing for this long (its socket buffers full) is dropped
    # and its request aborted upstream, so a non-reading client holds no KV and no more than the
    # buffers (uvicorn's 64 KiB + the kernel's) in the gateway.
    stream_stall_timeout_s: float = 60.0

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
        for name in ("served_model_name", "tool_call_parser", "reasoning_parser"):
            if getattr(self, name) == "":
                object.__setattr__(self, name, None)
        need(
            self.tool_call_parser is None or self.tool_call_parser in PARSERS,
            f"tool_call_parser must be one of {', '.join(sorted(PARSERS))}, got {self.tool_call_parser!r}",
        )
        need(
            self.reasoning_parser is None or self.reasoning_parser in STYLES,
            f"reasoning_parser must be one of {', '.join(sorted(STYLES))}, got {self.reasoning_parser!r}",
        )
        need(
            self.stream_stall_timeout_s > 0,
            f"stream_stall_timeout_s must be > 0, got {self.stream_stall_timeout_s}",
        )

    @property
    def tokenizer_token(self) -> str | None:
        """What the client to the tokenizers sends as its bearer token: the internal token, or
        without one the API key (a tokenizer given the same key accepts it)."""
        return self.auth.internal_token_value or self.auth.api_key_value


__all__ = ["ENV_PREFIX", "GatewayConfig"]

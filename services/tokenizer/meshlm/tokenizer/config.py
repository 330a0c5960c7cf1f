"""TokenizerConfig: the tokenizer service's flags, frozen after parsing.

Every field is a CLI flag (`--scheduler-addrs`, underscores become dashes) with an environment
fallback `MESHLM_TOKENIZER_<FIELD>` (e.g. MESHLM_TOKENIZER_SCHEDULER_ADDRS="s0:50052,s1:50052"),
the meshlm.common.flags way. Precedence: flag > environment > default. The shared fields (host,
port, logging, OTLP, grace period, metrics/health ports, tls, auth) are GrpcServiceConfig's; `tls`
secures the server and the scheduler / detokenizer clients alike; auth's API key guards the
public TokenizerService (which also accepts the internal token), its internal token goes on
every call to the schedulers and detokenizers.
"""

from __future__ import annotations

import os
import random
import socket
import string
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from meshlm.common.addresses import parse_addresses
from meshlm.common.flags import Flag, parse_bool
from meshlm.common.service_config import GrpcServiceConfig, need

ENV_PREFIX = "MESHLM_TOKENIZER_"
ROUTING_POLICIES = ("round_robin", "shortest_queue")


def default_tokenizer_id() -> str:
    """`<hostname>-<pid>-<random>`: unique per replica process (docs/ring.md "Identities")."""
    suffix = "".join(random.choices(string.ascii_lowercase + string.digits, k=6))
    return f"{socket.gethostname()}-{os.getpid()}-{suffix}"


@dataclass(frozen=True)
class TokenizerConfig(GrpcServiceConfig):
    """The tokenizer's own fields after the shared ones (meshlm.common.service_config).
    Invariants: tokenizer_id set (generated when empty), one or more scheduler and detokenizer
    addresses (host:port), a known routing policy, positive limits and timeouts."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX
    COMPONENT: ClassVar[str] = "tokenizer"
    PUBLIC_API: ClassVar[bool] = True
    FLAGS: ClassVar[Mapping[str, Flag]] = MappingProxyType(
        {
            **GrpcServiceConfig.FLAGS,
            "tokenizer_id": Flag("origin id of this replica; empty = <hostname>-<pid>-<random>"),
            "tokenizer_path": Flag("HF tokenizer directory; unset = the tokenizer_path a scheduler reports"),
            "scheduler_addrs": Flag("scheduler host:port list, comma separated (DNS re-resolved)"),
            "detokenizer_addrs": Flag("detokenizer host:port list, comma separated (DNS re-resolved)"),
            "routing_policy": Flag(" | ".join(ROUTING_POLICIES)),
            "max_queued_requests": Flag("most in-flight requests of this replica; more get RESOURCE_EXHAUSTED"),
            "request_timeout_s": Flag("seconds without output before a request fails with DEADLINE_EXCEEDED"),
            "connect_timeout_s": Flag("seconds a request waits for a scheduler/detokenizer before UNAVAILABLE"),
            "max_stream_backlog_bytes": Flag(
                "most bytes of output a streaming call may have undelivered (its caller not reading);"
                " past it the call is aborted with RESOURCE_EXHAUSTED"
            ),
            "parallel_sample_warmup": Flag(
                "n>1: prefill each prompt once before fanning out (true|false)", parse=parse_bool
            ),
            "served_model_name": Flag("model name to report; unset = the scheduler's"),
        }
    )

    port: int = 50051
    # This replica's origin id; outputs are routed back to it. Empty = generated.
    tokenizer_id: str = ""
    # HF tokenizer directory (tokenizer.json, tokenizer_config.json, chat template).
    # None = the tokenizer_path a scheduler reports in GetModelInfo (shared file system).
    tokenizer_path: str | None = None
    scheduler_addrs: tuple[str, ...] = ("localhost:30010",)
    detokenizer_addrs: tuple[str, ...] = ("localhost:50053",)
    routing_policy: str = "round_robin"
    # Most in-flight requests (after n>1 / batch fan-out) per tokenizer; more -> 503.
    max_queued_requests: int = 4096
    # No output for this long -> DEADLINE_EXCEEDED (the request is aborted at its scheduler).
    request_timeout_s: float = 300.0
    # How long a request waits for a scheduler / detokenizer connection before UNAVAILABLE.
    connect_timeout_s: float = 5.0
    # Undelivered output of one call (a caller that does not read its stream) beyond which the
    # call is aborted (its KV freed) with RESOURCE_EXHAUSTED.
    max_stream_backlog_bytes: int = 4 << 20
    # n>1: first run one max_new_tokens=0 request per prompt to warm the radix prefix cache.
    parallel_sample_warmup: bool = True
    # Model name reported by GetModelInfo (default: the scheduler's).
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.tokenizer_id:
            object.__setattr__(self, "tokenizer_id", default_tokenizer_id())
        object.__setattr__(self, "scheduler_addrs", tuple(parse_addresses(list(self.scheduler_addrs))))
        object.__setattr__(self, "detokenizer_addrs", tuple(parse_addresses(list(self.detokenizer_addrs))))
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
            self.max_stream_backlog_bytes >= 1,
            f"max_stream_backlog_bytes must be >= 1, got {self.max_stream_backlog_bytes}",
        )
        need(
            self.connect_timeout_s > 0,
            f"connect_timeout_s must be > 0, got {self.connect_timeout_s}",
        )


__all__ = ["TokenizerConfig", "ROUTING_POLICIES", "ENV_PREFIX", "default_tokenizer_id"]

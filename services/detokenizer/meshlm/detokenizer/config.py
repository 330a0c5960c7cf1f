"""DetokenizerConfig: the detokenizer's flags, each with an env-var fallback, frozen after parsing.

Precedence: command-line flag, then `MESHLM_DETOKENIZER_<FIELD>` (e.g. MESHLM_DETOKENIZER_PORT),
then the default (the meshlm.common.flags way). The shared fields (host, port, logging, OTLP,
grace period, metrics/health ports, tls) are GrpcServiceConfig's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from meshlm.common.flags import Flag, env_var
from meshlm.common.service_config import GrpcServiceConfig, need

ENV_PREFIX = "MESHLM_DETOKENIZER_"

__all__ = ["DetokenizerConfig", "ENV_PREFIX", "env_name"]


def env_name(field_name: str) -> str:
    return env_var(ENV_PREFIX, field_name)


@dataclass(frozen=True)
class DetokenizerConfig(GrpcServiceConfig):
    """The detokenizer's own fields after the shared ones. Invariants: tokenizer_path is set,
    max_states >= 1, undelivered_hold_s >= 0 (and GrpcServiceConfig's)."""

    ENV_PREFIX: ClassVar[str] = ENV_PREFIX
    COMPONENT: ClassVar[str] = "detokenizer"
    FLAGS: ClassVar[Mapping[str, Flag]] = MappingProxyType(
        {
            **GrpcServiceConfig.FLAGS,
            "tokenizer_path": Flag("Hugging Face tokenizer directory (holding tokenizer.json); required"),
            "max_states": Flag("most requests with a decode state (least recently used are evicted)"),
            "undelivered_hold_s": Flag("seconds to hold outputs for an origin with no subscriber"),
        }
    )

    port: int = 50053
    grace_period_s: float = 10.0
    tokenizer_path: str = ""
    max_states: int = 65536
    undelivered_hold_s: float = 10.0

    def __post_init__(self) -> None:
        need(
            bool(self.tokenizer_path),
            "tokenizer_path is required: pass --tokenizer-path or set "
            f"{env_name('tokenizer_path')} (a Hugging Face tokenizer directory with "
            "tokenizer.json)",
        )
        super().__post_init__()
        need(self.max_states >= 1, f"max_states must be >= 1, got {self.max_states}")
        need(
            self.undelivered_hold_s >= 0,
            f"undelivered_hold_s must be >= 0, got {self.undelivered_hold_s}",
        )

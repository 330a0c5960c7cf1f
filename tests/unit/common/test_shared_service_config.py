"""meshlm.common.service_config and meshlm.common.flags: the shared fields declared once and one
flag/env mechanism (--foo-bar <-> MESHLM_<COMPONENT>_FOO_BAR) for all four services."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

import pytest

from meshlm.common.flags import Flag, add_config_flags, env_values, optional, parse_bool
from meshlm.common.service_config import GrpcServiceConfig, ServiceConfig
from meshlm.detokenizer.config import DetokenizerConfig
from meshlm.gateway.config import GatewayConfig
from meshlm.scheduler.service.config import SchedulerServiceConfig
from meshlm.tokenizer.config import TokenizerConfig

CONFIGS: list[tuple[type[ServiceConfig], dict[str, Any]]] = [
    (TokenizerConfig, {}),
    (DetokenizerConfig, {"tokenizer_path": "/tok"}),
    (GatewayConfig, {}),
    (SchedulerServiceConfig, {}),
]
SHARED = {"host", "port", "log_level", "log_format", "otlp_endpoint", "grace_period_s", "tls", "auth"}


def parse(cls: type[ServiceConfig], argv: list[str], env: dict[str, str]) -> ServiceConfig:
    parser = argparse.ArgumentParser()
    cls.add_cli_args(parser, environ=env)
    return cls.from_cli_args(parser.parse_args(argv))


@pytest.mark.parametrize("cls, required", CONFIGS, ids=[c.__name__ for c, _ in CONFIGS])
def test_every_field_is_a_flag_and_an_env_var_named_in_help(cls: type[ServiceConfig], required: dict[str, Any]) -> None:
    names = {f.name for f in dataclasses.fields(cls)}
    assert names >= SHARED
    assert issubclass(cls, GrpcServiceConfig) == (cls is not GatewayConfig)
    assert set(cls.FLAGS) == names - {"tls", "auth"}  # tls, auth: the --tls-* and auth flags
    parser = argparse.ArgumentParser()
    cls.add_cli_args(parser, environ={})
    text = parser.format_help().replace("\n", "").replace(" ", "")
    for name in names - {"tls", "auth"}:
        assert "--" + name.replace("_", "-") in text
        assert cls.ENV_PREFIX + name.upper() in text
    auth_vars = ("INTERNAL_TOKEN", "INTERNAL_TOKEN_FILE") + (("API_KEY", "API_KEY_FILE") if cls.PUBLIC_API else ())
    for tls_var in ("TLS_CERT_FILE", "TLS_KEY_FILE", "TLS_CA_FILE", *auth_vars):
        assert cls.ENV_PREFIX + tls_var in text
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in required.items()]
    parsed = parse(cls, flags, {})
    # the defaults of the flags are the dataclass's (but the tokenizer's generated random id)
    generated = {"tokenizer_id": parsed.tokenizer_id} if cls is TokenizerConfig else {}
    assert parsed == cls(**required, **generated)


@pytest.mark.parametrize("cls, required", CONFIGS, ids=[c.__name__ for c, _ in CONFIGS])
def test_shared_fields_flag_env_and_validation(cls: type[ServiceConfig], required: dict[str, Any]) -> None:
    p = cls.ENV_PREFIX
    env = {p + "HOST": "127.0.0.1", p + "PORT": "0", p + "LOG_LEVEL": "debug"}
    env[p + "OTLP_ENDPOINT"] = ""
    extra = [f"--{k.replace('_', '-')}={v}" for k, v in required.items()]
    argv = ["--port", "7000", "--grace-period-s", "2.5", "--log-format", "json", *extra]
    c = parse(cls, argv, env)
    assert (c.host, c.port, c.log_level, c.log_format, c.grace_period_s) == (
        "127.0.0.1",
        7000,
        "debug",
        "json",
        2.5,
    )  # env fills in, a flag wins
    assert c.otlp_endpoint is None  # "" is unset
    from_env = cls.from_env(env, **required)
    assert (from_env.host, from_env.port, from_env.log_level) == ("127.0.0.1", 0, "debug")
    for bad, field in (
        ({"port": 70000}, "port"),
        ({"log_level": "loud"}, "log_level"),
        ({"log_format": "xml"}, "log_format"),
        ({"grace_period_s": -1}, "grace_period_s"),
    ):
        with pytest.raises(ValueError, match=field):
            cls(**required, **bad)
    with pytest.raises(SystemExit, match=f"{p}PORT"):
        parse(cls, [], {p + "PORT": "http"})


def test_grpc_services_share_metrics_and_health_ports() -> None:
    c = parse(TokenizerConfig, ["--metrics-port", "none"], {"MESHLM_TOKENIZER_HEALTH_PORT": "8081"})
    assert isinstance(c, GrpcServiceConfig) and c.metrics_port is None and c.health_port == 8081
    with pytest.raises(ValueError, match="metrics_port"):
        SchedulerServiceConfig(metrics_port=-1)
    with pytest.raises(ValueError, match="--health-port must differ from --port"):
        DetokenizerConfig(tokenizer_path="t", port=9000, health_port=9000)


@dataclasses.dataclass(frozen=True)
class _Example:
    n: int = 3
    rate: float | None = None
    on: bool = False
    verbose: bool = True
    peers: tuple[str, ...] = ()


def test_flag_mechanism_types_switches_and_env() -> None:
    flags = {
        "n": Flag("count"),
        "rate": Flag("rate"),
        "on": Flag("a switch"),
        "verbose": Flag("a true|false value", parse=parse_bool),
        "peers": Flag("peers", aliases=("--peer-list",)),
    }
    env = {"X_N": "5", "X_ON": "true", "X_VERBOSE": "no", "X_PEERS": "a:1, b:2"}
    parser = argparse.ArgumentParser()
    add_config_flags(parser, _Example, flags, env_prefix="X_", environ=env)
    ns = parser.parse_args(["--rate", "0.5"])
    assert (ns.n, ns.rate, ns.on, ns.verbose, ns.peers) == (5, 0.5, True, False, ("a:1", "b:2"))
    ns = parser.parse_args(["--no-on", "--verbose", "yes", "--peer-list", "", "--rate", "none"])
    assert (ns.on, ns.verbose, ns.peers, ns.rate) == (False, True, (), None)
    assert env_values(_Example, flags, "X_", env) == {
        "n": 5,
        "on": True,
        "verbose": False,
        "peers": ("a:1", "b:2"),
    }
    with pytest.raises(SystemExit):
        parser.parse_args(["--n", "many"])
    plain = argparse.ArgumentParser()
    add_config_flags(plain, _Example, flags, env_prefix=None, environ=env)  # no environment
    assert plain.parse_args([]).n == 3 and "X_N" not in plain.format_help()
    assert optional(int)(" None ") is None and parse_bool("") is False
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bool("maybe")

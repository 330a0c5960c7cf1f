"""TlsConfig validation (errors name the flag), the shared --tls-* / --health-port flags and their
environment fallbacks, and every component's config carrying them."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from tests.tls_certs import Pki, make_pki

from meshlm.common.tls import (
    PLAINTEXT,
    TlsConfig,
    add_tls_cli_args,
    validate_health_port,
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_plaintext_by_default() -> None:
    assert not PLAINTEXT.enabled and not PLAINTEXT.mutual
    assert TlsConfig("", "", "") == PLAINTEXT  # empty values (unset env, chart defaults) mean unset
    with pytest.raises(ValueError, match="TLS is off"):
        PLAINTEXT.server_credentials()
    with pytest.raises(ValueError, match="TLS is off"):
        PLAINTEXT.channel_credentials()


def test_valid_files_give_credentials(pki: Pki) -> None:
    mtls = pki.tls()
    assert mtls.enabled and mtls.mutual
    assert mtls.server_credentials() is not None and mtls.channel_credentials() is not None
    one_way = pki.tls(mutual=False)
    assert one_way.enabled and not one_way.mutual
    assert one_way.server_credentials() is not None


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"cert_file": "C"}, "--tls-cert-file needs --tls-key-file"),
        ({"key_file": "K"}, "--tls-key-file needs --tls-cert-file"),
        ({"ca_file": "A"}, "--tls-ca-file needs --tls-cert-file and --tls-key-file"),
        ({"cert_file": "C", "ca_file": "A"}, "--tls-cert-file needs --tls-key-file"),
    ],
)
def test_incomplete_sets_are_rejected(pki: Pki, kwargs: dict[str, str], message: str) -> None:
    files = {"C": str(pki.cert_file), "K": str(pki.key_file), "A": str(pki.ca_file)}
    with pytest.raises(ValueError, match=message):
        TlsConfig(**{k: files[v] for k, v in kwargs.items()})


@pytest.mark.parametrize(
    "field,flag",
    [
        ("cert_file", "--tls-cert-file"),
        ("key_file", "--tls-key-file"),
        ("ca_file", "--tls-ca-file"),
    ],
)
def test_unreadable_or_non_pem_files_are_rejected(pki: Pki, tmp_path: Path, field: str, flag: str) -> None:
    good = {
        "cert_file": str(pki.cert_file),
        "key_file": str(pki.key_file),
        "ca_file": str(pki.ca_file),
    }
    missing = tmp_path / "missing.pem"
    with pytest.raises(ValueError, match=f"^{flag} {missing}: cannot read it"):
        TlsConfig(**{**good, field: str(missing)})
    with pytest.raises(ValueError, match=f"^{flag} {tmp_path}: cannot read it"):
        TlsConfig(**{**good, field: str(tmp_path)})  # a directory
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ValueError, match=f"^{flag} {garbage}: not a PEM file"):
        TlsConfig(**{**good, field: str(garbage)})


def test_files_are_read_once_at_start(pki: Pki, tmp_path: Path) -> None:
    """Reload-on-start: the config keeps what it read, even when the files go away later."""
    moved = make_pki(tmp_path / "moving")
    tls = moved.tls()
    for path in (moved.cert_file, moved.key_file, moved.ca_file):
        path.unlink()
    assert tls.server_credentials() is not None and tls.channel_credentials() is not None


def _parser(env_prefix: str | None, environ: dict[str, str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_tls_cli_args(parser, env_prefix, environ)
    return parser


def test_flags_and_environment(pki: Pki) -> None:
    flags = [
        "--tls-cert-file",
        str(pki.cert_file),
        "--tls-key-file",
        str(pki.key_file),
        "--tls-ca-file",
        str(pki.ca_file),
    ]
    ns = _parser("MESHLM_X_", {}).parse_args(flags)
    assert TlsConfig.from_cli_args(ns) == pki.tls()
    env = {
        "MESHLM_X_TLS_CERT_FILE": str(pki.cert_file),
        "MESHLM_X_TLS_KEY_FILE": str(pki.key_file),
    }
    ns = _parser("MESHLM_X_", env).parse_args([])
    assert TlsConfig.from_cli_args(ns) == pki.tls(mutual=False)
    assert TlsConfig.from_env("MESHLM_X_", env) == pki.tls(mutual=False)
    # a flag wins over the environment; without an env prefix the environment is not read
    ns = _parser("MESHLM_X_", env).parse_args(["--tls-ca-file", str(pki.ca_file)])
    assert TlsConfig.from_cli_args(ns) == pki.tls()
    assert _parser(None, env).parse_args([]).tls_cert_file is None
    assert TlsConfig.from_env("MESHLM_X_", {"MESHLM_X_TLS_CERT_FILE": ""}) == PLAINTEXT
    help_text = _parser("MESHLM_X_", {}).format_help()
    assert "MESHLM_X_TLS_CA_FILE" in help_text and "--tls-key-file PATH" in help_text


@pytest.mark.parametrize(
    "health_port,port,ok",
    [
        (None, 50051, True),
        (8081, 50051, True),
        (0, 50051, False),
        (70000, 50051, False),
        (50051, 50051, False),
    ],
)
def test_health_port_validation(health_port: int | None, port: int, ok: bool) -> None:
    if ok:
        validate_health_port(health_port, port)
    else:
        with pytest.raises(ValueError, match="--health-port"):
            validate_health_port(health_port, port)


def test_every_component_takes_the_same_flags(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> None:
    from meshlm.detokenizer.config import DetokenizerConfig
    from meshlm.gateway.config import GatewayConfig
    from meshlm.scheduler.service.config import parse_args as scheduler_args
    from meshlm.tokenizer.config import TokenizerConfig

    flags = [
        "--tls-cert-file",
        str(pki.cert_file),
        "--tls-key-file",
        str(pki.key_file),
        "--tls-ca-file",
        str(pki.ca_file),
    ]
    p = argparse.ArgumentParser()
    TokenizerConfig.add_cli_args(p)
    tok = TokenizerConfig.from_cli_args(p.parse_args([*flags, "--health-port", "8081"]))
    assert tok.tls == pki.tls() and tok.health_port == 8081
    assert '"tls": {"ca_file"' in tok.to_json()
    p = argparse.ArgumentParser()
    DetokenizerConfig.add_cli_args(p, environ={})
    detok = DetokenizerConfig.from_cli_args(p.parse_args([*flags, "--tokenizer-path", "t"]))
    assert detok.tls == pki.tls() and detok.health_port is None
    svc, _ = scheduler_args([*flags, "--health-port", "8081"])
    assert svc.tls == pki.tls() and svc.health_port == 8081

    def gateway(argv: list[str], env: dict[str, str]) -> GatewayConfig:
        p = argparse.ArgumentParser()
        GatewayConfig.add_cli_args(p, environ=env)
        return GatewayConfig.from_cli_args(p.parse_args(argv))

    assert gateway(flags, {}).tls == pki.tls()
    env = {
        "MESHLM_GATEWAY_TLS_CERT_FILE": str(pki.cert_file),
        "MESHLM_GATEWAY_TLS_KEY_FILE": str(pki.key_file),
    }
    assert gateway([], env).tls == pki.tls(mutual=False)
    assert gateway([], {}).tls == PLAINTEXT

    monkeypatch.setenv("MESHLM_TOKENIZER_TLS_CERT_FILE", str(pki.cert_file))
    monkeypatch.setenv("MESHLM_TOKENIZER_TLS_KEY_FILE", str(pki.key_file))
    monkeypatch.setenv("MESHLM_TOKENIZER_HEALTH_PORT", "8082")
    assert TokenizerConfig.from_env().tls == pki.tls(mutual=False)
    p = argparse.ArgumentParser()
    TokenizerConfig.add_cli_args(p)
    tok = TokenizerConfig.from_cli_args(p.parse_args([]))
    assert tok.tls == pki.tls(mutual=False) and tok.health_port == 8082
    with pytest.raises(ValueError, match="--health-port must differ from --port"):
        TokenizerConfig(port=50051, health_port=50051)


def test_launch_passes_the_flags_to_all_four(pki: Pki) -> None:
    from meshlm.launch.cli import build_parser
    from meshlm.launch.launcher import LaunchPlan, plan_children

    args = build_parser().parse_args(["launch", *pki.flags()])
    tls = TlsConfig.from_cli_args(args)
    assert tls == pki.tls()
    children = plan_children(LaunchPlan(model_path="m", tokenizer_path="t", tls=tls))
    assert sorted(c.component for c in children) == [
        "detokenizer",
        "gateway",
        "scheduler",
        "tokenizer",
    ]
    expected = dict(zip(pki.flags()[::2], pki.flags()[1::2]))
    for c in children:
        assert {f: c.argv[c.argv.index(f) + 1] for f in expected} == expected, c.argv
    plain = plan_children(LaunchPlan(model_path="m", tokenizer_path="t"))
    assert not any(a.startswith("--tls-") for c in plain for a in c.argv)

"""DetokenizerConfig: flags, env-var fallbacks (a flag wins), validation, --help."""

from __future__ import annotations

import argparse

import pytest

from meshlm.detokenizer.__main__ import build_parser
from meshlm.detokenizer.config import DetokenizerConfig


def parse(argv: list[str], env: dict[str, str]) -> DetokenizerConfig:
    parser = argparse.ArgumentParser()
    DetokenizerConfig.add_cli_args(parser, environ=env)
    return DetokenizerConfig.from_cli_args(parser.parse_args(argv))


def test_defaults_env_and_flags() -> None:
    c = parse(["--tokenizer-path", "/tok"], {})
    assert (c.port, c.max_states, c.undelivered_hold_s, c.metrics_port, c.otlp_endpoint) == (
        50053,
        65536,
        10.0,
        None,
        None,
    )
    env = {
        "MESHLM_DETOKENIZER_PORT": "6000",
        "MESHLM_DETOKENIZER_TOKENIZER_PATH": "/env",
        "MESHLM_DETOKENIZER_UNDELIVERED_HOLD_S": "2.5",
        "MESHLM_DETOKENIZER_METRICS_PORT": "9100",
    }
    c = parse([], env)
    assert (c.port, c.tokenizer_path, c.undelivered_hold_s, c.metrics_port) == (
        6000,
        "/env",
        2.5,
        9100,
    )
    c = parse(["--port", "7000"], env)
    assert c.port == 7000 and c.tokenizer_path == "/env"


@pytest.mark.parametrize(
    "argv, field",
    [
        ([], "tokenizer_path"),
        (["--tokenizer-path", "t", "--max-states", "0"], "max_states"),
        (["--tokenizer-path", "t", "--port", "70000"], "port"),
    ],
)
def test_invalid_values_name_the_field(argv: list[str], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        parse(argv, {})


def test_help_documents_flags_and_env_vars() -> None:
    text = build_parser().format_help()
    for flag in (
        "--tokenizer-path",
        "--port",
        "--metrics-port",
        "--max-states",
        "--undelivered-hold-s",
        "--grace-period-s",
        "--otlp-endpoint",
        "--log-format",
    ):
        assert flag in text
    assert "MESHLM_DETOKENIZER_UNDELIVERED_HOLD_S" in text.replace("\n", "").replace(" ", "")

"""The secrets of one service: the public API key and the ring's internal token, from a flag, a
file or the environment (the same flags in every component that has them):

    --api-key, --api-key-file                  gateway (HTTP) and tokenizer (public gRPC API):
                                               clients must send `authorization: Bearer <key>`
    --internal-token, --internal-token-file    every component: the shared token every ring link
                                               carries (`authorization: Bearer <token>`) and every
                                               internal server requires

Each also reads <ENV_PREFIX>API_KEY, ..._API_KEY_FILE, ..._INTERNAL_TOKEN, ..._INTERNAL_TOKEN_FILE
(meshlm.common.flags). A value given on the command line is visible to every user in `ps`; a file
or the environment is not (a process's environment is readable only by its own user), so
`meshlm launch` and the Helm charts use those.

Invariants of an AuthConfig:
* a secret comes from its value or its file, never both (ValueError names the two flags);
* a file is read once, when the config is built; trailing whitespace (a newline) is dropped and
  what is left must be non-empty printable ASCII without spaces, since it travels in an HTTP
  header and in gRPC metadata; the error names the flag and the file, never the secret;
* secrets never appear in repr() or in describe() (what to_json and GetServerInfo show).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from meshlm.common.flags import Flag, add_config_flags, config_values, env_values

# field -> flag; the public pair exists only in components with a public API.
PUBLIC_FIELDS = ("api_key", "api_key_file")
INTERNAL_FIELDS = ("internal_token", "internal_token_file")
_SECRETS = {"api_key": "api_key_file", "internal_token": "internal_token_file"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_secret(value: str, where: str) -> str:
    """value without trailing whitespace, if it is a usable secret; else ValueError naming `where`."""
    secret = value.rstrip()
    if not secret:
        raise ValueError(f"{where} is empty")
    if not all(0x21 <= ord(ch) <= 0x7E for ch in secret):
        raise ValueError(
            f"{where} must be printable ASCII without spaces (it travels in HTTP headers and gRPC metadata)"
        )
    return secret


def _read_secret(name: str, path: str) -> str:
    flag = _flag(name)
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    return check_secret(data, f"{flag} {path}")


@dataclass(frozen=True)
class AuthConfig:
    """The secrets of one service; all unset = no authentication. Read the secrets through
    api_key_value / internal_token_value (the value given, or the file's content)."""

    api_key: str | None = field(default=None, repr=False)
    api_key_file: str | None = None
    internal_token: str | None = field(default=None, repr=False)
    internal_token_file: str | None = None

    def __post_init__(self) -> None:
        resolved: dict[str, str | None] = {}
        for name, file_name in _SECRETS.items():
            for n in (name, file_name):
                if getattr(self, n) == "":
                    object.__setattr__(self, n, None)
            value, path = getattr(self, name), getattr(self, file_name)
            if value is not None and path is not None:
                raise ValueError(f"give {_flag(name)} or {_flag(file_name)}, not both")
            if path is not None:
                resolved[name] = _read_secret(file_name, path)
            else:
                resolved[name] = None if value is None else check_secret(value, _flag(name))
        object.__setattr__(self, "_resolved", MappingProxyType(resolved))

    def _secret(self, name: str) -> str | None:
        resolved: Mapping[str, str | None] = self.__dict__["_resolved"]
        return resolved[name]

    @property
    def api_key_value(self) -> str | None:
        """The public API key (None: the public API is open)."""
        return self._secret("api_key")

    @property
    def internal_token_value(self) -> str | None:
        """The ring's internal token (None: internal links carry and require none)."""
        return self._secret("internal_token")

    @property
    def enabled(self) -> bool:
        return self.api_key_value is not None or self.internal_token_value is not None

    def describe(self) -> dict[str, str]:
        """Whether each secret is set and where from, without the secret itself."""
        out = {}
        for name, file_name in _SECRETS.items():
            path = getattr(self, file_name)
            out[name] = f"file {path}" if path else ("set" if getattr(self, name) else "unset")
        return out

    @staticmethod
    def from_cli_args(ns: argparse.Namespace, public: bool) -> AuthConfig:
        """From the flags add_auth_cli_args added (environment fallbacks already applied)."""
        return AuthConfig(**config_values(_cli_flags(public), ns))

    @staticmethod
    def from_env(env_prefix: str, public: bool, environ: Mapping[str, str] | None = None) -> AuthConfig:
        """From <env_prefix>API_KEY, ..._API_KEY_FILE, ..._INTERNAL_TOKEN, ..._INTERNAL_TOKEN_FILE."""
        return AuthConfig(**env_values(AuthConfig, _cli_flags(public), env_prefix, environ))


NO_AUTH = AuthConfig()

_VISIBLE = "visible to every user in `ps`: prefer the file or the environment variable"
_FLAGS: Mapping[str, Flag] = MappingProxyType(
    {
        "api_key": Flag(
            "the public API's key: clients must send `authorization: Bearer <key>` (an HTTP "
            f"header at the gateway, gRPC metadata at the tokenizer); health stays open. On the "
            f"command line it is {_VISIBLE}",
            metavar="KEY",
        ),
        "api_key_file": Flag("read the API key from this file (trailing newline dropped)", metavar="PATH"),
        "internal_token": Flag(
            "shared token of the ring: every gRPC client of this service sends it as "
            "`authorization: Bearer <token>` and every internal RPC it serves requires it "
            f"(health and reflection stay open). On the command line it is {_VISIBLE}",
            metavar="TOKEN",
        ),
        "internal_token_file": Flag(
            "read the internal token from this file (trailing newline dropped)", metavar="PATH"
        ),
    }
)


def _cli_flags(public: bool) -> Mapping[str, Flag]:
    names = (*PUBLIC_FIELDS, *INTERNAL_FIELDS) if public else INTERNAL_FIELDS
    return {n: _FLAGS[n] for n in names}


def add_auth_cli_args(
    parser: argparse.ArgumentParser,
    env_prefix: str | None,
    public: bool,
    environ: Mapping[str, str] | None = None,
) -> None:
    """--internal-token[-file] (and with `public` --api-key[-file]), each defaulting to
    <env_prefix><FIELD> from the environment (env_prefix None: none); read them back with
    AuthConfig.from_cli_args."""
    group = parser.add_argument_group(
        "authentication",
        "API key of the public API and the ring's internal token (all unset: open). Give a "
        "secret as a file or an environment variable: a command-line value shows in `ps`.",
    )
    add_config_flags(group, AuthConfig, _cli_flags(public), env_prefix=env_prefix, environ=environ)


__all__ = ["AuthConfig", "NO_AUTH", "add_auth_cli_args", "check_secret"]

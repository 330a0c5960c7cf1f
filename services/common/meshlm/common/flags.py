"""The one way a frozen config dataclass becomes command-line flags with environment fallbacks.

Used by every service config (meshlm.common.service_config), the engine's SchedulerConfig and
the --tls-* flags. Naming: the field `foo_bar` (behind an optional dest prefix such as "tls_")
is the flag `--foo-bar`, the argparse dest `foo_bar` and the environment variable
`<env_prefix>FOO_BAR`, e.g. MESHLM_TOKENIZER_SCHEDULER_ADDRS. Precedence: flag > environment >
the field's default; `--help` names each flag's variable and built-in default.

Values, on the command line and in the environment alike: int and float fields as Python parses
them; Optional fields also take "" or "none" (None); tuple[str, ...] fields a comma-separated
host:port list; bool fields are --x / --no-x switches on the command line (or take a value when
their Flag says `parse=parse_bool`) and true|false in the environment (empty is false). A bad
environment value stops the program (SystemExit) with a message naming the variable, as a bad
flag value does.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any, Union

from meshlm.common.addresses import parse_addresses

Parse = Callable[[str], Any]


@dataclass(frozen=True)
class Flag:
    """How one field appears on the command line: its help text, how a value string is parsed
    (None: from the field's type), any extra option strings (e.g. --model) and the value's name
    in --help."""

    help: str
    parse: Parse | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None


def option(dest: str) -> str:
    """--foo-bar of the field (dest) foo_bar."""
    return "--" + dest.replace("_", "-")


def env_var(env_prefix: str, dest: str) -> str:
    """<env_prefix>FOO_BAR of the field (dest) foo_bar."""
    return env_prefix + dest.upper()


def parse_bool(value: str) -> bool:
    """true/1/yes/on or false/0/no/off (any case); empty is false."""
    v = str(value).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def parse_addresses_flag(value: str) -> tuple[str, ...]:
    """A comma-separated host:port list ("" = none)."""
    try:
        return tuple(parse_addresses(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def optional(parse: Parse) -> Parse:
    """parse, with "" / "none" meaning None."""

    def parse_optional(value: str) -> Any:
        return None if value.strip().lower() in ("", "none") else parse(value)

    parse_optional.__name__ = getattr(parse, "__name__", "value")  # argparse names it in errors
    return parse_optional


_PARSERS: Mapping[Any, Parse] = {int: int, float: float, str: str, bool: parse_bool}


def _field_parse(hint: Any) -> Parse:
    """The value parser of a field's type: int, float, str, bool, Optional[...], tuple[str, ...]."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (Union, types.UnionType) and len(args) == 1:
        return optional(_field_parse(args[0]))
    if typing.get_origin(hint) is tuple:
        return parse_addresses_flag
    if hint in _PARSERS:
        return _PARSERS[hint]
    raise TypeError(f"no flag parser for fields of type {hint!r}")


def _is_switch(hint: Any, flag: Flag) -> bool:
    return hint is bool and flag.parse is None


def _show(value: Any) -> str:
    if value is None or value == "" or value == ():
        return "unset"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _env_value(var: str, raw: str, parse: Parse) -> Any:
    try:
        return parse(raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        raise SystemExit(f"invalid value {raw!r} in the environment variable {var}: {e}") from None


def add_config_flags(
    parser: argparse._ActionsContainer,
    cls: type,
    flags: Mapping[str, Flag],
    *,
    env_prefix: str | None,
    environ: Mapping[str, str] | None = None,
    dest_prefix: str = "",
) -> None:
    """One flag per entry of `flags` (a field of the dataclass `cls`), defaulting to its
    environment variable when env_prefix is given and set, else to the field's default."""
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    defaults = {f.name: f.default for f in fields(cls) if f.default is not MISSING}
    for name, flag in flags.items():
        dest = dest_prefix + name
        hint = hints[name]
        switch = _is_switch(hint, flag)
        parse = flag.parse or _field_parse(hint)
        default = defaults.get(name)
        notes = []
        if env_prefix is not None:
            var = env_var(env_prefix, dest)
            notes.append(f"env {var}")
            if var in env:
                default = _env_value(var, env[var], parse)
        if not switch:  # argparse shows a switch's --no- form; some versions add its default
            notes.append(f"default: {_show(defaults.get(name))}")
        help_text = f"{flag.help} ({'; '.join(notes)})" if notes else flag.help
        if switch:
            parser.add_argument(
                option(dest),
                *flag.aliases,
                dest=dest,
                default=default,
                help=help_text,
                action=argparse.BooleanOptionalAction,
            )
        else:
            parser.add_argument(
                option(dest),
                *flag.aliases,
                dest=dest,
                default=default,
                help=help_text,
                type=parse,
                metavar=flag.metavar,
            )


def config_values(flags: Mapping[str, Flag], ns: argparse.Namespace, dest_prefix: str = "") -> dict[str, Any]:
    """The fields of `flags` as parsed into ns by add_config_flags."""
    return {name: getattr(ns, dest_prefix + name) for name in flags}


def env_values(
    cls: type,
    flags: Mapping[str, Flag],
    env_prefix: str,
    environ: Mapping[str, str] | None = None,
    dest_prefix: str = "",
) -> dict[str, Any]:
    """The fields of `flags` whose environment variables are set, parsed as their flags are."""
    env = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    out: dict[str, Any] = {}
    for name, flag in flags.items():
        var = env_var(env_prefix, dest_prefix + name)
        if var in env:
            out[name] = _env_value(var, env[var], flag.parse or _field_parse(hints[name]))
    return out

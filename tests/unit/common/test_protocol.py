"""meshlm.common.protocol: the opening Hello of every ring stream is checked in one place, a peer
of another version is refused naming both versions, and protos/CHANGELOG.md records the version."""

from __future__ import annotations

import re
from pathlib import Path

import grpc
import pytest

from meshlm.common import protocol
from meshlm.common.errors import ServiceError
from meshlm.v1 import common_pb2

CHANGELOG = Path(__file__).resolve().parents[3] / "protos" / "CHANGELOG.md"


def test_changelog_names_the_current_version_first() -> None:
    versions = [int(v) for v in re.findall(r"^## Protocol (\d+)$", CHANGELOG.read_text(), re.M)]
    assert versions and versions[0] == protocol.PROTOCOL_VERSION
    assert versions == sorted(versions, reverse=True)


def test_a_hello_of_this_version_names_its_peer() -> None:
    hello = protocol.hello("tok-1")
    assert hello.protocol_version == protocol.PROTOCOL_VERSION
    assert protocol.check_hello("hello", hello, "scheduler", "Connect") == "tok-1"


@pytest.mark.parametrize(
    "version, theirs",
    [(protocol.PROTOCOL_VERSION + 1, protocol.PROTOCOL_VERSION + 1), (0, protocol.UNVERSIONED_PROTOCOL)],
)
def test_another_version_is_refused_naming_both(version: int, theirs: int) -> None:
    with pytest.raises(ServiceError) as e:
        protocol.check_hello("hello", common_pb2.Hello(peer_id="x", protocol_version=version), "scheduler", "Connect")
    assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert f"protocol {theirs}," in e.value.message
    assert f"this scheduler speaks {protocol.PROTOCOL_VERSION}" in e.value.message


def test_no_hello_or_another_message_first() -> None:
    with pytest.raises(ServiceError) as old:  # a protocol-1 hello is a field this version lacks
        protocol.check_hello(None, common_pb2.Hello(), "detokenizer", "Push")
    assert old.value.code == grpc.StatusCode.FAILED_PRECONDITION and "protocol 1" in old.value.message
    with pytest.raises(ServiceError) as other:
        protocol.check_hello("generate", common_pb2.Hello(), "scheduler", "Connect")
    assert other.value.code == grpc.StatusCode.INVALID_ARGUMENT and "must be hello" in other.value.message
    with pytest.raises(ServiceError) as nameless:
        protocol.check_hello("hello", protocol.hello(""), "scheduler", "Connect")
    assert nameless.value.code == grpc.StatusCode.INVALID_ARGUMENT and "peer_id" in nameless.value.message

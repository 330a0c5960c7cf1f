"""The ring protocol's version, and the Hello that opens every internal stream.

Every Connect, Push and Subscribe stream starts with a meshlm.v1.Hello naming the peer and the
protocol version it speaks. The server checks it (`check_hello`) and refuses a peer of another
version with FAILED_PRECONDITION, naming both versions, so mismatched deployments fail loudly at
connect time instead of misreading each other's messages. protos/CHANGELOG.md records each
version; bump PROTOCOL_VERSION with any change a peer of the previous version would misread.
"""

from __future__ import annotations

import grpc

from meshlm.common.errors import ServiceError
from meshlm.v1 import common_pb2

PROTOCOL_VERSION = 3
# What a peer from before versioning speaks: its hello carried no version (it reads as 0).
UNVERSIONED_PROTOCOL = 1


def hello(peer_id: str) -> common_pb2.Hello:
    """This process's Hello as `peer_id`."""
    return common_pb2.Hello(peer_id=peer_id, protocol_version=PROTOCOL_VERSION)


def version_mismatch(peer_version: int, server: str) -> str | None:
    """None when the peer speaks this protocol version; otherwise the refusal message."""
    if peer_version == PROTOCOL_VERSION:
        return None
    theirs = peer_version or UNVERSIONED_PROTOCOL
    return (
        f"protocol version mismatch: the peer speaks meshlm.v1 ring protocol {theirs}, "
        f"this {server} speaks {PROTOCOL_VERSION}; run the same meshlm release on both sides"
    )


def check_hello(kind: str | None, first: common_pb2.Hello, server: str, stream: str) -> str:
    """The peer id of a stream's opening message, or a ServiceError to refuse the stream with.

    `kind` is which field of the first message is set ("hello" for a Hello in `first`). None,
    no known field, is what a protocol-1 peer's hello reads as (FAILED_PRECONDITION); another
    message before the hello is a broken peer (INVALID_ARGUMENT)."""
    if kind is None:
        raise ServiceError(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{stream} must open with a hello naming the protocol version; {version_mismatch(0, server)}",
        )
    if kind != "hello":
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"the first message of {stream} must be hello, got {kind}")
    refusal = version_mismatch(first.protocol_version, server)
    if refusal is not None:
        raise ServiceError(grpc.StatusCode.FAILED_PRECONDITION, refusal)
    if not first.peer_id:
        raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"the hello of {stream} must name its peer (peer_id)")
    return first.peer_id

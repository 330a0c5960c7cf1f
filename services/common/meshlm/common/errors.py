"""One error mapping everywhere (DESIGN.md "Errors"): HTTP status <-> gRPC status code.

bad input          400  INVALID_ARGUMENT
missing/bad key    401  UNAUTHENTICATED
unknown session    404  NOT_FOUND
client went away   499  CANCELLED
queue full         503  RESOURCE_EXHAUSTED   (with Retry-After at the gateway)
component down     503  UNAVAILABLE
deadline           504  DEADLINE_EXCEEDED
anything else      500  INTERNAL
"""

from __future__ import annotations

import grpc

_HTTP_TO_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    499: grpc.StatusCode.CANCELLED,
    503: grpc.StatusCode.RESOURCE_EXHAUSTED,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
    500: grpc.StatusCode.INTERNAL,
}
_GRPC_TO_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 503,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def grpc_code_for_http(status: int) -> grpc.StatusCode:
    return _HTTP_TO_GRPC.get(status, grpc.StatusCode.INTERNAL)


def http_status_for_grpc(code: grpc.StatusCode) -> int:
    return _GRPC_TO_HTTP.get(code, 500)


class ServiceError(Exception):
    """An error with its gRPC code; servicers turn it into `context.abort(code, message)`."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

    @property
    def http_status(self) -> int:
        return http_status_for_grpc(self.code)

    @staticmethod
    def from_http(status: int, message: str) -> ServiceError:
        return ServiceError(grpc_code_for_http(status), message)

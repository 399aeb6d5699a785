"""Exceptions that servicers raise, and their mapping onto gRPC status codes.

A servicer raises one of these (or lets a library's `ValueError` through `invalid_argument_from`);
`services.common.interceptors.ErrorMappingInterceptor` turns it into the status the client sees,
with google.rpc rich details (`BadRequest` field violations for INVALID_ARGUMENT) readable through
`grpc_status.rpc_status.from_call`. Any other exception becomes INTERNAL, never UNKNOWN.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterable, Iterator

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import Message
from google.rpc import error_details_pb2, status_pb2


class MeshlineError(Exception):
    """Base of every error a servicer raises on purpose: a status code plus a user-facing message.

    `details` are google.rpc detail messages (BadRequest, ErrorInfo, ...) sent in the rich status.
    """

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, *, details: Iterable[Message] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.details = list(details)

    def to_status(self) -> status_pb2.Status:
        """The google.rpc.Status carrying this error's code, message and details."""
        packed = []
        for detail in self.details:
            any_detail = any_pb2.Any()
            any_detail.Pack(detail)
            packed.append(any_detail)
        return status_pb2.Status(code=self.code.value[0], message=self.message, details=packed)


class InvalidArgument(MeshlineError):
    """A request field is malformed or out of range (INVALID_ARGUMENT with BadRequest details)."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, reason: str) -> None:
        self._set_violations([(field, reason)])

    @classmethod
    def from_violations(cls, violations: Iterable[tuple[str, str]]) -> InvalidArgument:
        """One error listing several `(field, reason)` violations (at least one)."""
        violations = list(violations)
        if not violations:
            raise ValueError("InvalidArgument.from_violations needs at least one (field, reason)")
        error = cls.__new__(cls)
        error._set_violations(violations)
        return error

    def _set_violations(self, violations: list[tuple[str, str]]) -> None:
        self.violations = violations
        message = "invalid request: " + "; ".join(f"{f}: {reason}" for f, reason in violations)
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=f, description=reason)
                for f, reason in violations
            ]
        )
        MeshlineError.__init__(self, message, details=[bad_request])


class NotFound(MeshlineError):
    """A named artifact (operation, checkpoint, dataset) does not exist."""

    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(MeshlineError):
    """The request is understood but not allowed (e.g. a path outside the allowed roots)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class Conflict(MeshlineError):
    """The request conflicts with a concurrent job or existing state (ABORTED; retry may help)."""

    code = grpc.StatusCode.ABORTED


class FailedPrecondition(MeshlineError):
    """The system is not in the state the request needs (e.g. no model loaded)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class OutOfRange(MeshlineError):
    """A value is valid in general but past the current limit (e.g. a prompt longer than max)."""

    code = grpc.StatusCode.OUT_OF_RANGE


class ResourceExhausted(MeshlineError):
    """A quota or capacity is used up (memory, concurrent jobs, queue length)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unimplemented(MeshlineError):
    """The method or option exists in the contract but this server does not provide it."""

    code = grpc.StatusCode.UNIMPLEMENTED


class Unavailable(MeshlineError):
    """The server cannot serve this now (shutting down, a dependency down); retry later."""

    code = grpc.StatusCode.UNAVAILABLE


class Cancelled(MeshlineError):
    """A job stopped because its cancellation was requested."""

    code = grpc.StatusCode.CANCELLED


class Validator:
    """Collects every request-field violation, then raises them together.

    ```
    check = Validator()
    check.require(request.max_new_tokens >= 0, "max_new_tokens", "must be >= 0")
    check.require(0 < request.top_p <= 1, "top_p", "must be in (0, 1]")
    check.raise_if_any()
    ```
    """

    def __init__(self) -> None:
        self.violations: list[tuple[str, str]] = []

    def require(self, condition: object, field: str, reason: str) -> bool:
        """Records `(field, reason)` unless `condition` holds; returns whether it held."""
        if not condition:
            self.violations.append((field, reason))
            return False
        return True

    def raise_if_any(self) -> None:
        """Raises one InvalidArgument listing every recorded violation, if there are any."""
        if self.violations:
            raise InvalidArgument.from_violations(self.violations)


@contextlib.contextmanager
def invalid_argument_from(*exc_types: type[BaseException], field: str) -> Iterator[None]:
    """Re-raises the given exception types (default `ValueError`) as InvalidArgument on `field`.

    For libraries that validate with ValueError, e.g. building a config from request fields:
    `with invalid_argument_from(ValueError, field="config"): cfg = TrainConfig(**fields)`.
    Exceptions not listed pass through (and become INTERNAL if they escape the servicer).
    """
    types = exc_types or (ValueError,)
    try:
        yield
    except types as exc:
        raise InvalidArgument(field, str(exc)) from exc


NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


def from_os_error(exc: BaseException) -> MeshlineError | None:
    """RESOURCE_EXHAUSTED for a full disk or quota (naming the path), else None.

    A job that runs out of space is not an internal error: the operator (or the requester,
    choosing another output) can act on it.
    """
    if not isinstance(exc, OSError) or exc.errno not in NO_SPACE_ERRNOS:
        return None
    where = f"writing {exc.filename!s}" if exc.filename else "writing the output"
    kind = "disk quota exceeded (EDQUOT)" if exc.errno == errno.EDQUOT else "ENOSPC"
    return ResourceExhausted(
        f"no space left on device {where} ({kind}); free space there or choose another "
        "output directory"
    )

"""Checks of optional numeric request fields that every job servicer repeats: a field the
request sets must lie in a range, named in the message with the value it had.

    check = Validator()
    check_range(check, request, "batch_size", 1, config.max_batch_size)
    check_range(check, request, "limit", 1)            # no upper bound
    check.raise_if_any()
"""

from __future__ import annotations

from google.protobuf.message import Message

from services.common.errors import Validator


def check_range(
    check: Validator,
    request: Message,
    field: str,
    low: float,
    high: float | None = None,
    bound: str = "",
) -> None:
    """When `request` sets the optional `field`, record a violation unless `low <= value <=
    high` (`value >= low` when `high` is None); `bound` says where the limit comes from
    (" (the server's --max-workers)")."""
    if not request.HasField(field):
        return
    value = getattr(request, field)
    if high is None:
        check.require(value >= low, field, f"must be >= {low}, got {value}")
    else:
        check.require(
            low <= value <= high, field, f"must be in [{low}, {high}]{bound}, got {value}"
        )


def check_ranges(
    check: Validator, request: Message, limits: dict[str, tuple[float, float | None]]
) -> None:
    """`check_range` for each `field: (low, high)` of `limits`, in order."""
    for field, (low, high) in limits.items():
        check_range(check, request, field, low, high)

"""UpdateWeights over gRPC: read the stream into an `engine.weight_update.WeightUpdate`, then swap.

The stream is untrusted: its header is checked before any tensor, each tensor when it starts
(name, dtype, shape against the served model) and its bytes as they come, all through the
library's checks (INVALID_ARGUMENT naming the tensor; a stale version FAILED_PRECONDITION).
Nothing touches the served weights until the whole update is staged; the swap then runs on the
engine thread between two steps, so a refused update leaves the previous weights serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from google.protobuf.message import DecodeError

from engine.weight_update import (
    AppliedUpdate,
    StaleVersion,
    WeightUpdate,
    WeightUpdateError,
    WeightVersion,
)
from meshline.inference.v1 import inference_pb2
from services.common.errors import (
    Conflict,
    FailedPrecondition,
    InvalidArgument,
    MeshlineError,
    PermissionDenied,
)
from services.inference.metrics import WEIGHT_UPDATE_SECONDS, WEIGHTS_VERSION
from services.inference.serving import ServingEngine

log = logging.getLogger(__name__)
KINDS = {
    inference_pb2.WEIGHT_UPDATE_KIND_FULL: "full",
    inference_pb2.WEIGHT_UPDATE_KIND_PARTIAL: "partial",
    inference_pb2.WEIGHT_UPDATE_KIND_LORA: "lora",
}
"""Header kind -> engine.weight_update's kind."""


def refusal(error: WeightUpdateError) -> MeshlineError:
    """The status of an update the model cannot take: a stale version is FAILED_PRECONDITION
    (the request is well formed, the server has moved on), anything else INVALID_ARGUMENT."""
    if isinstance(error, StaleVersion):
        return FailedPrecondition(f"weight update refused: {error}")
    return InvalidArgument(error.field, error.reason)


def require_updates(served: WeightVersion | None) -> WeightVersion:
    """The served weights' version, or PERMISSION_DENIED when this server takes no updates."""
    if served is None:
        raise PermissionDenied(
            "UpdateWeights: this server was started without --allow-weight-updates; restart it "
            "with that flag (and --auth-token-file) to let a trainer replace its weights"
        )
    return served


async def receive_update(
    served: WeightVersion, requests: AsyncIterator[inference_pb2.UpdateWeightsRequest]
) -> WeightUpdate:
    """The update the stream carries, complete and checked (raises the refusal's status)."""
    update: WeightUpdate | None = None
    try:
        async for message in _decoded(requests):
            part = message.WhichOneof("part")
            if update is None:
                update = _start(served, message, part)
                continue
            if part != "chunk":
                raise InvalidArgument("header", "send the header once, as the first message")
            chunk = message.chunk
            if chunk.offset == 0 and (chunk.dtype or chunk.shape):
                update.start_tensor(chunk.name, chunk.dtype, tuple(chunk.shape))
            update.add_bytes(chunk.name, chunk.offset, chunk.data)
        if update is None:
            raise InvalidArgument("header", "the stream was empty; send a header, then tensors")
        update.finish()
    except WeightUpdateError as exc:
        raise refusal(exc) from None
    return update


async def _decoded(
    requests: AsyncIterator[inference_pb2.UpdateWeightsRequest],
) -> AsyncIterator[inference_pb2.UpdateWeightsRequest]:
    """The stream's messages; one whose bytes do not parse is INVALID_ARGUMENT (grpc would
    report the deserializer's exception as INTERNAL)."""
    try:
        async for message in requests:
            yield message
    except DecodeError as exc:
        raise InvalidArgument(
            "request body",
            f"a message of the stream is not a valid UpdateWeightsRequest ({exc}); send "
            "serialized UpdateWeightsRequest messages",
        ) from None


def _start(
    served: WeightVersion, message: inference_pb2.UpdateWeightsRequest, part: str | None
) -> WeightUpdate:
    if part != "header":
        raise InvalidArgument("header", "the first message must be the header (version, kind)")
    header = message.header
    if header.kind not in KINDS:
        raise InvalidArgument(
            "header.kind",
            "give WEIGHT_UPDATE_KIND_FULL, WEIGHT_UPDATE_KIND_PARTIAL or WEIGHT_UPDATE_KIND_LORA",
        )
    return WeightUpdate(
        served,
        header.version,
        kind=KINDS[header.kind],
        num_tensors=header.num_tensors,
        lora_scaling=header.lora_scaling,
    )


async def update_weights(
    served: WeightVersion,
    engine: ServingEngine,
    requests: AsyncIterator[inference_pb2.UpdateWeightsRequest],
) -> inference_pb2.UpdateWeightsResponse:
    """Stage the streamed update, then swap it in between two engine steps (one at a time)."""
    if not served.busy.acquire(blocking=False):
        raise Conflict(
            "UpdateWeights: another weight update is being received; retry once it finished "
            "(GetWeightsVersion shows the version served)"
        )
    try:
        began = time.perf_counter()
        update = await receive_update(served, requests)
        await asyncio.to_thread(update.prepare)  # lora: the merges, off the engine thread
        received = time.perf_counter()
        try:
            applied = await engine.front.run(lambda: _swap_in(update, engine))
        except WeightUpdateError as exc:
            raise refusal(exc) from None
        swapped = time.perf_counter()
    finally:
        served.busy.release()
    WEIGHTS_VERSION.set(applied.version)
    WEIGHT_UPDATE_SECONDS.labels("receive").observe(received - began)
    WEIGHT_UPDATE_SECONDS.labels("swap").observe(swapped - received)
    log.info(
        "weights version %d: %d tensors, %d bytes (received in %.3f s, swapped in %.3f s)",
        applied.version,
        applied.num_tensors,
        applied.num_bytes,
        received - began,
        swapped - received,
    )
    return inference_pb2.UpdateWeightsResponse(
        version=applied.version,
        num_tensors=applied.num_tensors,
        num_bytes=applied.num_bytes,
        receive_seconds=received - began,
        swap_seconds=swapped - received,
    )


def _swap_in(update: WeightUpdate, engine: ServingEngine) -> AppliedUpdate:
    """Apply a prepared update on the engine thread and retire the prefix cache's blocks computed
    with the weights it replaced (the engine's weights generation)."""
    applied = update.apply()
    weights_changed = getattr(engine.engine, "weights_changed", None)
    if weights_changed is not None:  # engines without a prefix cache have nothing to retire
        weights_changed()
    return applied

"""The trainer's side of disaggregated RL: push policy weights to rollout servers, ask for rollouts.

```
from meshline_client import Connection
from meshline_client.weight_sync import RolloutClient, lora_factors

servers = RolloutClient([Connection("10.0.0.5:50054", token=...), ...])
servers.push(policy, version=step)          # every endpoint, concurrently; timings per endpoint
servers.push(lora_factors(policy), version=step, lora_scaling=alpha / r)   # LoRA runs
groups = servers.rollouts(prompts, n=8, do_sample=True, temperature=1.0, max_new_tokens=128)
```

Weights travel as `InferenceService.UpdateWeights` streams: a header (version; full, partial or
LoRA factors), then each tensor's raw little-endian bytes in chunks under the gRPC message
limit, the first chunk carrying dtype and shape. Names are the model's `named_parameters()` (a tied head once,
under its embedding's name), the served model's own names when trainer and server both run
Meshline's CausalLM. A server answers only once the update is swapped in, so rollouts asked for
after `push` returns come from the new weights.

This module imports torch (the client's other modules do not); import it by its path.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import nn

from meshline.inference.v1 import inference_pb2 as pb
from meshline.inference.v1 import inference_pb2_grpc as pb_grpc
from meshline_client.connection import Connection
from meshline_client.inference import Completion, InferenceClient

DEFAULT_CHUNK_BYTES = 4 * 2**20
"""Bytes per chunk message: well under the server's --max-request-mb (16 MiB by default)."""
MAX_CHUNK_BYTES = 64 * 2**20
LORA_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
UPDATE_WEIGHTS = "/meshline.inference.v1.InferenceService/UpdateWeights"


@dataclass(frozen=True)
class SyncResult:
    """One endpoint's answer to a push."""

    address: str
    """The endpoint ("host:port")."""
    version: int
    """The version it now serves."""
    num_tensors: int
    """Tensors it replaced."""
    num_bytes: int
    """Bytes it replaced."""
    seconds: float
    """Wall time of the push to it, from the first byte sent to the answer (weight-sync time)."""
    receive_seconds: float
    """The server's time from the header to the last byte staged."""
    swap_seconds: float
    """The server's time to swap the staged weights in."""


def resolve_endpoints(address: str) -> list[str]:
    """Every "ip:port" a "host:port" resolves to (IPv4): a Kubernetes headless Service
    (k8s/rollout) gives one address per ready replica, each of which needs the weights."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be 'host:port', got {address!r}")
    infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    return sorted({f"{info[4][0]}:{port}" for info in infos})


def named_tensors(
    weights: nn.Module | Mapping[str, torch.Tensor],
) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs to send: a module's `named_parameters()`, or the mapping as given."""
    if isinstance(weights, nn.Module):
        return [(name, p.detach()) for name, p in weights.named_parameters()]
    return [(name, t.detach()) for name, t in weights.items()]


def lora_factors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA factors of a model with adapters (`models.lora.apply_lora`, peft's names):
    `<module>.lora_A.weight` and `<module>.lora_B.weight`, to push with `lora_scaling`."""
    return {
        name: p.detach() for name, p in model.named_parameters() if name.endswith(LORA_SUFFIXES)
    }


def update_header(
    num_tensors: int, version: int, *, partial: bool = False, lora_scaling: float | None = None
) -> pb.UpdateWeightsRequest:
    """The first message of an UpdateWeights stream. With `lora_scaling` the tensors are LoRA
    factors (a lora update), else weights (full, or partial)."""
    if lora_scaling is not None:
        kind = pb.WEIGHT_UPDATE_KIND_LORA
    else:
        kind = pb.WEIGHT_UPDATE_KIND_PARTIAL if partial else pb.WEIGHT_UPDATE_KIND_FULL
    header = pb.WeightUpdateHeader(version=version, kind=kind, num_tensors=num_tensors)
    if lora_scaling is not None:
        header.lora_scaling = lora_scaling
    return pb.UpdateWeightsRequest(header=header)


def update_messages(
    tensors: Sequence[tuple[str, torch.Tensor]],
    version: int,
    *,
    partial: bool = False,
    lora_scaling: float | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[pb.UpdateWeightsRequest]:
    """The UpdateWeights stream for `tensors` as messages: header, then each tensor's chunks in
    order (`update_bodies` is the same stream serialized, faster)."""
    for body in update_bodies(
        tensors, version, partial=partial, lora_scaling=lora_scaling, chunk_bytes=chunk_bytes
    ):
        yield pb.UpdateWeightsRequest.FromString(body)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def update_bodies(
    tensors: Sequence[tuple[str, torch.Tensor]],
    version: int,
    *,
    partial: bool = False,
    lora_scaling: float | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[bytes]:
    """The UpdateWeights stream for `tensors`, serialized: the header, then each tensor's chunks
    in order, the first carrying dtype and shape. Each chunk's bytes are copied once: protobuf's
    Python path copies a chunk four times (slice, field, sub-message, wire) and ran at
    0.15-0.18 GB/s on the 2-core bench machine, the whole sync's bottleneck. A chunk is its
    small fields serialized by protobuf, then `data` (field 5) appended in wire format, inside
    `UpdateWeightsRequest.chunk` (field 2): the same message, field order aside."""
    header = update_header(len(tensors), version, partial=partial, lora_scaling=lora_scaling)
    yield header.SerializeToString()
    for name, tensor in tensors:
        flat = tensor.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        total, offset = flat.size, 0
        while True:
            end = min(offset + chunk_bytes, total)
            meta = pb.WeightChunk(name=name, offset=offset)
            if offset == 0:
                meta.dtype = str(tensor.dtype).removeprefix("torch.")
                meta.shape.extend(tensor.shape)
            head = meta.SerializeToString() + b"\x2a" + _varint(end - offset)
            size = len(head) + end - offset
            yield b"".join((b"\x12", _varint(size), head, flat[offset:end].data))
            offset = end
            if offset >= total:
                break


class RolloutClient:
    """Pushes weights to, and asks rollouts of, one or more inference endpoints."""

    def __init__(
        self, connections: Sequence[Connection], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> None:
        if not connections:
            raise ValueError("connections: give at least one inference endpoint")
        if not 1024 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ValueError(
                f"chunk_bytes must be in [1024, {MAX_CHUNK_BYTES}] and under the servers' "
                f"--max-request-mb, got {chunk_bytes}"
            )
        self.chunk_bytes = chunk_bytes
        self.clients = [InferenceClient(c) for c in connections]
        self._channels = [c.channel() for c in connections]
        self._stubs = [pb_grpc.InferenceServiceStub(channel) for channel in self._channels]
        self._updates = [
            channel.stream_unary(
                UPDATE_WEIGHTS, response_deserializer=pb.UpdateWeightsResponse.FromString
            )
            for channel in self._channels
        ]
        self._pool = ThreadPoolExecutor(max_workers=max(4, 2 * len(connections)))

    def close(self) -> None:
        """Close every channel."""
        self._pool.shutdown()
        for client, channel in zip(self.clients, self._channels, strict=True):
            client.close()
            channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def push(
        self,
        weights: nn.Module | Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        partial: bool = False,
        lora_scaling: float | None = None,
        dtype: torch.dtype | None = None,
        timeout_s: float | None = None,
    ) -> list[SyncResult]:
        """Send `weights` as `version` to every endpoint at once; one result per endpoint.

        `partial`: only some parameters (the rest stay); `lora_scaling` (alpha / r): `weights`
        are LoRA factors (`lora_factors(model)`) and each adapted weight serves as its base +
        lora_scaling · B·A; `dtype`: cast before sending (say the trainer's fp32 master weights
        to the servers' bf16). Raises the first endpoint's grpc.RpcError (an endpoint that
        refused keeps serving its previous weights)."""
        if isinstance(weights, (nn.Module, Mapping)):
            tensors = named_tensors(weights)
        else:
            tensors = [(name, t.detach()) for name, t in weights]
        if dtype is not None:
            tensors = [(name, t.to(dtype)) for name, t in tensors]
        futures = [
            self._pool.submit(self._push_one, i, tensors, version, partial, lora_scaling, timeout_s)
            for i in range(len(self.clients))
        ]
        return [f.result() for f in futures]

    def _push_one(
        self,
        index: int,
        tensors: Sequence[tuple[str, torch.Tensor]],
        version: int,
        partial: bool,
        lora_scaling: float | None,
        timeout_s: float | None,
    ) -> SyncResult:
        client = self.clients[index]
        timeout = client.connection.timeout_s if timeout_s is None else timeout_s
        began = time.perf_counter()
        reply = self._updates[index](
            update_bodies(
                tensors,
                version,
                partial=partial,
                lora_scaling=lora_scaling,
                chunk_bytes=self.chunk_bytes,
            ),
            timeout=timeout,
        )
        return SyncResult(
            client.connection.address,
            reply.version,
            reply.num_tensors,
            reply.num_bytes,
            time.perf_counter() - began,
            reply.receive_seconds,
            reply.swap_seconds,
        )

    def versions(self, *, timeout_s: float | None = None) -> list[int]:
        """The weights version each endpoint serves."""
        return [
            stub.GetWeightsVersion(
                pb.GetWeightsVersionRequest(),
                timeout=client.connection.timeout_s if timeout_s is None else timeout_s,
            ).version
            for stub, client in zip(self._stubs, self.clients, strict=True)
        ]

    def rollouts(
        self,
        prompts: Sequence[str | Sequence[int]],
        n: int = 1,
        *,
        timeout_s: float | None = None,
        **params: object,
    ) -> list[list[Completion]]:
        """`n` completions of each prompt (Generate with num_return_sequences=n), the prompts
        spread over the endpoints in turn and sent concurrently so that each server batches
        them; sampling keywords as `InferenceClient.generate_all` (HF names)."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        futures = [
            self._pool.submit(
                self.clients[i % len(self.clients)].generate_all,
                prompt,
                timeout_s=timeout_s,
                num_return_sequences=n,
                **params,
            )
            for i, prompt in enumerate(prompts)
        ]
        return [f.result() for f in futures]

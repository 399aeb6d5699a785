"""A small deterministic protobuf fuzzer for the service fuzz tests.

`Fuzzer(seed).bodies(seeds, count)` yields request bodies (bytes) for one RPC: field-mutated
copies of valid-looking seed messages (extreme ints, NaN/inf floats, long / NUL / unicode /
path-like strings, unknown enum values, huge repeated fields, random sub-messages), byte-level
mutations of their wire form (bit flips, truncation, appended garbage) and plain random bytes.
`call_raw` sends one body to a method over a generic channel (no client-side serialisation) and
returns the status code, so undecodable bodies reach the server as they are.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

INT32 = (0, 1, -1, 2**31 - 1, -(2**31), 7, 1000)
INT64 = (*INT32, 2**63 - 1, -(2**63), 2**40)
UINT32 = (0, 1, 2**32 - 1, 2**31)
UINT64 = (0, 1, 2**64 - 1, 2**63, 2**63 - 1)
FLOATS = (math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 1e300, -1e300, 5e-324, 0.5, 3.0)
FLOAT32 = (math.nan, math.inf, -math.inf, 0.0, -0.0, -1.0, 3.0e38, -3.0e38, 1e-45, 0.5, 3.0)
STRINGS = (
    "",
    "\x00",
    "a\x00b",
    "x" * 100_000,
    "../../../../etc/passwd",
    "/" + "d/" * 300 + "f",
    "/proc/self/environ",
    "~/.ssh/id_rsa",
    "-" * 3,
    "--help",
    "$(id)",
    "${HOME}",
    "%s%n%x",
    "é漢字🙂\u202e",
    "\ufeff\ufffd",
    " ",
    "\n\r\t",
    "http://127.0.0.1:1/",
    "1e309",
    "NaN",
)
INT_TYPES = {
    FieldDescriptor.TYPE_INT32: INT32,
    FieldDescriptor.TYPE_SINT32: INT32,
    FieldDescriptor.TYPE_SFIXED32: INT32,
    FieldDescriptor.TYPE_INT64: INT64,
    FieldDescriptor.TYPE_SINT64: INT64,
    FieldDescriptor.TYPE_SFIXED64: INT64,
    FieldDescriptor.TYPE_UINT32: UINT32,
    FieldDescriptor.TYPE_FIXED32: UINT32,
    FieldDescriptor.TYPE_UINT64: UINT64,
    FieldDescriptor.TYPE_FIXED64: UINT64,
}
MAX_DEPTH = 3


class Fuzzer:
    """Deterministic mutations of protobuf messages (one `random.Random(seed)`)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    # -- values of a field's type --------------------------------------------------------------

    def scalar(self, field: FieldDescriptor) -> object:
        """A random value of a scalar field's type, extremes included."""
        rng = self.rng
        kind = field.type
        if kind in INT_TYPES:
            values = INT_TYPES[kind]
            if rng.random() < 0.8:
                return rng.choice(values)
            low, high = min(values), max(values)
            return rng.randint(low, high)
        if kind == FieldDescriptor.TYPE_DOUBLE:
            return rng.choice(FLOATS) if rng.random() < 0.8 else rng.uniform(-10, 10)
        if kind == FieldDescriptor.TYPE_FLOAT:
            return rng.choice(FLOAT32) if rng.random() < 0.8 else rng.uniform(-10, 10)
        if kind == FieldDescriptor.TYPE_BOOL:
            return rng.random() < 0.5
        if kind == FieldDescriptor.TYPE_STRING:
            if rng.random() < 0.75:
                return rng.choice(STRINGS)
            return "".join(
                chr(rng.choice((rng.randrange(32, 127), rng.randrange(0x80, 0xD7FF))))
                for _ in range(rng.randrange(1, 40))
            )
        if kind == FieldDescriptor.TYPE_BYTES:
            return rng.randbytes(rng.choice((0, 1, 16, 4096)))
        if kind == FieldDescriptor.TYPE_ENUM:
            known = [v.number for v in field.enum_type.values]
            return rng.choice([*known, 99, -1, 2**31 - 1])
        raise AssertionError(f"unhandled field type {kind} of {field.full_name}")

    def fill(self, message: Message, depth: int = 0) -> Message:
        """Set a random subset of `message`'s fields to random values (recursing into messages)."""
        for field in message.DESCRIPTOR.fields:
            if self.rng.random() < 0.5:
                self.set_field(message, field, depth)
        return message

    def set_field(self, message: Message, field: FieldDescriptor, depth: int) -> None:
        """Give one field a random value (repeated: a random list; map: random entries)."""
        rng = self.rng
        if _is_map(field):
            target = getattr(message, field.name)
            target.clear()
            key_field = field.message_type.fields_by_name["key"]
            value_field = field.message_type.fields_by_name["value"]
            for _ in range(rng.choice((1, 2, 50))):
                key = self.scalar(key_field)
                if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    self.fill(target[key], depth + 1)
                else:
                    target[key] = self.scalar(value_field)
            return
        if _repeated(field):
            target = getattr(message, field.name)
            del target[:]
            count = rng.choice((0, 1, 3, 200, 5000))
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                for _ in range(min(count, 200) if depth < MAX_DEPTH else 0):
                    self.fill(target.add(), depth + 1)
            else:
                target.extend(self.scalar(field) for _ in range(count))
            return
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            sub = getattr(message, field.name)
            sub.SetInParent()
            if depth < MAX_DEPTH:
                self.fill(sub, depth + 1)
            return
        setattr(message, field.name, self.scalar(field))

    # -- whole bodies --------------------------------------------------------------------------

    def mutate(self, seed: Message) -> bytes:
        """One body derived from `seed`: field-level (mostly) or byte-level mutations."""
        rng = self.rng
        choice = rng.random()
        message = type(seed)()
        message.CopyFrom(seed)
        if choice < 0.6:
            fields = list(message.DESCRIPTOR.fields)
            for _ in range(rng.choice((1, 1, 2, 3))):
                if fields:
                    self._mutate_somewhere(message, rng.choice(fields), 0)
            return message.SerializeToString()
        if choice < 0.7:
            return self.fill(type(seed)()).SerializeToString()
        wire = bytearray(message.SerializeToString())
        if choice < 0.8 and wire:
            for _ in range(rng.choice((1, 2, 8))):
                wire[rng.randrange(len(wire))] ^= 1 << rng.randrange(8)
            return bytes(wire)
        if choice < 0.88 and wire:
            return bytes(wire[: rng.randrange(len(wire))])
        if choice < 0.94:
            return bytes(wire) + rng.randbytes(rng.choice((1, 5, 64)))
        return rng.randbytes(rng.choice((1, 3, 17, 256, 4096)))

    def _mutate_somewhere(self, message: Message, field: FieldDescriptor, depth: int) -> None:
        """Clear `field`, set it, or (for a set sub-message) mutate one of its fields."""
        rng = self.rng
        is_message = field.type == FieldDescriptor.TYPE_MESSAGE and not _repeated(field)
        if is_message and message.HasField(field.name) and depth < MAX_DEPTH and rng.random() < 0.6:
            sub = getattr(message, field.name)
            sub_fields = list(sub.DESCRIPTOR.fields)
            if sub_fields:
                self._mutate_somewhere(sub, rng.choice(sub_fields), depth + 1)
                return
        if rng.random() < 0.15:
            message.ClearField(field.name)
        else:
            self.set_field(message, field, depth)

    def bodies(self, seeds: Sequence[Message], count: int) -> Iterator[bytes]:
        """`count` bodies: each derived from a seed taken in turn (the seeds themselves first)."""
        for i in range(count):
            seed = seeds[i % len(seeds)]
            yield seed.SerializeToString() if i < len(seeds) else self.mutate(seed)


def _repeated(field: FieldDescriptor) -> bool:
    flag = getattr(field, "is_repeated", None)
    if flag is not None:
        return bool(flag)
    return field.label == FieldDescriptor.LABEL_REPEATED


def _is_map(field: FieldDescriptor) -> bool:
    return (
        field.type == FieldDescriptor.TYPE_MESSAGE
        and _repeated(field)
        and field.message_type.GetOptions().map_entry
    )


async def call_raw(
    channel: grpc.aio.Channel, method: str, body: bytes, streaming: bool, timeout: float
) -> tuple[grpc.StatusCode, str]:
    """Send `body` as is to `method`; its final status and details (a stream is read for at
    most 3 messages, then cancelled: that counts as OK)."""
    try:
        if streaming:
            call = channel.unary_stream(method)(body, timeout=timeout)
            received = 0
            async for _ in call:
                received += 1
                if received == 3:
                    call.cancel()
                    return grpc.StatusCode.OK, ""
            return grpc.StatusCode.OK, ""
        await channel.unary_unary(method)(body, timeout=timeout)
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details() or ""

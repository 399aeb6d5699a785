"""Plain values across the sandbox boundary: tagged JSON, never pickle, strictly decoded.

The checker process (test code) and the candidate process (the untrusted completion) exchange
call arguments and return values as one JSON line each. Encoding accepts the builtin value types
and their subclasses (a `Counter` travels as a dict, a namedtuple as a tuple) and always produces
plain data; decoding builds only builtin objects of exact types, so nothing a candidate sends can
carry its own `__eq__` into the checker. Imports nothing from Meshline (copied into the sandbox).
"""

import json

MAX_LINE = 16 << 20
"""Largest message in bytes (newline included)."""
MAX_DEPTH = 200
_TAGS = {"t": tuple, "s": set, "f": frozenset}


def encode(value, depth=0):
    """A JSON-able form of `value`; TypeError for anything that is not plain data."""
    if depth > MAX_DEPTH:
        raise ValueError("value nested too deeply to leave the sandbox")
    if value is None or isinstance(value, bool):
        return None if value is None else bool(value)
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        return {"x": float.__repr__(float(value))}
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, complex):
        return {"c": [float.__repr__(value.real), float.__repr__(value.imag)]}
    if isinstance(value, (bytes, bytearray)):
        return {"b": bytes(value).hex()}
    if isinstance(value, list):
        return [encode(item, depth + 1) for item in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"t": [encode(item, depth + 1) for item in tuple.__iter__(value)]}
    if isinstance(value, (set, frozenset)):
        tag = "f" if isinstance(value, frozenset) else "s"
        return {tag: [encode(item, depth + 1) for item in frozenset(value)]}
    if isinstance(value, dict):
        items = dict.items(value)
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in items]}
    raise TypeError(f"a {type(value).__name__} cannot leave the sandbox (plain values only)")


def decode(data, depth=0):
    """The value `encode` gave `data`, built from exact builtin types; ValueError if malformed."""
    if depth > MAX_DEPTH:
        raise ValueError("message nested too deeply")
    kind = type(data)
    if data is None or kind in (bool, int, str):
        return data
    if kind is list:
        return [decode(item, depth + 1) for item in data]
    if kind is not dict or len(data) != 1:
        raise ValueError(f"malformed value of type {kind.__name__}")
    (tag, body), = data.items()  # fmt: skip
    if tag == "x" and type(body) is str:
        return float(body)
    if tag == "c" and type(body) is list and len(body) == 2:
        return complex(float(_text(body[0])), float(_text(body[1])))
    if tag == "b" and type(body) is str:
        return bytes.fromhex(body)
    if type(body) is not list:
        raise ValueError(f"malformed {tag!r} value")
    if tag == "d":
        pairs = [_pair(item) for item in body]
        return {decode(k, depth + 1): decode(v, depth + 1) for k, v in pairs}
    if tag in _TAGS:
        return _TAGS[tag](decode(item, depth + 1) for item in body)
    raise ValueError(f"unknown tag {tag!r}")


def _text(item):
    if type(item) is not str:
        raise ValueError("malformed number")
    return item


def _pair(item):
    if type(item) is not list or len(item) != 2:
        raise ValueError("malformed dict item")
    return item


def dumps(message):
    """One message as a newline-terminated JSON line (bytes)."""
    line = json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"
    if len(line) > MAX_LINE:
        raise ValueError(f"message of {len(line)} bytes exceeds {MAX_LINE}")
    return line


def read_message(stream):
    """The next message from a binary stream; EOFError at its end, ValueError when malformed."""
    line = stream.readline(MAX_LINE + 1)
    if not line:
        raise EOFError("the other side closed the channel")
    if len(line) > MAX_LINE or not line.endswith(b"\n"):
        raise ValueError("message too long or truncated")
    message = json.loads(line, parse_constant=_no_constant)
    if type(message) is not dict:
        raise ValueError("a message must be a JSON object")
    return message


def _no_constant(name):
    raise ValueError(f"{name} is not allowed on the wire (floats travel tagged)")

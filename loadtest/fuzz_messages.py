"""Fuzz inputs: protobuf requests built from their descriptors, and raw garbage bytes.

Every value comes from hypothesis-style edge-case pools (empty, huge, non-ASCII, control
characters, extremes of each integer width, NaN/inf/-0.0/subnormal floats, unknown enum
numbers, deep google.protobuf.Struct nesting) mixed with a few words the services know
(model, tool and collection names, roles). A third of the requests are "tame": REQUIRED
fields set and fewer others, HINTS' values for the fields it names, small numbers, known
enum values, short lists; so that some get past the first validation into the engines.
One `random.Random` drives everything: the same seed gives the same requests, which is
what makes a finding replayable.
"""

from __future__ import annotations

import math
import random
import string
import struct
from typing import Any

from google.api import field_behavior_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from google.protobuf.message_factory import GetMessageClass

# Words that some field of some service accepts: each makes a deeper path reachable.
WORDS = (
    "digits", "terrain", "7", "seven", "fuzz", "user", "assistant", "system", "tool",
    "knowledge_search", "python_doc", "generate_image", "calculator", "difficulty", "title",
    "source", "part", "float32", "bfloat16", "2 + 2 * 3", "How do I copy a nested list?",
    "The capital of France is", "127.0.0.1:1", "0", "expression", "query", "top_k", "name",
    "rerank", "seed", "num_images", "model", "prompt", "json.loads",
)  # fmt: skip
# Fields, by name, whose useful values are few: a tame request picks one of these.
HINTS: dict[str, tuple[str | int | float, ...]] = {
    "request_id": ("", "fuzz-request"),
    "model": ("digits", "terrain", ""),
    "name": ("knowledge_search", "python_doc", "generate_image", "calculator"),
    "role": ("user", "assistant", "system", "tool"),
    "collection": ("fuzz",),
    "prompt": ("7", "seven", "The capital of France is"),
    "question": ("What is 2 + 2 * 3?", "How do I copy a nested list?", "Draw a 7"),
    "key": ("title", "source", "part", "difficulty"),
    "dtype": ("float32", "bfloat16"),
    "handle_id": ("0" * 32, "0123456789abcdef" * 2),
    "width": (0,),
    "height": (0,),
    "num_images": (1, 2),
    "steps": (1, 2, 5),
    "max_new_tokens": (1, 4, 16),
    "top_k": (0, 1, 5),
    "top_n": (0, 1, 3),
    "seed": (0, 7),
    "temperature": (0.0, 0.7),
    "top_p": (1.0, 0.9),
    "repetition_penalty": (1.0, 1.1),
    "guidance_scale": (1.0, 3.0),
    "vector_size": (0, 384),
    "count": (0, 1, 3),
}
STRINGS = (
    "", " ", "\n\t\r", "a", "\x00", "a\x00b", "\x01\x02\x1b[31m\x7f", "\u200b\ufeff\u202e",
    "naïve café 日本語 🙂", "🙂" * 64, "e\u0301" * 32, "\U0010ffff", "../../etc/passwd",
    "%s%n{0}{}", "${jndi:x}", "<script>", "null", "NaN", "-1", "1e309", "[]", "{}",
    "'; DROP TABLE x; --", "\\", "*", "?", "a" * 257, "x" * 4097,
)  # fmt: skip
HUGE_STRING_CHARS = 100_000
# Whole-width extremes for each integer kind, plus values near common limits.
INT_EDGES = {
    32: (0, 1, -1, 2, 8, 64, 255, 1000, 1025, 2**31 - 1, -(2**31), 2**15, -(2**15)),
    64: (0, 1, -1, 2**63 - 1, -(2**63), 2**53 + 1, 10**12, -(10**12)),
}
UINT_EDGES = {32: (0, 1, 2, 49151, 49152, 2**31, 2**32 - 1), 64: (0, 1, 2**63, 2**64 - 1)}
FLOAT_EDGES = (
    0.0, -0.0, 1.0, -1.0, 0.5, 2.0, 1e-7, math.nan, -math.nan, math.inf, -math.inf,
    5e-324, 1e-45, 1.17549435e-38, 3.4028235e38, 1e308, -1e308, 100.0, 1e6,
)  # fmt: skip
INT_TYPES = {
    FieldDescriptor.TYPE_INT32: 32, FieldDescriptor.TYPE_SINT32: 32,
    FieldDescriptor.TYPE_SFIXED32: 32, FieldDescriptor.TYPE_INT64: 64,
    FieldDescriptor.TYPE_SINT64: 64, FieldDescriptor.TYPE_SFIXED64: 64,
}  # fmt: skip
UINT_TYPES = {
    FieldDescriptor.TYPE_UINT32: 32, FieldDescriptor.TYPE_FIXED32: 32,
    FieldDescriptor.TYPE_UINT64: 64, FieldDescriptor.TYPE_FIXED64: 64,
}  # fmt: skip
FLOAT_TYPES = (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE)
STRUCT_TYPES = ("google.protobuf.Struct", "google.protobuf.Value", "google.protobuf.ListValue")
MAX_DEPTH = 4  # nested messages; Struct values nest deeper on their own
MAX_STRUCT_DEPTH = 40


class Inputs:
    """Requests for one call; `words` are the domain strings mixed into the pools."""

    def __init__(self, rng: random.Random, words: tuple[str, ...] = WORDS) -> None:
        self.rng = rng
        self.words = words
        self.tame = rng.random() < 0.33

    def message(self, descriptor: Descriptor, small: bool = False) -> Message:
        """A message of `descriptor`'s type (see `fill`)."""
        message = GetMessageClass(descriptor)()
        self.fill(message, 0, small)
        return message

    def fill(self, message: Message, depth: int, small: bool) -> None:
        """Sets each field or leaves it at its default, at most one member of each oneof,
        nested messages down to MAX_DEPTH. Built in place: protobuf copies a message by
        parsing it, which refuses the deep Structs this is meant to send."""
        descriptor = message.DESCRIPTOR
        if descriptor.full_name in STRUCT_TYPES:
            self._fill_struct(message, depth)
            return
        present = 0.4 if self.tame else 0.75  # a tame request leaves more at the defaults
        chosen = {
            id(self.rng.choice(oneof.fields))
            for oneof in descriptor.oneofs
            if self.rng.random() < present
        }
        for field in descriptor.fields:
            if field.containing_oneof is not None:
                wanted = id(field) in chosen
            else:
                wanted = (self.tame and _required(field)) or self.rng.random() < present
            if wanted:
                self._set(message, field, depth, small)

    def _set(self, message: Message, field: FieldDescriptor, depth: int, small: bool) -> None:
        target = getattr(message, field.name)
        nested = field.message_type is not None and depth < MAX_DEPTH
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields
            for _ in range(self.count(small)):
                key = self.scalar(key_field, small=True)
                if value_field.message_type is None:
                    target[key] = self.scalar(value_field, small)
                elif nested:
                    self.fill(target[key], depth + 1, True)
        elif field.is_repeated:
            many = self.count(small)
            for _ in range(many):
                if field.message_type is None:
                    target.append(self.scalar(field, small or many > 8))
                elif nested:
                    self.fill(target.add(), depth + 1, small or many > 8)
        elif field.message_type is None:
            setattr(message, field.name, self.scalar(field, small))
        elif nested:
            target.SetInParent()
            self.fill(target, depth + 1, small)

    def count(self, small: bool) -> int:
        """Repeated lengths: mostly short, sometimes past the services' limits."""
        roll = self.rng.random()
        if self.tame:
            return self.rng.randint(1, 3)
        if small or roll < 0.85:
            return self.rng.choice((0, 1, 1, 2, 3, 5))
        return self.rng.choice((9, 17, 33, 65, 257, 1001, 1500))

    def scalar(self, field: FieldDescriptor, small: bool = False) -> Any:
        kind = field.type
        is_string = kind == FieldDescriptor.TYPE_STRING
        hints = [h for h in HINTS.get(field.name, ()) if isinstance(h, str) == is_string]
        if self.tame and hints and kind != FieldDescriptor.TYPE_ENUM:
            return self.rng.choice(hints)
        if is_string:
            return self.string(small)
        if kind == FieldDescriptor.TYPE_BYTES:
            return self.bytes(small)
        if kind == FieldDescriptor.TYPE_BOOL:
            return self.rng.random() < 0.5
        if kind == FieldDescriptor.TYPE_ENUM:
            known = [v.number for v in field.enum_type.values]
            return self.rng.choice(known if self.tame else [*known, *known, -1, 99, 2**31 - 1])
        if kind in FLOAT_TYPES:
            return self.floating()
        if kind in INT_TYPES:
            return self.integer(INT_EDGES[INT_TYPES[kind]], INT_TYPES[kind], signed=True)
        return self.integer(UINT_EDGES[UINT_TYPES[kind]], UINT_TYPES[kind], signed=False)

    def string(self, small: bool = False) -> str:
        roll = self.rng.random()
        if roll < 0.35 or self.tame:
            return self.rng.choice(self.words)
        if roll < 0.65:
            return self.rng.choice(STRINGS)
        if roll < 0.99 or small:
            alphabet = self.rng.choice((string.printable, "abc xyz", "日本語🙂é\u0301\x00\x1f"))
            return "".join(self.rng.choices(alphabet, k=self.rng.randint(1, 40)))
        unit = self.rng.choice(("a", "é", "🙂", "ab\x00 ", "word "))
        return unit * (HUGE_STRING_CHARS // len(unit.encode()))

    def bytes(self, small: bool = False) -> bytes:
        roll = self.rng.random()
        if roll < 0.2:
            return b""
        if roll < 0.99 or small:
            return self.rng.randbytes(self.rng.randint(1, 64))
        return self.rng.randbytes(HUGE_STRING_CHARS)

    def integer(self, edges: tuple[int, ...], bits: int, signed: bool) -> int:
        roll = self.rng.random()
        if self.tame:
            return self.rng.randint(0, 8)
        if roll < 0.6:
            return self.rng.choice(edges)
        if roll < 0.9:
            return self.rng.randint(-5 if signed else 0, 300)
        low = -(2 ** (bits - 1)) if signed else 0
        high = 2 ** (bits - 1) - 1 if signed else 2**bits - 1
        return self.rng.randint(low, high)

    def floating(self) -> float:
        if self.tame:
            return self.rng.uniform(0.0, 2.0)
        if self.rng.random() < 0.6:
            return self.rng.choice(FLOAT_EDGES)
        return self.rng.uniform(-10.0, 10.0)

    def _fill_struct(self, message: Message, depth: int) -> None:
        """Struct, Value and ListValue from JSON-like Python values, sometimes nested
        MAX_STRUCT_DEPTH deep; NaN and inf numbers included."""
        name = message.DESCRIPTOR.full_name
        if name == "google.protobuf.Struct":
            message.update(self.json_object(depth))
        elif name == "google.protobuf.ListValue":
            message.extend(self.json_list(depth))
        else:
            value = self.json_value(depth)
            if isinstance(value, dict):
                message.struct_value.update(value)
            elif isinstance(value, list):
                message.list_value.extend(value)
            elif value is None:
                message.null_value = 0
            elif isinstance(value, bool):
                message.bool_value = value
            elif isinstance(value, float):
                message.number_value = value
            else:
                message.string_value = value

    def json_object(self, depth: int) -> dict[str, Any]:
        if self.rng.random() < 0.05 and not self.tame:
            return self.deep(self.rng.randint(8, MAX_STRUCT_DEPTH))
        keys = [self.string(small=True) for _ in range(self.count(True))]
        return {key: self.json_value(depth + 1) for key in keys}

    def json_list(self, depth: int) -> list[Any]:
        return [self.json_value(depth + 1) for _ in range(self.count(True))]

    def json_value(self, depth: int) -> Any:
        kinds = ["null", "bool", "number", "string"] + (["object", "list"] if depth < 6 else [])
        kind = self.rng.choice(kinds)
        if kind == "object":
            return self.json_object(depth)
        if kind == "list":
            return self.json_list(depth)
        if kind == "number":
            return float(self.rng.choice((*FLOAT_EDGES, 3, 2**53, -(2**63), 1e20)))
        if kind == "string":
            return self.string(small=True)
        return None if kind == "null" else self.rng.random() < 0.5

    def deep(self, depth: int) -> dict[str, Any]:
        """A Struct `depth` levels deep, alternating objects and lists, a NaN at the end."""
        value: Any = math.nan
        for level in range(depth):
            value = {"k": value} if level % 2 else [value]
        return {"deep": value}

    def garbage(self, descriptor: Descriptor) -> bytes:
        """Bytes that are not a valid `descriptor` message, or valid with surprises:
        random bytes, a valid message cut short or with a flipped byte, a string field
        that is not UTF-8, unknown fields, an absurd length prefix."""
        valid = self.message(descriptor, small=True).SerializeToString()
        kind = self.rng.randrange(6)
        if kind == 0:
            return self.rng.randbytes(self.rng.randint(1, 256))
        if kind == 1 and valid:
            return valid[: self.rng.randrange(len(valid))]
        if kind == 2 and valid:
            at = self.rng.randrange(len(valid))
            return valid[:at] + bytes([valid[at] ^ 0xFF]) + valid[at + 1 :]
        strings = [f for f in descriptor.fields if f.type == FieldDescriptor.TYPE_STRING]
        if kind == 3 and strings:
            number = self.rng.choice(strings).number
            return valid + _key(number, 2) + _varint(4) + b"\xff\xfe\xc3\x28"
        if kind == 4:
            unknown = _key(self.rng.choice((999, 2**29 - 1)), 0) + _varint(2**63)
            fixed = _key(1000, 5) + struct.pack("<f", math.nan)
            return valid + unknown + fixed
        return valid + _key(1, 2) + _varint(2**31)


def _required(field: FieldDescriptor) -> bool:
    """Whether the proto marks the field (google.api.field_behavior) REQUIRED."""
    behavior = field.GetOptions().Extensions[field_behavior_pb2.field_behavior]
    return field_behavior_pb2.REQUIRED in behavior


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        bits, value = value & 0x7F, value >> 7
        out.append(bits | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)

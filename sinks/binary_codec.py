"""PostgreSQL's binary array format, encoded column by column: array parameters for a batch.

A batch statement (``unnest`` of array parameters) sends each column as one binary array. Built
here from pre-framed elements, the bytes are exactly what psycopg's list dumper would send, with
no Python call per element: ``UuidArray(parts, count)`` etc. take the elements already framed
(4-byte length, then the bytes; :data:`NULL` for a NULL), e.g. ``uuid_element(value)``,
``frame(data)``, :data:`LENGTH_8` + ``timestamptz(moment)``. A cursor sends them once
:func:`register_binary_arrays` has registered their dumpers on it.

The format (``array_recv``): ndim, has-null flag, element type oid, then per dimension its
length and lower bound, then per element its byte length (-1: NULL) and bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from itertools import chain
from typing import ClassVar, cast
from uuid import UUID

from psycopg.abc import Buffer
from psycopg.adapt import AdaptersMap, Dumper, PyFormat, Transformer
from psycopg.pq import Format


class BinaryArray:
    """A one-dimensional array parameter already in PostgreSQL's binary format."""

    __slots__ = ("data",)
    element_oid: ClassVar[int]
    array_oid: ClassVar[int]

    def __init__(self, parts: Iterable[Buffer], count: int, has_null: bool = False) -> None:
        """``parts``: the ``count`` elements, each framed (length, then bytes; or ``NULL``)."""
        head = (_HEAD.pack(1, has_null, self.element_oid, count, 1) if count
                else _EMPTY_HEAD.pack(0, 0, self.element_oid))
        self.data = b"".join(chain((head,), parts))


class UuidArray(BinaryArray):
    """``uuid[]``."""

    __slots__ = ()
    element_oid, array_oid = 2950, 2951


class TextArray(BinaryArray):
    """``text[]``."""

    __slots__ = ()
    element_oid, array_oid = 25, 1009


class ByteaArray(BinaryArray):
    """``bytea[]``."""

    __slots__ = ()
    element_oid, array_oid = 17, 1001


class Int4Array(BinaryArray):
    """``integer[]``."""

    __slots__ = ()
    element_oid, array_oid = 23, 1007


class TimestamptzArray(BinaryArray):
    """``timestamptz[]``."""

    __slots__ = ()
    element_oid, array_oid = 1184, 1185


class _ArrayDumper(Dumper):
    format = Format.BINARY

    def dump(self, obj: BinaryArray) -> Buffer:
        return obj.data


_DUMPERS = [
    (cls, type(f"{cls.__name__}Dumper", (_ArrayDumper,), {"oid": cls.array_oid}))
    for cls in (UuidArray, TextArray, ByteaArray, Int4Array, TimestamptzArray)
]
_HEAD = struct.Struct("!iiIii")
_EMPTY_HEAD = struct.Struct("!iiI")
_INT4_ELEMENT = struct.Struct("!ii")
NULL = b"\xff\xff\xff\xff"
LENGTH_8 = b"\x00\x00\x00\x08"
UUID_FRAME = 16 << 128  # OR-ed with UUID.int: the 4-byte length 16, then the 16 bytes


def frame(data: bytes) -> bytes:
    """``data`` as one array element: its 4-byte length, then the bytes."""
    return len(data).to_bytes(4, "big") + data


def int4_element(value: int) -> bytes:
    """``value`` (a 32-bit signed integer) as one integer array element."""
    return _INT4_ELEMENT.pack(4, value)


def uuid_element(value: UUID | None) -> bytes:
    """``value`` as one uuid array element (or NULL)."""
    return NULL if value is None else (UUID_FRAME | value.int).to_bytes(20, "big")


timestamptz = cast(  # psycopg's own (C) dumper of an aware datetime as timestamptz
    "Callable[[datetime], Buffer]",
    Transformer().get_dumper(datetime.now(UTC), PyFormat.BINARY).dump,
)
"""psycopg's own (C) binary dumper of an aware datetime as ``timestamptz`` (8 bytes)."""


def register_binary_arrays(adapters: AdaptersMap) -> None:
    """Let ``adapters`` (a cursor's, a connection's) send the pre-encoded array parameters."""
    for array, dumper in _DUMPERS:
        adapters.register_dumper(array, dumper)

"""PostgreSQL's binary array format, built column by column: the array parameters of a batch.

A batch statement (``unnest`` of arrays) sends each column as one binary array, made here from
elements already framed (4-byte length, then the bytes; :data:`NULL`), with no Python call per
element; the bytes are what psycopg's list dumper would send. A cursor sends them once
:func:`register_binary_arrays` registered their dumpers. The format (``array_recv``): ndim,
has-null, element oid, per dimension its length and lower bound, per element length and bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from itertools import chain
from typing import ClassVar, cast

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


def _array(name: str, element_oid: int, array_oid: int) -> type[BinaryArray]:
    return type(name, (BinaryArray,), {"__slots__": (), "__doc__": f"An array of oid {array_oid}.",
                                       "element_oid": element_oid, "array_oid": array_oid})


UuidArray = _array("UuidArray", 2950, 2951)
TextArray = _array("TextArray", 25, 1009)
ByteaArray = _array("ByteaArray", 17, 1001)
Int4Array = _array("Int4Array", 23, 1007)
TimestamptzArray = _array("TimestamptzArray", 1184, 1185)


class _ArrayDumper(Dumper):
    format = Format.BINARY

    def dump(self, obj: BinaryArray) -> Buffer:
        return obj.data


_DUMPERS = [(cls, type(f"{cls.__name__}Dumper", (_ArrayDumper,), {"oid": cls.array_oid}))
            for cls in (UuidArray, TextArray, ByteaArray, Int4Array, TimestamptzArray)]
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


# psycopg's own (C) binary dumper of an aware datetime (8 bytes)
timestamptz = cast("Callable[[datetime], Buffer]",
                   Transformer().get_dumper(datetime.now(UTC), PyFormat.BINARY).dump)


def register_binary_arrays(adapters: AdaptersMap) -> None:
    """Let ``adapters`` (a cursor's, a connection's) send the pre-encoded array parameters."""
    for array, dumper in _DUMPERS:
        adapters.register_dumper(array, dumper)

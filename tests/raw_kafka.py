"""Produce a record whose header names are arbitrary bytes, through librdkafka itself.

confluent-kafka's producer takes ``str`` header names only (sent UTF-8 encoded), but the protocol
carries bytes, and a client in another language can write a name that is not UTF-8. This calls
``rd_kafka_produceva`` of the librdkafka that confluent-kafka's wheel bundles, through ctypes.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import confluent_kafka

_LIB = ctypes.CDLL(str(next(
    (Path(confluent_kafka.__file__).parent.parent / "confluent_kafka.libs").glob("librdkafka*.so*")
)))
_TOPIC, _PARTITION, _VALUE, _KEY, _FLAGS, _HEADER = 1, 3, 4, 5, 7, 9  # rd_kafka_vtype_t
_COPY = 0x2  # RD_KAFKA_MSG_F_COPY: librdkafka copies the value and key


class _Mem(ctypes.Structure):
    _fields_ = [("ptr", ctypes.c_char_p), ("size", ctypes.c_size_t)]


class _Header(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char_p), ("val", ctypes.c_char_p), ("size", ctypes.c_ssize_t)]


class _Value(ctypes.Union):
    _fields_ = [("cstr", ctypes.c_char_p), ("i32", ctypes.c_int32), ("mem", _Mem),
                ("header", _Header), ("_pad", ctypes.c_char * 64)]


class _Vu(ctypes.Structure):  # rd_kafka_vu_t
    _fields_ = [("vtype", ctypes.c_int), ("u", _Value)]


_LIB.rd_kafka_conf_new.restype = ctypes.c_void_p
_LIB.rd_kafka_conf_set.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p,
                                   ctypes.c_char_p, ctypes.c_size_t]
_LIB.rd_kafka_new.restype = ctypes.c_void_p
_LIB.rd_kafka_new.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
_LIB.rd_kafka_produceva.restype = ctypes.c_void_p
_LIB.rd_kafka_produceva.argtypes = [ctypes.c_void_p, ctypes.POINTER(_Vu), ctypes.c_size_t]
_LIB.rd_kafka_flush.argtypes = [ctypes.c_void_p, ctypes.c_int]
_LIB.rd_kafka_destroy.argtypes = [ctypes.c_void_p]


def produce_raw(bootstrap: str, topic: str, partition: int, *, key: bytes, value: bytes,
                headers: Sequence[tuple[bytes, bytes]]) -> None:
    """Produce one record and wait for its acknowledgement (``acks=all``)."""
    error = ctypes.create_string_buffer(512)
    conf = _LIB.rd_kafka_conf_new()
    for name, setting in ((b"bootstrap.servers", bootstrap.encode()), (b"acks", b"all")):
        assert _LIB.rd_kafka_conf_set(conf, name, setting, error, 512) == 0, error.value
    producer = _LIB.rd_kafka_new(0, conf, error, 512)  # RD_KAFKA_PRODUCER
    assert producer, error.value
    items = [_Vu(_TOPIC, _Value(cstr=topic.encode())), _Vu(_PARTITION, _Value(i32=partition)),
             _Vu(_VALUE, _Value(mem=_Mem(value, len(value)))),
             _Vu(_KEY, _Value(mem=_Mem(key, len(key)))), _Vu(_FLAGS, _Value(i32=_COPY))]
    items += [_Vu(_HEADER, _Value(header=_Header(name, data, len(data))))
              for name, data in headers]
    try:
        failed = _LIB.rd_kafka_produceva(producer, (_Vu * len(items))(*items), len(items))
        assert not failed, "rd_kafka_produceva refused the record"
        assert _LIB.rd_kafka_flush(producer, 30_000) == 0, "not acknowledged within 30 s"
    finally:
        _LIB.rd_kafka_destroy(producer)

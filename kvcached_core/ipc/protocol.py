"""The binary protocol between a scheduler and its workers (no pickle).

Every frame, request or reply, is a fixed 28-byte little-endian header
followed by an optional payload::

    offset size field       meaning
    ------ ---- ----------- ------------------------------------------------
         0    4 magic       b"KVCI"
         4    1 version     2
         5    1 type        HELLO=1 PING=2 MAP=3 UNMAP=4 QUERY=5 MEMINFO=6;
                            a reply carries its request's type with bit
                            0x80 set
         6    2 status      0 in requests; in replies OK=0, ERROR=1 (the
                            handler raised), BAD_REQUEST=2, OUT_OF_MEMORY=3
                            (the handler raised a MemoryError)
         8    8 request_id  chosen by the sender, echoed by the reply
        16    4 group       KV cache group id (unsigned)
        20    4 count       number of int64 values in the payload
        24    4 text_len    number of utf-8 bytes after the values
        28      payload     count x int64 (page ids, handshake fields, or
                            MEMINFO's answer: the device's free and total
                            bytes and the worker's spare page handles),
                            then text_len bytes of text (the error message
                            of an error reply, the worker's label in HELLO)

Version 2 added MEMINFO; peers of different versions refuse each other.

The native page server reads and writes the same frames: ``csrc/protocol.h``
repeats these numbers for C++, and ``tests/ipc/test_protocol_constants.py``
holds it (as written and as built) equal to this module.

A frame is decoded only after its header has been validated, so a peer that
speaks something else is told so ("bad magic") instead of being read as a
gigantic length. Limits: :data:`MAX_COUNT` values and :data:`MAX_TEXT` bytes
of text per frame.
"""

from __future__ import annotations

import enum
import socket
import struct
import sys
from array import array
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvcached_core.errors import ProtocolError

__all__ = [
    "MAGIC",
    "VERSION",
    "HEADER",
    "HEADER_SIZE",
    "MAX_COUNT",
    "MAX_TEXT",
    "REPLY_BIT",
    "MsgType",
    "Status",
    "Header",
    "Message",
    "OPS",
    "encode",
    "encode_request",
    "encode_reply",
    "parse_header",
    "decode",
    "read_message",
]

MAGIC = b"KVCI"
VERSION = 2
HEADER = struct.Struct("<4sBBHQIII")
HEADER_SIZE = HEADER.size  # 28
MAX_COUNT = 1 << 24
MAX_TEXT = 64 * 1024
REPLY_BIT = 0x80
_U32 = 1 << 32
_U64 = 1 << 64
_SWAP = sys.byteorder != "little"


class MsgType(enum.IntEnum):
    """Request types (a reply sets :data:`REPLY_BIT` on its request's type)."""

    HELLO = 1
    PING = 2
    MAP = 3
    UNMAP = 4
    QUERY = 5
    MEMINFO = 6


class Status(enum.IntEnum):
    """The status of a reply."""

    OK = 0
    ERROR = 1
    BAD_REQUEST = 2
    OUT_OF_MEMORY = 3


#: Operation names as the worker's handler sees them.
OPS: dict[MsgType, str] = {t: t.name.lower() for t in MsgType}
_TYPE_OF: dict[int, MsgType] = {int(t): t for t in MsgType}


class Header(NamedTuple):
    """A validated frame header."""

    type: MsgType
    is_reply: bool
    status: int
    request_id: int
    group: int
    count: int
    text_len: int

    @property
    def payload_size(self) -> int:
        """Bytes that follow the header."""
        return 8 * self.count + self.text_len


class Message(NamedTuple):
    """One decoded frame."""

    type: MsgType
    request_id: int
    group: int = 0
    values: Sequence[int] = ()
    text: str = ""
    status: int = Status.OK
    is_reply: bool = False

    @property
    def op(self) -> str:
        """The operation name (``"map"``, ``"unmap"``, ``"ping"``, ...)."""
        return OPS[self.type]


def _values_bytes(values: Iterable[int]) -> tuple[int, bytes]:
    try:
        arr = values if isinstance(values, array) and values.typecode == "q" else array("q", values)
    except (OverflowError, TypeError) as exc:
        raise ProtocolError(f"payload values must be int64 integers: {exc}") from None
    if len(arr) > MAX_COUNT:
        raise ProtocolError(f"{len(arr)} values in one frame, over the limit of {MAX_COUNT}")
    if _SWAP:
        arr = array("q", arr)
        arr.byteswap()
    return len(arr), arr.tobytes()


def _text_bytes(text: str) -> bytes:
    data = text.encode("utf-8", "backslashreplace")
    if len(data) > MAX_TEXT:  # cut on a character boundary
        data = data[:MAX_TEXT].decode("utf-8", "ignore").encode("utf-8")
    return data


def _frame(
    type_byte: int, status: int, request_id: int, group: int, values: Iterable[int], text: str
) -> bytes:
    if not 0 <= request_id < _U64:
        raise ProtocolError(f"request id {request_id} does not fit in 64 unsigned bits")
    if not 0 <= group < _U32:
        raise ProtocolError(f"group id {group} does not fit in 32 unsigned bits")
    count, payload = _values_bytes(values)
    tbytes = _text_bytes(text) if text else b""
    header = HEADER.pack(MAGIC, VERSION, type_byte, status, request_id, group, count, len(tbytes))
    return header + payload + tbytes if (payload or tbytes) else header


def encode_request(
    type: MsgType, request_id: int, group: int = 0, values: Iterable[int] = (), text: str = ""
) -> bytes:
    """Encode a request frame.

    Raises:
        ProtocolError: a field is out of range or a value is not an int64.
    """
    return _frame(int(type), 0, request_id, group, values, text)


def encode_reply(
    type: MsgType,
    request_id: int,
    group: int = 0,
    status: int = Status.OK,
    values: Iterable[int] = (),
    text: str = "",
) -> bytes:
    """Encode the reply to a request of ``type`` (text longer than :data:`MAX_TEXT` is cut)."""
    return _frame(int(type) | REPLY_BIT, int(status), request_id, group, values, text)


def encode(msg: Message) -> bytes:
    """Encode any :class:`Message` (the inverse of :func:`decode`)."""
    if msg.is_reply:
        return encode_reply(msg.type, msg.request_id, msg.group, msg.status, msg.values, msg.text)
    return encode_request(msg.type, msg.request_id, msg.group, msg.values, msg.text)


def parse_header(data: bytes | bytearray | memoryview) -> Header:
    """Validate and unpack the first :data:`HEADER_SIZE` bytes of a frame.

    Raises:
        ProtocolError: too short, wrong magic or version, unknown type, a
            status in a request, or a length over the limits.
    """
    if len(data) < HEADER_SIZE:
        raise ProtocolError(f"truncated frame: {len(data)} bytes, the header needs {HEADER_SIZE}")
    magic, version, type_byte, status, request_id, group, count, text_len = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(
            f"bad magic {bytes(magic)!r} (expected {MAGIC!r}): the peer does not speak the "
            "kvcached IPC protocol"
        )
    if version != VERSION:
        raise ProtocolError(
            f"protocol version {version} from the peer, this side speaks version {VERSION}: "
            "run the same kvcached version in the scheduler and the workers"
        )
    is_reply = bool(type_byte & REPLY_BIT)
    base = type_byte & ~REPLY_BIT
    msg_type = _TYPE_OF.get(base)
    if msg_type is None:
        raise ProtocolError(f"unknown message type {type_byte:#04x}")
    if not is_reply and status:
        raise ProtocolError(f"request carries status {status}; only replies have a status")
    if count > MAX_COUNT:
        raise ProtocolError(f"frame announces {count} values, over the limit of {MAX_COUNT}")
    if text_len > MAX_TEXT:
        raise ProtocolError(f"frame announces {text_len} bytes of text, over the limit of {MAX_TEXT}")
    return Header(msg_type, is_reply, status, request_id, group, count, text_len)


def _message(header: Header, payload: bytes | bytearray | memoryview) -> Message:
    values: list[int] = []
    if header.count:
        arr = array("q")
        arr.frombytes(payload[: 8 * header.count])
        if _SWAP:
            arr.byteswap()
        values = arr.tolist()
    text = bytes(payload[8 * header.count :]).decode("utf-8", "replace") if header.text_len else ""
    return Message(header.type, header.request_id, header.group, values, text, header.status,
                   header.is_reply)


def decode(data: bytes | bytearray | memoryview) -> Message:
    """Decode exactly one whole frame.

    Raises:
        ProtocolError: the header is invalid, the payload is shorter than the
            header announces (truncated), or bytes follow the frame.
    """
    header = parse_header(data)
    need = HEADER_SIZE + header.payload_size
    if len(data) < need:
        raise ProtocolError(f"truncated frame: {len(data)} bytes, the header announces {need}")
    if len(data) > need:
        raise ProtocolError(f"{len(data) - need} stray bytes after a {need}-byte frame")
    return _message(header, memoryview(data)[HEADER_SIZE:])


#: Bytes one ``recv`` asks for: the buffer grows as data arrives, not by what a header announces.
_RECV_CHUNK = 1 << 20


def _recv_exact(sock: socket.socket, size: int, what: str) -> bytes:
    """Read exactly ``size`` bytes; ``EOFError`` if the peer closed before the first byte."""
    data = sock.recv(min(size, _RECV_CHUNK))
    if len(data) == size:
        return data
    if not data:
        raise EOFError("the peer closed the connection")
    buf = bytearray(data)
    while len(buf) < size:
        chunk = sock.recv(min(size - len(buf), _RECV_CHUNK))
        if not chunk:
            raise ProtocolError(
                f"truncated frame: the peer closed the connection after {len(buf)} of the "
                f"{size} bytes of the {what}"
            )
        buf += chunk
    return bytes(buf)


def read_message(sock: socket.socket) -> Message:
    """Read one frame from a stream socket (honouring the socket's timeout).

    Raises:
        EOFError: the peer closed the connection between frames.
        ProtocolError: the frame is invalid or cut short.
        OSError: the socket failed (``TimeoutError`` when its timeout expired).
    """
    header = parse_header(_recv_exact(sock, HEADER_SIZE, "header"))
    if not header.payload_size:
        return Message(header.type, header.request_id, header.group, [], "", header.status,
                       header.is_reply)
    try:
        payload = _recv_exact(sock, header.payload_size, "payload")
    except EOFError:
        raise ProtocolError(
            "truncated frame: the peer closed the connection after the header"
        ) from None
    return _message(header, payload)

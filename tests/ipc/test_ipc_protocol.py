"""The binary frame format: round trips, fuzzing and clear rejection of bad frames."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcached_core.errors import ProtocolError
from kvcached_core.ipc.protocol import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_COUNT,
    MAX_TEXT,
    VERSION,
    Message,
    MsgType,
    Status,
    decode,
    encode,
    encode_reply,
    encode_request,
    read_message,
)

int64s = st.integers(min_value=-(1 << 63), max_value=(1 << 63) - 1)
texts = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)


@st.composite
def messages(draw) -> Message:
    is_reply = draw(st.booleans())
    return Message(
        type=draw(st.sampled_from(list(MsgType))),
        request_id=draw(st.integers(0, (1 << 64) - 1)),
        group=draw(st.integers(0, (1 << 32) - 1)),
        values=draw(st.lists(int64s, max_size=64)),
        text=draw(texts),
        status=draw(st.integers(0, 0xFFFF)) if is_reply else 0,
        is_reply=is_reply,
    )


@given(messages())
def test_round_trip(msg):
    frame = encode(msg)
    assert len(frame) == HEADER_SIZE + 8 * len(msg.values) + len(msg.text.encode())
    out = decode(frame)
    assert out == msg._replace(values=list(msg.values))
    assert out.op == msg.type.name.lower()


@settings(max_examples=300)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_decode_or_raise_protocol_error(data):
    try:
        decode(data)
    except ProtocolError:
        pass


@settings(max_examples=300)
@given(messages(), st.data())
def test_corrupted_frames_decode_or_raise_protocol_error(msg, data):
    frame = bytearray(encode(msg))
    pos = data.draw(st.integers(0, len(frame) - 1))
    frame[pos] ^= data.draw(st.integers(1, 255))
    cut = data.draw(st.integers(0, len(frame)))
    for candidate in (bytes(frame), bytes(frame[:cut])):
        try:
            decode(candidate)
        except ProtocolError:
            pass


def _header(**fields) -> bytes:
    base = dict(magic=MAGIC, version=VERSION, type=MsgType.MAP, status=0, request_id=1,
                group=0, count=0, text_len=0)
    base.update(fields)
    return HEADER.pack(*base.values())


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (_header(magic=b"HTTP"), r"bad magic b'HTTP' \(expected b'KVCI'\): the peer does not speak"),
        (_header(version=1), "protocol version 1 from the peer, this side speaks version 2"),
        (_header(type=0x7F), "unknown message type 0x7f"),
        (_header(status=1), "request carries status 1"),
        (_header(count=MAX_COUNT + 1), "over the limit"),
        (_header(text_len=MAX_TEXT + 1), "over the limit"),
        (_header()[:10], "truncated frame: 10 bytes, the header needs 28"),
        (_header(count=2) + b"\0" * 8, "truncated frame: 36 bytes, the header announces 44"),
        (_header() + b"x", "1 stray bytes after a 28-byte frame"),
    ],
)
def test_bad_frames_are_rejected_clearly(frame, message):
    with pytest.raises(ProtocolError, match=message):
        decode(frame)


def test_encoding_checks_ranges():
    with pytest.raises(ProtocolError, match="int64"):
        encode_request(MsgType.MAP, 1, 0, [1 << 63])
    with pytest.raises(ProtocolError, match="int64"):
        encode_request(MsgType.MAP, 1, 0, ["7"])  # type: ignore[list-item]
    with pytest.raises(ProtocolError, match="group id -1"):
        encode_request(MsgType.MAP, 1, -1)
    with pytest.raises(ProtocolError, match="request id"):
        encode_request(MsgType.MAP, 1 << 64)


def test_layout_is_fixed_little_endian():
    frame = encode_request(MsgType.UNMAP, 0x0102030405060708, 9, [1, -2])
    assert frame[:4] == b"KVCI" and frame[4] == 2 and frame[5] == 4
    assert struct.unpack_from("<QII", frame, 8) == (0x0102030405060708, 9, 2)
    assert struct.unpack_from("<qq", frame, HEADER_SIZE) == (1, -2)
    reply = encode_reply(MsgType.UNMAP, 3, 9, Status.ERROR, text="bad")
    assert reply[5] == 0x84 and struct.unpack_from("<H", reply, 6) == (1,)
    assert reply[HEADER_SIZE:] == b"bad"


def test_long_error_text_is_cut_on_a_character_boundary():
    out = decode(encode_reply(MsgType.MAP, 1, text="é" * MAX_TEXT))
    assert len(out.text.encode()) <= MAX_TEXT and set(out.text) == {"é"}


def test_read_message_handles_split_frames_eof_and_truncation():
    a, b = socket.socketpair()
    a.settimeout(5)
    frame = encode_request(MsgType.MAP, 5, 2, list(range(100)))

    def dribble():
        for i in range(len(frame)):
            b.send(frame[i:i + 1])
        b.send(frame[:HEADER_SIZE + 3])  # a second frame, cut short
        b.close()

    t = threading.Thread(target=dribble)
    t.start()
    assert read_message(a) == Message(MsgType.MAP, 5, 2, list(range(100)))
    with pytest.raises(ProtocolError, match="truncated frame"):
        read_message(a)
    t.join()
    a.close()

    a, b = socket.socketpair()
    b.close()
    with pytest.raises(EOFError):
        read_message(a)
    a.close()

    a, b = socket.socketpair()
    b.sendall(frame[:5])
    b.close()
    with pytest.raises(ProtocolError, match="after 5 of the 28 bytes of the header"):
        read_message(a)
    a.close()

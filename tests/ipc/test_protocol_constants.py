"""The wire protocol's numbers are defined twice, for Python and C++; they must agree.

kvcached_core/ipc/protocol.py is the reference. csrc/protocol.h repeats its
numbers for the native page server; this test reads them from the header's
source and from the built extension (``_native.PROTOCOL``) and holds both
equal to Python's.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from kvcached_core.ipc import protocol

CSRC = Path(__file__).resolve().parents[2] / "csrc"
FIELDS = ("magic", "version", "type", "status", "request_id", "group", "count", "text_len")

_CONST = re.compile(r"constexpr\s+[\w:]+\s+(k\w+)\s*=\s*([^;]+);")
_MAGIC = re.compile(r"constexpr\s+char\s+kMagic\[4\]\s*=\s*\{([^}]*)\};")


def _eval(expr: str) -> int:
    """A C++ integer constant expression of the kind protocol.h uses (``1u << 24``, ``64 * 1024``)."""
    cleaned = re.sub(r"\b(0x[0-9a-fA-F]+|\d+)[uUlL]*\b", r"\1", expr.strip())
    if not re.fullmatch(r"[0-9a-fA-Fx\s<>*+()-]+", cleaned):
        raise ValueError(f"not a plain integer expression: {expr!r}")
    return int(eval(cleaned, {"__builtins__": {}}))  # digits and operators only


def header_constants() -> dict[str, object]:
    text = (CSRC / "protocol.h").read_text()
    found: dict[str, object] = {name: _eval(value) for name, value in _CONST.findall(text)
                                if name != "kMagic"}
    magic = _MAGIC.search(text)
    assert magic, "protocol.h no longer defines kMagic as four chars"
    found["kMagic"] = bytes(ord(c) for c in re.findall(r"'(.)'", magic.group(1)))
    return found


def python_offsets() -> dict[str, int]:
    codes = re.findall(r"\d*[a-zA-Z]", protocol.HEADER.format.lstrip("<"))
    assert len(codes) == len(FIELDS)
    return {field: struct.calcsize("<" + "".join(codes[:i])) for i, field in enumerate(FIELDS)}


def expected() -> dict[str, object]:
    """protocol.py's numbers under the names protocol.h gives them."""
    want: dict[str, object] = {
        "kMagic": protocol.MAGIC, "kVersion": protocol.VERSION,
        "kHeaderSize": protocol.HEADER_SIZE, "kReplyBit": protocol.REPLY_BIT,
        "kMaxCount": protocol.MAX_COUNT, "kMaxText": protocol.MAX_TEXT,
    }
    camel = {"request_id": "RequestId", "text_len": "TextLen"}
    for field, offset in python_offsets().items():
        if field != "magic":
            want["kOff" + camel.get(field, field.capitalize())] = offset
    for t in protocol.MsgType:
        want["kType" + {"MEMINFO": "MemInfo"}.get(t.name, t.name.capitalize())] = int(t)
    for s in protocol.Status:
        name = "".join(part.capitalize() for part in s.name.split("_"))
        want["kStatus" + name] = int(s)
    return want


def test_the_header_source_matches_python():
    assert header_constants() == expected()


def test_the_built_extension_matches_python():
    _native = pytest.importorskip("kvcached_core._native")
    compiled = _native.PROTOCOL
    assert compiled["magic"] == protocol.MAGIC and compiled["version"] == protocol.VERSION
    assert compiled["header_size"] == protocol.HEADER_SIZE
    assert compiled["reply_bit"] == protocol.REPLY_BIT
    assert compiled["max_count"] == protocol.MAX_COUNT
    assert compiled["max_text"] == protocol.MAX_TEXT
    assert compiled["offsets"] == {k: v for k, v in python_offsets().items() if k != "magic"}
    assert compiled["types"] == {t.name: int(t) for t in protocol.MsgType}
    assert compiled["statuses"] == {s.name: int(s) for s in protocol.Status}


def test_no_other_native_file_defines_the_wire_numbers():
    """The native code takes every wire number from protocol.h (no second copy to drift)."""
    names = set(header_constants())
    for path in sorted(CSRC.glob("*.[ch]*")):
        if path.name == "protocol.h":
            continue
        defined = {name for name, _ in _CONST.findall(path.read_text())} & names
        assert not defined, f"{path.name} defines {sorted(defined)} again; use protocol.h"
        assert not _MAGIC.search(path.read_text()), f"{path.name} defines kMagic again"


def test_the_parser_reads_what_it_is_given():
    """The header parser is not vacuous: it reads values and refuses what it cannot evaluate."""
    assert _eval("1u << 24") == 1 << 24 and _eval("64 * 1024") == 65536 and _eval("0x80") == 128
    with pytest.raises(ValueError):
        _eval("sizeof(Header)")
    assert len(header_constants()) == len(expected()) > 20

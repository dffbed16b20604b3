// kvcached's IPC wire protocol, the C++ side: the same numbers as
// kvcached_core/ipc/protocol.py, which documents the frame layout.
//
// tests/ipc/test_protocol_constants.py holds the two equal, both as written
// here and as compiled into the extension (kvcached_core._native.PROTOCOL):
// change a value in both places or the test fails.
//
// Every frame is a 28-byte little-endian header and an optional payload:
//   offset size field
//        0    4 magic       "KVCI"
//        4    1 version
//        5    1 type        a reply sets kReplyBit on its request's type
//        6    2 status      0 in requests
//        8    8 request_id
//       16    4 group
//       20    4 count       int64 values after the header
//       24    4 text_len    utf-8 bytes after the values
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvcached {
namespace protocol {

constexpr char kMagic[4] = {'K', 'V', 'C', 'I'};
constexpr std::uint8_t kVersion = 2;
constexpr std::size_t kHeaderSize = 28;
constexpr std::uint8_t kReplyBit = 0x80;
constexpr std::uint32_t kMaxCount = 1u << 24;
constexpr std::uint32_t kMaxText = 64 * 1024;

// Header field offsets.
constexpr std::size_t kOffVersion = 4;
constexpr std::size_t kOffType = 5;
constexpr std::size_t kOffStatus = 6;
constexpr std::size_t kOffRequestId = 8;
constexpr std::size_t kOffGroup = 16;
constexpr std::size_t kOffCount = 20;
constexpr std::size_t kOffTextLen = 24;

// Message types (protocol.py MsgType).
constexpr std::uint8_t kTypeHello = 1;
constexpr std::uint8_t kTypePing = 2;
constexpr std::uint8_t kTypeMap = 3;
constexpr std::uint8_t kTypeUnmap = 4;
constexpr std::uint8_t kTypeQuery = 5;
constexpr std::uint8_t kTypeMemInfo = 6;

// Reply statuses (protocol.py Status).
constexpr std::uint16_t kStatusOk = 0;
constexpr std::uint16_t kStatusError = 1;
constexpr std::uint16_t kStatusBadRequest = 2;
constexpr std::uint16_t kStatusOutOfMemory = 3;

static_assert(kOffTextLen + 4 == kHeaderSize, "the header ends with text_len");

}  // namespace protocol
}  // namespace kvcached

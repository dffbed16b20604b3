#include "page_server.h"

#include "faults.h"

#include <sys/socket.h>
#include <sys/types.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

namespace kvcached {

namespace {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the IPC protocol is little-endian; this build reads it natively");

using namespace protocol;  // the wire's numbers (protocol.h)
// Payload bytes read (and buffered) at a time.
constexpr std::size_t kReadChunk = 1 << 20;

struct Header {
  std::uint8_t type;
  std::uint16_t status;
  std::uint64_t request_id;
  std::uint32_t group;
  std::uint32_t count;
  std::uint32_t text_len;
};

Header unpack(const char* p) {
  Header h;
  h.type = static_cast<std::uint8_t>(p[kOffType]);
  std::memcpy(&h.status, p + kOffStatus, 2);
  std::memcpy(&h.request_id, p + kOffRequestId, 8);
  std::memcpy(&h.group, p + kOffGroup, 4);
  std::memcpy(&h.count, p + kOffCount, 4);
  std::memcpy(&h.text_len, p + kOffTextLen, 4);
  return h;
}

void pack_reply(std::string& out, const Header& req, const std::vector<std::int64_t>& values,
                std::uint16_t status = kStatusOk, const std::string& text = {}) {
  const std::uint8_t type = req.type | kReplyBit;
  const std::uint32_t count = static_cast<std::uint32_t>(values.size());
  const std::uint32_t text_len = static_cast<std::uint32_t>(std::min<std::size_t>(text.size(), kMaxText));
  out.resize(kHeaderSize + 8 * values.size() + text_len);
  char* p = out.data();
  std::memcpy(p, kMagic, 4);
  p[kOffVersion] = static_cast<char>(kVersion);
  p[kOffType] = static_cast<char>(type);
  std::memcpy(p + kOffStatus, &status, 2);
  std::memcpy(p + kOffRequestId, &req.request_id, 8);
  std::memcpy(p + kOffGroup, &req.group, 4);
  std::memcpy(p + kOffCount, &count, 4);
  std::memcpy(p + kOffTextLen, &text_len, 4);
  if (!values.empty()) std::memcpy(p + kHeaderSize, values.data(), 8 * values.size());
  if (text_len) std::memcpy(p + kHeaderSize + 8 * values.size(), text.data(), text_len);
}

// The Python exception an error kind becomes (bindings.cpp), for the reply text.
const char* error_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kOutOfMemory:
      return "DeviceOutOfMemoryError";
    case ErrorKind::kUnavailable:
      return "BackendUnavailableError";
    case ErrorKind::kInvalidArgument:
      return "MappingError";
    case ErrorKind::kForked:
      return "ForkedProcessError";
    case ErrorKind::kDriver:
      break;
  }
  return "DeviceError";
}

// Reads up to n bytes; fewer only when the peer closed or the socket failed.
std::size_t read_full(int fd, char* buf, std::size_t n) {
  std::size_t got = 0;
  while (got < n) {
    ssize_t r = ::recv(fd, buf + got, n - got, 0);
    if (r > 0) {
      got += static_cast<std::size_t>(r);
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else {
      break;
    }
  }
  return got;
}

bool write_full(int fd, const char* buf, std::size_t n) {
  while (n > 0) {
    ssize_t w = ::send(fd, buf, n, MSG_NOSIGNAL);
    if (w > 0) {
      buf += w;
      n -= static_cast<std::size_t>(w);
    } else if (w < 0 && errno == EINTR) {
      continue;
    } else {
      return false;
    }
  }
  return true;
}

}  // namespace

PageServer::PageServer(PageMapper mapper, std::size_t pool_keep)
    : mapper_(std::move(mapper)), pool_keep_(pool_keep) {}

void PageServer::add_group(std::uint32_t group, std::vector<ServedTensor> tensors,
                           std::size_t num_pages) {
  if (tensors.empty()) {
    throw Error(ErrorKind::kInvalidArgument,
                "KV group " + std::to_string(group) + " has no tensors");
  }
  for (const auto& t : tensors) {
    if (!t.tensor || t.bases.empty()) {
      throw Error(ErrorKind::kInvalidArgument,
                  "KV group " + std::to_string(group) + ": a tensor without page bases");
    }
    for (std::int64_t b : t.bases) {
      if (b < 0 || static_cast<std::size_t>(b) + num_pages > t.tensor->num_pages()) {
        throw Error(ErrorKind::kInvalidArgument,
                    "KV group " + std::to_string(group) + ": pages " + std::to_string(b) +
                        ".." + std::to_string(b + static_cast<std::int64_t>(num_pages)) +
                        " do not fit a tensor of " + std::to_string(t.tensor->num_pages()) +
                        " pages");
      }
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  groups_[group] = Group{std::move(tensors), num_pages};
}

bool PageServer::has_group(std::uint32_t group) const {
  std::lock_guard<std::mutex> lock(mu_);
  return groups_.count(group) != 0;
}

std::vector<std::int64_t> PageServer::apply(PageOp op, std::uint32_t group,
                                            const std::vector<std::int64_t>& pages) {
  mapper_.check_process();  // before our lock, which the parent may have held at a fork
  if (op == PageOp::kMemInfo) {
    if (!has_group(group)) {
      throw Error(ErrorKind::kInvalidArgument,
                  "no KV group " + std::to_string(group) + " in this worker");
    }
    const MemInfo mi = mapper_.mem_info();
    return {static_cast<std::int64_t>(mi.free_bytes), static_cast<std::int64_t>(mi.total_bytes),
            static_cast<std::int64_t>(mapper_.stats().pooled_handles)};
  }
  // Queued device work may still read the pages: wait for it without the lock.
  if (op == PageOp::kUnmap && !pages.empty()) mapper_.synchronize();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = groups_.find(group);
  if (it == groups_.end()) {
    throw Error(ErrorKind::kInvalidArgument,
                "no KV group " + std::to_string(group) + " in this worker");
  }
  const Group& g = it->second;
  for (std::int64_t p : pages) {
    if (p < 0 || static_cast<std::size_t>(p) >= g.num_pages) {
      throw Error(ErrorKind::kInvalidArgument,
                  "page " + std::to_string(p) + " outside 0.." + std::to_string(g.num_pages - 1));
    }
  }
  auto indices = [&pages](const ServedTensor& t) {
    std::vector<std::int64_t> idx;
    idx.reserve(t.bases.size() * pages.size());
    for (std::int64_t b : t.bases)
      for (std::int64_t p : pages) idx.push_back(b + p);
    return idx;
  };
  switch (op) {
    case PageOp::kMap: {
      std::size_t done = 0;
      try {
        for (; done < g.tensors.size(); ++done)
          mapper_.map({g.tensors[done].tensor}, indices(g.tensors[done]));
      } catch (...) {
        for (std::size_t i = 0; i < done; ++i) {
          try {
            mapper_.unmap({g.tensors[i].tensor}, indices(g.tensors[i]), true);
          } catch (...) {
          }
        }
        throw;
      }
      return {};
    }
    case PageOp::kUnmap:
      for (const auto& t : g.tensors) mapper_.unmap({t.tensor}, indices(t), false);
      mapper_.trim_pool(pool_keep_);
      return {};
    case PageOp::kMemInfo:
      break;  // answered above
    case PageOp::kQuery: {
      const ServedTensor& t = g.tensors.front();
      std::vector<std::int64_t> out;
      const std::int64_t base = t.bases.front();
      if (pages.empty()) {
        for (std::size_t p = 0; p < g.num_pages; ++p)
          if (t.tensor->is_mapped(base + p)) out.push_back(static_cast<std::int64_t>(p));
      } else {
        for (std::int64_t p : pages)
          if (t.tensor->is_mapped(static_cast<std::size_t>(base + p))) out.push_back(p);
      }
      return out;
    }
  }
  throw Error(ErrorKind::kInvalidArgument, "unknown page operation");
}

std::string PageServer::serve(int fd) {
  std::string frame;
  std::string reply;
  std::vector<std::int64_t> pages;
  for (;;) {
    frame.resize(kHeaderSize);
    std::size_t got = read_full(fd, frame.data(), kHeaderSize);
    if (got == 0) return {};
    if (got < kHeaderSize || std::memcmp(frame.data(), kMagic, 4) != 0 ||
        static_cast<std::uint8_t>(frame[kOffVersion]) != kVersion) {
      frame.resize(got);
      return frame;
    }
    const Header h = unpack(frame.data());
    if (h.count > kMaxCount || h.text_len > kMaxText) return frame;
    const std::size_t payload = 8 * static_cast<std::size_t>(h.count) + h.text_len;
    // Grow the buffer as the payload arrives, not by what the header
    // announces: a peer that sends headers only must not make us allocate
    // (and zero-fill) 128 MiB per connection.
    std::size_t have = 0;
    while (have < payload) {
      const std::size_t step = std::min(payload - have, kReadChunk);
      frame.resize(kHeaderSize + have + step);
      got = read_full(fd, frame.data() + kHeaderSize + have, step);
      have += got;
      if (got < step) {
        frame.resize(kHeaderSize + have);
        return frame;
      }
    }
    const bool page_request = (h.type == kTypeMap || h.type == kTypeUnmap ||
                               h.type == kTypeQuery || h.type == kTypeMemInfo);
    // A request's text, if any, means nothing to a page operation (the Python
    // listener ignores it too). A status in a request is malformed, and a
    // group this server lacks may be the handler's: both go back to Python.
    if (!page_request || h.status != kStatusOk || !has_group(h.group)) return frame;
    // An injected IPC failure drops the connection without a reply, as a
    // crashed or wedged worker would; a stall delays the reply.
    if (faults::hit(faults::Site::kIpc) == faults::Action::kFail) return {};
    pages.resize(h.count);
    if (h.count) std::memcpy(pages.data(), frame.data() + kHeaderSize, 8 * h.count);
    try {
      pack_reply(reply, h, apply(static_cast<PageOp>(h.type), h.group, pages));
    } catch (const Error& e) {
      pack_reply(reply, h, {},
                 e.kind() == ErrorKind::kOutOfMemory ? kStatusOutOfMemory : kStatusError,
                 std::string(error_name(e.kind())) + ": " + e.what());
    } catch (const std::exception& e) {
      pack_reply(reply, h, {}, kStatusError, std::string("DeviceError: ") + e.what());
    }
    served_.fetch_add(1);
    if (!write_full(fd, reply.data(), reply.size())) return {};
  }
}

}  // namespace kvcached

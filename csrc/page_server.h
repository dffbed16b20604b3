// The worker's page server: applies the scheduler's map / unmap / query
// requests to a page mapper, and answers them on a kvcached IPC socket
// without the Python interpreter.
//
// A worker that computes in Python holds the GIL most of the time; a Python
// listener thread then waits milliseconds for it before and after every
// request. PageServer::serve reads frames of kvcached's IPC protocol
// (protocol.h, kvcached_core/ipc/protocol.py: 28-byte little-endian header,
// int64 payload) and answers MAP, UNMAP, QUERY and MEMINFO requests for its groups
// itself, failures included (an error reply with the error's kind and text,
// status OUT_OF_MEMORY when the device had no memory). Every other frame
// (handshake, ping, a reply, a malformed frame, an unknown group) is handed
// back to the caller unanswered, so the Python listener keeps the one
// implementation of handshakes and of everything else.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "page_mapper.h"
#include "protocol.h"

namespace kvcached {

// Page p of a group lives at page index base + p of `tensor`, for each base.
struct ServedTensor {
  std::shared_ptr<VirtualTensor> tensor;
  std::vector<std::int64_t> bases;
};

// The protocol's request types the server applies (their numbers on the wire).
enum class PageOp : std::uint8_t {
  kMap = protocol::kTypeMap,
  kUnmap = protocol::kTypeUnmap,
  kQuery = protocol::kTypeQuery,
  kMemInfo = protocol::kTypeMemInfo,
};

class PageServer {
 public:
  // After an unmap the mapper's pool of spare handles is trimmed to `pool_keep`.
  PageServer(PageMapper mapper, std::size_t pool_keep);

  // Registers KV group `group` of `num_pages` pages (replacing an earlier one).
  void add_group(std::uint32_t group, std::vector<ServedTensor> tensors,
                 std::size_t num_pages);
  bool has_group(std::uint32_t group) const;

  // Maps (all tensors or none), unmaps (then trims the pool) or queries pages
  // of a group. Query returns the mapped ones among `pages` (all pages if
  // empty); MemInfo returns the device's free and total bytes and the
  // mapper's pooled handles (a mapped page of the group needs one handle per
  // tensor base). Throws Error on an unknown group, a page out of range or a
  // failed driver call; a failed map leaves nothing of the request mapped.
  // An unmap waits for queued device work once, before it takes the lock, so
  // requests on other connections are not held up by the device.
  std::vector<std::int64_t> apply(PageOp op, std::uint32_t group,
                                  const std::vector<std::int64_t>& pages);

  // Answers requests on the stream socket `fd` until one it leaves to the
  // caller, and returns that frame as read (possibly cut short); returns an
  // empty string once the peer closed between frames or the socket failed.
  std::string serve(int fd);

  // Requests answered by serve().
  std::uint64_t served() const noexcept { return served_.load(); }

 private:
  struct Group {
    std::vector<ServedTensor> tensors;
    std::size_t num_pages;
  };

  PageMapper mapper_;
  std::size_t pool_keep_;
  mutable std::mutex mu_;  // one request at a time, as the Python handler
  std::map<std::uint32_t, Group> groups_;
  std::atomic<std::uint64_t> served_{0};
};

}  // namespace kvcached

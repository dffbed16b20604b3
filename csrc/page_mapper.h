// The page mapper: virtual tensors over reserved address ranges, backed page
// by page with physical handles drawn from a recycle pool.
//
// A page index p names the same offset range [p * page_size, (p+1) * page_size)
// in every virtual tensor of a batch: one KV "page" spans all layers.
// Unmapping keeps the handle in the pool for the next map; the pool is bounded
// by a limit and trimmed on request. Batches are all-or-nothing: a failure
// part-way unmaps what the batch mapped and returns its handles to the pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "backend.h"
#include "dlpack.h"

namespace kvcached {

struct MapperCore;

class VirtualTensor {
 public:
  VirtualTensor(std::shared_ptr<MapperCore> core, std::uintptr_t address,
                std::size_t size);
  ~VirtualTensor();
  VirtualTensor(const VirtualTensor&) = delete;
  VirtualTensor& operator=(const VirtualTensor&) = delete;

  std::uintptr_t address() const noexcept { return address_; }
  std::size_t size() const noexcept { return size_; }
  std::size_t num_pages() const noexcept { return handles_.size(); }
  std::size_t mapped_pages() const;
  bool is_mapped(std::size_t page) const;
  const MapperCore& core() const { return *core_; }
  // Caller holds the mapper's lock.
  bool is_mapped_locked(std::size_t page) const { return mapped_[page] != 0; }

  // A DLPack tensor of `size` uint8 bytes. It keeps `self` (and with it the
  // reservation) alive until the consumer drops it.
  static DLManagedTensor* to_dlpack(const std::shared_ptr<VirtualTensor>& self);

 private:
  friend class PageMapper;
  std::shared_ptr<MapperCore> core_;
  std::uintptr_t address_;
  std::size_t size_;
  // handles_[p] is valid while mapped_[p].
  std::vector<Handle> handles_;
  std::vector<char> mapped_;
  std::size_t num_mapped_ = 0;
};

struct MapperStats {
  std::size_t mapped_pages;     // pages mapped over all virtual tensors
  std::size_t pooled_handles;   // unmapped handles kept for reuse
  std::size_t handles_created;  // backend create() calls so far
  std::size_t handles_released; // backend release() calls so far
  std::size_t pool_limit;
};

class PageGroup;

class PageMapper {
 public:
  PageMapper(const std::string& backend, int device, std::size_t page_size);

  const char* backend_name() const;
  int device() const;
  int dlpack_device_type() const;
  std::size_t page_size() const;
  std::size_t granularity() const;

  // Reserves address space only; no per-page driver work.
  std::shared_ptr<VirtualTensor> reserve(std::size_t size);

  // Maps page index p of every tensor, for each p in `pages`.
  void map(const std::vector<std::shared_ptr<VirtualTensor>>& tensors,
           const std::vector<std::int64_t>& pages);
  // Unmaps them; with `synchronize` first waits for queued device work.
  void unmap(const std::vector<std::shared_ptr<VirtualTensor>>& tensors,
             const std::vector<std::int64_t>& pages, bool synchronize);

  // A fixed set of this mapper's tensors, mapped and unmapped together.
  PageGroup group(std::vector<std::shared_ptr<VirtualTensor>> tensors) const;

  // Releases pooled handles until at most `keep` remain; returns how many.
  std::size_t trim_pool(std::size_t keep);
  void set_pool_limit(std::size_t limit);
  MapperStats stats() const;
  MemInfo mem_info() const;
  void synchronize();
  // Throws Error(kForked) in a process forked from the one that opened the
  // mapper; every other call checks this first.
  void check_process() const;

 private:
  friend class PageGroup;
  void map_checked(const std::vector<std::shared_ptr<VirtualTensor>>& tensors,
                   const std::vector<std::int64_t>& pages, bool check_tensors);
  void unmap_checked(const std::vector<std::shared_ptr<VirtualTensor>>& tensors,
                     const std::vector<std::int64_t>& pages, bool synchronize,
                     bool check_tensors);
  std::shared_ptr<MapperCore> core_;
};

// The virtual tensors one KV page spans (every layer's buffers), checked once
// so that each map/unmap passes page indices only: the engine's hot path.
class PageGroup {
 public:
  PageGroup(PageMapper mapper, std::vector<std::shared_ptr<VirtualTensor>> tensors);
  void map(const std::vector<std::int64_t>& pages) {
    mapper_.map_checked(tensors_, pages, false);
  }
  void unmap(const std::vector<std::int64_t>& pages, bool synchronize) {
    mapper_.unmap_checked(tensors_, pages, synchronize, false);
  }
  const std::vector<std::shared_ptr<VirtualTensor>>& tensors() const { return tensors_; }

 private:
  PageMapper mapper_;
  std::vector<std::shared_ptr<VirtualTensor>> tensors_;
};

}  // namespace kvcached

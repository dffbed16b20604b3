#include "page_mapper.h"

#include "faults.h"

#include <unistd.h>

#include <limits>
#include <unordered_set>

namespace kvcached {

// Fork: a mapper belongs to the process that opened it. In a forked child
// every call throws ErrorKind::kForked before it takes the lock (a thread of
// the parent may have held it at the fork), and destructors there release
// nothing: the handles and the device context are the parent's, and a host
// page's hole punch would wipe the parent's page. The host backend also keeps
// its mappings out of children (MADV_DONTFORK), so a child never shares a
// page with its parent by accident.
struct MapperCore {
  std::unique_ptr<Backend> backend;
  std::size_t page_size = 0;
  std::uint64_t generation = fork_generation();
  pid_t owner_pid = getpid();
  mutable std::mutex mu;
  std::vector<Handle> pool;
  std::size_t pool_limit = std::numeric_limits<std::size_t>::max();
  std::size_t mapped_pages = 0;
  std::size_t handles_created = 0;
  std::size_t handles_released = 0;

  bool forked() const noexcept { return fork_generation() != generation; }

  void check_process() const {
    if (forked()) {
      throw Error(ErrorKind::kForked,
                  "this " + std::string(backend->name()) + " page mapper belongs to process " +
                      std::to_string(owner_pid) + "; process " + std::to_string(getpid()) +
                      " is a fork of it and must open its own mapper");
    }
  }

  ~MapperCore() {
    if (forked()) {
      (void)backend.release();  // the parent's: no driver call, no hole punch here
      return;
    }
    for (Handle h : pool) {
      try {
        backend->release(h, page_size);
      } catch (const std::exception& e) {
        report_error(e.what());
      }
    }
  }

  // Caller holds mu.
  Handle take_handle() {
    if (!pool.empty()) {
      Handle h = pool.back();
      pool.pop_back();
      return h;
    }
    std::uint64_t call = 0;
    if (faults::hit(faults::Site::kCreate, &call) == faults::Action::kFail) {
      throw Error(ErrorKind::kOutOfMemory,
                  "injected fault (KVCACHED_FAULTS): handle create call " + std::to_string(call) +
                      " fails");
    }
    Handle h = backend->create(page_size);
    ++handles_created;
    return h;
  }

  // Caller holds mu. Keeps the handle unless the pool is full.
  void give_back(Handle h) {
    if (pool.size() < pool_limit) {
      pool.push_back(h);
      return;
    }
    backend->release(h, page_size);
    ++handles_released;
  }

  std::size_t trim_to(std::size_t keep) {
    std::size_t released = 0;
    while (pool.size() > keep) {
      backend->release(pool.back(), page_size);
      pool.pop_back();
      ++handles_released;
      ++released;
    }
    return released;
  }
};

// ---------------------------------------------------------------- VirtualTensor

VirtualTensor::VirtualTensor(std::shared_ptr<MapperCore> core,
                             std::uintptr_t address, std::size_t size)
    : core_(std::move(core)),
      address_(address),
      size_(size),
      handles_(size / core_->page_size, 0),
      mapped_(size / core_->page_size, 0) {}

VirtualTensor::~VirtualTensor() {
  if (core_->forked()) return;  // the parent's pages and reservation: leave them be
  std::lock_guard<std::mutex> lock(core_->mu);
  const std::size_t ps = core_->page_size;
  if (num_mapped_ > 0) {
    try {
      core_->backend->synchronize();
    } catch (const std::exception& e) {
      report_error(e.what());
    }
  }
  for (std::size_t p = 0; p < mapped_.size() && num_mapped_ > 0; ++p) {
    if (!mapped_[p]) continue;
    try {
      core_->backend->unmap(address_ + p * ps, ps);
      core_->give_back(handles_[p]);
    } catch (const std::exception& e) {
      report_error(e.what());
    }
    mapped_[p] = 0;
    --num_mapped_;
    --core_->mapped_pages;
  }
  core_->backend->free_range(address_, size_);
}

std::size_t VirtualTensor::mapped_pages() const {
  core_->check_process();
  std::lock_guard<std::mutex> lock(core_->mu);
  return num_mapped_;
}

bool VirtualTensor::is_mapped(std::size_t page) const {
  core_->check_process();
  std::lock_guard<std::mutex> lock(core_->mu);
  if (page >= mapped_.size()) {
    throw Error(ErrorKind::kInvalidArgument,
                "page " + std::to_string(page) + " outside virtual tensor at " +
                    hex(address_) + " of " + std::to_string(mapped_.size()) + " pages");
  }
  return mapped_[page] != 0;
}

namespace {
struct DLPackContext {
  std::shared_ptr<VirtualTensor> owner;
  int64_t shape[1];
  DLManagedTensor managed;
};

void delete_dlpack(DLManagedTensor* self) {
  delete static_cast<DLPackContext*>(self->manager_ctx);
}
}  // namespace

DLManagedTensor* VirtualTensor::to_dlpack(const std::shared_ptr<VirtualTensor>& self) {
  auto* ctx = new DLPackContext{};
  ctx->owner = self;
  ctx->shape[0] = static_cast<int64_t>(self->size_);
  DLTensor& t = ctx->managed.dl_tensor;
  t.data = reinterpret_cast<void*>(self->address_);
  t.device = DLDevice{self->core_->backend->dlpack_device_type(),
                      self->core_->backend->device()};
  t.ndim = 1;
  t.dtype = DLDataType{kDLUInt, 8, 1};
  t.shape = ctx->shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  ctx->managed.manager_ctx = ctx;
  ctx->managed.deleter = delete_dlpack;
  return &ctx->managed;
}

// ------------------------------------------------------------------ PageMapper

PageMapper::PageMapper(const std::string& backend, int device, std::size_t page_size)
    : core_(std::make_shared<MapperCore>()) {
  core_->backend = make_backend(backend, device);
  const std::size_t g = core_->backend->granularity();
  if (page_size == 0 || page_size % g != 0) {
    throw Error(ErrorKind::kInvalidArgument,
                "page size " + std::to_string(page_size) +
                    " bytes is not a positive multiple of the " + backend +
                    " device " + std::to_string(device) + " granularity of " +
                    std::to_string(g) + " bytes");
  }
  core_->page_size = page_size;
}

const char* PageMapper::backend_name() const { return core_->backend->name(); }
int PageMapper::device() const { return core_->backend->device(); }
int PageMapper::dlpack_device_type() const {
  return core_->backend->dlpack_device_type();
}
std::size_t PageMapper::page_size() const { return core_->page_size; }
std::size_t PageMapper::granularity() const { return core_->backend->granularity(); }

void PageMapper::check_process() const { core_->check_process(); }

std::shared_ptr<VirtualTensor> PageMapper::reserve(std::size_t size) {
  core_->check_process();
  const std::size_t ps = core_->page_size;
  if (size == 0 || size % ps != 0) {
    throw Error(ErrorKind::kInvalidArgument,
                "virtual tensor size " + std::to_string(size) +
                    " bytes is not a positive multiple of the page size " +
                    std::to_string(ps));
  }
  std::uintptr_t addr = core_->backend->reserve(size, ps);
  try {
    return std::make_shared<VirtualTensor>(core_, addr, size);
  } catch (...) {
    core_->backend->free_range(addr, size);
    throw;
  }
}

namespace {
// Index of an item that appeared earlier in `items`, or -1. Small batches
// (the common case) are checked pairwise without allocating.
template <typename T>
std::ptrdiff_t find_duplicate(const std::vector<T>& items) {
  if (items.size() <= 32) {
    for (std::size_t i = 1; i < items.size(); ++i)
      for (std::size_t j = 0; j < i; ++j)
        if (items[i] == items[j]) return static_cast<std::ptrdiff_t>(i);
    return -1;
  }
  std::unordered_set<T> seen;
  for (std::size_t i = 0; i < items.size(); ++i)
    if (!seen.insert(items[i]).second) return static_cast<std::ptrdiff_t>(i);
  return -1;
}

// Validates a batch before any driver call, so a bad request changes nothing.
void check_tensors(const MapperCore* core,
                   const std::vector<std::shared_ptr<VirtualTensor>>& tensors,
                   const std::string& what) {
  std::ptrdiff_t dup = find_duplicate(tensors);
  if (dup >= 0) {
    throw Error(ErrorKind::kInvalidArgument,
                "virtual tensor at " + hex(tensors[dup] ? tensors[dup]->address() : 0) +
                    " appears twice in one " + what);
  }
  for (const auto& t : tensors) {
    if (!t) throw Error(ErrorKind::kInvalidArgument, "virtual tensor is None");
    if (&t->core() != core) {
      throw Error(ErrorKind::kInvalidArgument, "virtual tensor at " +
                                                   hex(t->address()) +
                                                   " belongs to another page mapper");
    }
  }
}

void check_batch(const MapperCore* core,
                 const std::vector<std::shared_ptr<VirtualTensor>>& tensors,
                 const std::vector<std::int64_t>& pages, bool want_mapped,
                 bool with_tensors) {
  const char* verb = want_mapped ? "unmap" : "map";
  std::ptrdiff_t dup = find_duplicate(pages);
  if (dup >= 0) {
    throw Error(ErrorKind::kInvalidArgument, "page " + std::to_string(pages[dup]) +
                                                 " appears twice in one " + verb +
                                                 " batch");
  }
  if (with_tensors) check_tensors(core, tensors, std::string(verb) + " batch");
  for (const auto& t : tensors) {
    for (std::int64_t p : pages) {
      if (p < 0 || static_cast<std::size_t>(p) >= t->num_pages()) {
        throw Error(ErrorKind::kInvalidArgument,
                    std::string("cannot ") + verb + " page " + std::to_string(p) +
                        " (offset " +
                        std::to_string(p * static_cast<std::int64_t>(core->page_size)) +
                        "): outside the virtual tensor at " + hex(t->address()) +
                        " of " + std::to_string(t->num_pages()) + " pages");
      }
      if (t->is_mapped_locked(static_cast<std::size_t>(p)) != want_mapped) {
        throw Error(ErrorKind::kInvalidArgument,
                    "page " + std::to_string(p) + " of the virtual tensor at " +
                        hex(t->address()) +
                        (want_mapped ? " is not mapped" : " is already mapped"));
      }
    }
  }
}
}  // namespace

void PageMapper::map(const std::vector<std::shared_ptr<VirtualTensor>>& tensors,
                     const std::vector<std::int64_t>& pages) {
  map_checked(tensors, pages, true);
}

void PageMapper::unmap(const std::vector<std::shared_ptr<VirtualTensor>>& tensors,
                       const std::vector<std::int64_t>& pages, bool synchronize) {
  unmap_checked(tensors, pages, synchronize, true);
}

PageGroup PageMapper::group(std::vector<std::shared_ptr<VirtualTensor>> tensors) const {
  core_->check_process();
  return PageGroup(*this, std::move(tensors));
}

PageGroup::PageGroup(PageMapper mapper, std::vector<std::shared_ptr<VirtualTensor>> tensors)
    : mapper_(std::move(mapper)), tensors_(std::move(tensors)) {
  check_tensors(mapper_.core_.get(), tensors_, "page group");
}

void PageMapper::map_checked(const std::vector<std::shared_ptr<VirtualTensor>>& tensors,
                             const std::vector<std::int64_t>& pages, bool with_tensors) {
  core_->check_process();
  std::uint64_t call = 0;
  if (faults::hit(faults::Site::kMap, &call) == faults::Action::kFail) {
    throw Error(ErrorKind::kOutOfMemory,
                "injected fault (KVCACHED_FAULTS): map call " + std::to_string(call) + " fails");
  }
  std::lock_guard<std::mutex> lock(core_->mu);
  check_batch(core_.get(), tensors, pages, false, with_tensors);
  const std::size_t ps = core_->page_size;
  Backend& b = *core_->backend;
  // Done so far, for rollback.
  std::vector<std::pair<VirtualTensor*, std::size_t>> done;
  done.reserve(tensors.size() * pages.size());
  try {
    for (std::int64_t p : pages) {
      for (const auto& t : tensors) {
        const std::uintptr_t addr = t->address_ + static_cast<std::size_t>(p) * ps;
        Handle h = core_->take_handle();
        try {
          b.map(addr, ps, h);
        } catch (...) {
          core_->give_back(h);
          throw;
        }
        try {
          b.set_access(addr, ps);
        } catch (...) {
          b.unmap(addr, ps);
          core_->give_back(h);
          throw;
        }
        t->handles_[p] = h;
        t->mapped_[p] = 1;
        ++t->num_mapped_;
        ++core_->mapped_pages;
        done.emplace_back(t.get(), static_cast<std::size_t>(p));
      }
    }
  } catch (...) {
    for (auto it = done.rbegin(); it != done.rend(); ++it) {
      VirtualTensor* t = it->first;
      const std::size_t p = it->second;
      try {
        b.unmap(t->address_ + p * ps, ps);
        core_->give_back(t->handles_[p]);
      } catch (const std::exception& e) {
        report_error(std::string("rollback: ") + e.what());
      }
      t->mapped_[p] = 0;
      --t->num_mapped_;
      --core_->mapped_pages;
    }
    throw;
  }
}

void PageMapper::unmap_checked(const std::vector<std::shared_ptr<VirtualTensor>>& tensors,
                               const std::vector<std::int64_t>& pages, bool synchronize,
                               bool with_tensors) {
  // Wait for queued device work before taking the lock: a synchronisation can
  // last as long as the device's current work, and maps of other pages (and
  // queries) must not wait behind it. The pages stay mapped meanwhile; the
  // caller owns them and hands none of them out while they are being unmapped.
  core_->check_process();
  if (synchronize && !pages.empty()) core_->backend->synchronize();
  std::lock_guard<std::mutex> lock(core_->mu);
  check_batch(core_.get(), tensors, pages, true, with_tensors);
  const std::size_t ps = core_->page_size;
  for (std::int64_t p : pages) {
    for (const auto& t : tensors) {
      core_->backend->unmap(t->address_ + static_cast<std::size_t>(p) * ps, ps);
      t->mapped_[p] = 0;
      --t->num_mapped_;
      --core_->mapped_pages;
      core_->give_back(t->handles_[p]);
    }
  }
}

std::size_t PageMapper::trim_pool(std::size_t keep) {
  core_->check_process();
  std::lock_guard<std::mutex> lock(core_->mu);
  return core_->trim_to(keep);
}

void PageMapper::set_pool_limit(std::size_t limit) {
  core_->check_process();
  std::lock_guard<std::mutex> lock(core_->mu);
  core_->pool_limit = limit;
  core_->trim_to(limit);
}

MapperStats PageMapper::stats() const {
  core_->check_process();
  std::lock_guard<std::mutex> lock(core_->mu);
  return MapperStats{core_->mapped_pages, core_->pool.size(), core_->handles_created,
                     core_->handles_released, core_->pool_limit};
}

MemInfo PageMapper::mem_info() const {
  core_->check_process();
  return core_->backend->mem_info();
}

void PageMapper::synchronize() {
  core_->check_process();
  core_->backend->synchronize();
}

}  // namespace kvcached

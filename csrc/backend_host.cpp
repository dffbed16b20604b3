// Host backend: CPU memory with the semantics of a GPU VMM API.
//
//   reserve  = mmap(PROT_NONE)                       (address space only)
//   create   = a slot of one memfd, committed with fallocate (ENOSPC -> OOM)
//   map      = mmap(MAP_FIXED | MAP_SHARED) of that slot over the reservation;
//              a background thread then fills the page tables
//              (MADV_POPULATE_WRITE), as a GPU map backs the range at once.
//              Otherwise the engine's first touches take 512 page faults per
//              2 MiB page on its compute path (about 3x the populate's cost);
//              populating inside map() would triple the map's latency.
//   unmap    = mmap(PROT_NONE, MAP_FIXED) back over the range
//   release  = punch the slot's hole and return the slot for reuse
//
// Fork: mapped pages are MADV_DONTFORK, so a forked child does not inherit
// them (the parent's KV pages never show up, writable, in a child), and the
// page mapper refuses every call in a child (page_mapper.cpp).
//
// Mapped pages count in the process RSS once touched and leave it on unmap,
// so CPU engines get a real elastic KV cache.
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14 and later
#endif

#include "backend.h"

namespace kvcached {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

class HostBackend final : public Backend {
 public:
  explicit HostBackend(int device) : device_(device) {
    if (device != 0) {
      throw Error(ErrorKind::kInvalidArgument,
                  "host backend has one device, 'cpu' (index 0); got index " +
                      std::to_string(device));
    }
    fd_ = static_cast<int>(memfd_create("kvcached-host", MFD_CLOEXEC));
    if (fd_ < 0) {
      throw Error(ErrorKind::kUnavailable,
                  "host backend: memfd_create failed: " + errno_text(errno));
    }
    granularity_ = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  }

  ~HostBackend() override {
    {
      std::lock_guard<std::mutex> lock(pop_mu_);
      pop_stop_ = true;
    }
    pop_cv_.notify_all();
    if (populator_) {
      if (populator_pid_ == getpid()) {
        populator_->join();
      } else {
        populator_.release();  // started before a fork: no such thread in this process
      }
    }
    if (fd_ >= 0) close(fd_);
  }

  const char* name() const noexcept override { return "host"; }
  int device() const noexcept override { return device_; }
  int dlpack_device_type() const noexcept override { return kDLCPU; }
  std::size_t granularity() const noexcept override { return granularity_; }

  std::uintptr_t reserve(std::size_t size, std::size_t alignment) override {
    // Over-reserve by one alignment so the returned range is aligned, then
    // give the slack back.
    std::size_t span = size + alignment;
    void* p = mmap(nullptr, span, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      throw Error(err == ENOMEM ? ErrorKind::kOutOfMemory : ErrorKind::kDriver,
                  "host backend: cannot reserve " + std::to_string(size) +
                      " bytes of address space: " + errno_text(err));
    }
    auto base = reinterpret_cast<std::uintptr_t>(p);
    std::uintptr_t aligned = (base + alignment - 1) / alignment * alignment;
    if (aligned > base) munmap(p, aligned - base);
    std::uintptr_t end = aligned + size;
    if (base + span > end) munmap(reinterpret_cast<void*>(end), base + span - end);
    return aligned;
  }

  void free_range(std::uintptr_t addr, std::size_t size) noexcept override {
    if (munmap(reinterpret_cast<void*>(addr), size) != 0) {
      report_error("host backend: munmap(" + hex(addr) + ", " +
                   std::to_string(size) + ") failed: " + errno_text(errno));
    }
  }

  Handle create(std::size_t size) override {
    std::lock_guard<std::mutex> lock(mu_);
    off_t offset;
    auto& slots = free_slots_[size];
    bool fresh = slots.empty();
    if (!fresh) {
      offset = slots.back();
      slots.pop_back();
    } else {
      offset = file_size_;
      if (ftruncate(fd_, file_size_ + static_cast<off_t>(size)) != 0) {
        int err = errno;
        throw Error(ErrorKind::kOutOfMemory,
                    "host backend: cannot grow the page file by " +
                        std::to_string(size) + " bytes: " + errno_text(err));
      }
      file_size_ += static_cast<off_t>(size);
    }
    // Commit the memory now, so exhaustion is an error here rather than a
    // SIGBUS when the page is first touched.
    if (fallocate(fd_, 0, offset, static_cast<off_t>(size)) != 0) {
      int err = errno;
      slots.push_back(offset);
      throw Error(err == ENOSPC || err == ENOMEM ? ErrorKind::kOutOfMemory
                                                 : ErrorKind::kDriver,
                  "host backend: cannot commit " + std::to_string(size) +
                      " bytes: " + errno_text(err));
    }
    return static_cast<Handle>(offset);
  }

  void release(Handle handle, std::size_t size) override {
    auto offset = static_cast<off_t>(handle);
    if (fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset,
                  static_cast<off_t>(size)) != 0) {
      throw Error(ErrorKind::kDriver,
                  "host backend: hole punch at " + std::to_string(offset) +
                      " failed: " + errno_text(errno));
    }
    std::lock_guard<std::mutex> lock(mu_);
    free_slots_[size].push_back(offset);
  }

  void map(std::uintptr_t addr, std::size_t size, Handle handle) override {
    void* p = mmap(reinterpret_cast<void*>(addr), size, PROT_READ | PROT_WRITE,
                   MAP_SHARED | MAP_FIXED, fd_, static_cast<off_t>(handle));
    if (p == MAP_FAILED) {
      int err = errno;
      throw Error(err == ENOMEM ? ErrorKind::kOutOfMemory : ErrorKind::kDriver,
                  "host backend: mmap at " + hex(addr) + " failed: " +
                      errno_text(err));
    }
    (void)madvise(p, size, MADV_DONTFORK);  // best effort: see the file comment
    queue_populate(addr, size);
  }

  void set_access(std::uintptr_t, std::size_t) override {
    // map() already grants read and write.
  }

  void unmap(std::uintptr_t addr, std::size_t size) override {
    void* p = mmap(reinterpret_cast<void*>(addr), size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) {
      throw Error(ErrorKind::kDriver, "host backend: unmap at " + hex(addr) +
                                          " failed: " + errno_text(errno));
    }
  }

  MemInfo mem_info() override {
    // stdio, not iostreams: see hex() in backend.cpp.
    std::size_t total = 0, avail = 0;
    if (FILE* f = std::fopen("/proc/meminfo", "r")) {
      char key[64];
      unsigned long long kib = 0;
      while (std::fscanf(f, "%63s %llu kB", key, &kib) == 2) {
        if (std::strcmp(key, "MemTotal:") == 0) total = kib * 1024;
        if (std::strcmp(key, "MemAvailable:") == 0) avail = kib * 1024;
      }
      std::fclose(f);
    }
    return MemInfo{avail, total};
  }

  void synchronize() override {}

 private:
  // MADV_POPULATE_WRITE exists from Linux 5.14; before, faults do the work.
  static bool kernel_populates() {
    long page = sysconf(_SC_PAGESIZE);
    void* p = mmap(nullptr, static_cast<std::size_t>(page), PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return false;
    bool ok = madvise(p, static_cast<std::size_t>(page), MADV_POPULATE_WRITE) == 0;
    munmap(p, static_cast<std::size_t>(page));
    return ok;
  }

  // Fill a mapped range's page tables off the caller's thread. Harmless when
  // the range is unmapped or remapped meanwhile: the populate then fails or
  // fills whatever is mapped there.
  void queue_populate(std::uintptr_t addr, std::size_t size) {
    if (!populate_supported_.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> lock(pop_mu_);
    if (!populator_ || populator_pid_ != getpid()) {
      populator_.release();  // a thread of the parent before a fork, if any
      populator_.reset(new std::thread([this] { populate_loop(); }));
      populator_pid_ = getpid();
    }
    pop_queue_.emplace_back(addr, size);
    pop_cv_.notify_one();
  }

  void populate_loop() {
    std::unique_lock<std::mutex> lock(pop_mu_);
    for (;;) {
      pop_cv_.wait(lock, [this] { return pop_stop_ || !pop_queue_.empty(); });
      if (pop_stop_) return;
      auto range = pop_queue_.front();
      pop_queue_.pop_front();
      lock.unlock();
      // Errors only mean the range changed meanwhile: nothing to do.
      (void)madvise(reinterpret_cast<void*>(range.first), range.second, MADV_POPULATE_WRITE);
      lock.lock();
    }
  }

  int device_;
  int fd_ = -1;
  std::mutex pop_mu_;
  std::condition_variable pop_cv_;
  std::deque<std::pair<std::uintptr_t, std::size_t>> pop_queue_;
  bool pop_stop_ = false;
  std::atomic<bool> populate_supported_{kernel_populates()};
  std::unique_ptr<std::thread> populator_;
  pid_t populator_pid_ = 0;
  std::size_t granularity_;
  std::mutex mu_;
  off_t file_size_ = 0;
  std::map<std::size_t, std::vector<off_t>> free_slots_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(int device) {
  return std::make_unique<HostBackend>(device);
}

}  // namespace kvcached

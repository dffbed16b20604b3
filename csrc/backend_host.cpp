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
//
// Memory limits: committing past a memory cgroup's limit does not fail, it
// gets the process OOM-killed. So create() first checks the memory the
// process may still commit, as a GPU create meets the device's free memory:
// MemAvailable, and for each memory cgroup from the process's own up to the
// root, its limit minus its usage (cgroup v2 memory.max - memory.current, v1
// memory.limit_in_bytes - memory.usage_in_bytes; reclaimable page cache,
// inactive_file, counts as free). A commit that would leave less than
// kCommitMargin is out of memory: an exception the allocator turns into "no
// space". The reading is kept as a budget that commits draw down and
// releases refill, and is read again when 100 ms old or too small.
// mem_info() reports the same reading (free: what may still be committed;
// total: MemTotal or the smallest cgroup limit).
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <cstdio>
#include <deque>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
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

// Memory a commit must leave free (kernel charge batching, the process's own growth).
constexpr std::size_t kCommitMargin = 32u << 20;
constexpr auto kBudgetTtl = std::chrono::milliseconds(100);
constexpr std::size_t kUnlimited = std::numeric_limits<std::size_t>::max();

// One memory cgroup level: the files of its limit, usage and statistics.
struct CgroupLevel {
  std::string dir;
  bool v2;
};

bool read_word(const std::string& path, std::string& out) {
  std::ifstream f(path);
  return static_cast<bool>(f >> out);
}

// A size from a cgroup file: "max" (v2) and v1's "no limit" (near 2^63) are kUnlimited.
std::size_t parse_limit(const std::string& word) {
  if (word == "max") return kUnlimited;
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(word.c_str(), &end, 10);
  if (errno != 0 || end == word.c_str() || v >= (1ull << 62)) return kUnlimited;
  return static_cast<std::size_t>(v);
}

std::size_t stat_value(const std::string& path, const char* key) {
  std::ifstream f(path);
  std::string k;
  unsigned long long v = 0;
  while (f >> k >> v)
    if (k == key) return static_cast<std::size_t>(v);
  return 0;
}

// This process's memory cgroups, its own first, up to the root of the
// hierarchy that holds the memory controller (v1 if mounted, else v2).
std::vector<CgroupLevel> memory_cgroups() {
  std::string v1_path, v2_path;
  {
    std::ifstream f("/proc/self/cgroup");
    std::string line;
    while (std::getline(f, line)) {
      auto a = line.find(':'), b = line.find(':', a + 1);
      if (a == std::string::npos || b == std::string::npos) continue;
      std::string controllers = "," + line.substr(a + 1, b - a - 1) + ",";
      std::string path = line.substr(b + 1);
      if (line.compare(0, a, "0") == 0 && b == a + 1) v2_path = path;
      if (controllers.find(",memory,") != std::string::npos) v1_path = path;
    }
  }
  std::ifstream f("/proc/self/mountinfo");
  std::string line;
  while (std::getline(f, line)) {
    // id parent major:minor root mountpoint options [optional...] - fstype source super
    std::istringstream in(line);
    std::string id, parent, dev, root, point, word;
    in >> id >> parent >> dev >> root >> point;
    while (in >> word && word != "-") {
    }
    std::string fstype, source, super;
    in >> fstype >> source >> super;
    const bool v1 = fstype == "cgroup" && ("," + super + ",").find(",memory,") != std::string::npos;
    const bool v2 = fstype == "cgroup2" && v1_path.empty();
    const std::string& path = v1 ? v1_path : v2_path;
    if (!(v1 || v2) || path.empty()) continue;
    std::string rel = path;
    if (root != "/") {
      if (rel.compare(0, root.size(), root) != 0) continue;  // not under this mount
      rel = rel.substr(root.size());
    }
    std::vector<CgroupLevel> levels;
    std::string dir = point + (rel == "/" ? "" : rel);
    while (true) {
      levels.push_back(CgroupLevel{dir, v2});
      if (dir.size() <= point.size()) break;
      dir = dir.substr(0, dir.rfind('/'));
      if (dir.size() < point.size()) break;
    }
    return levels;
  }
  return {};
}

struct CommitReading {
  std::size_t avail;  // bytes this process may still commit
  std::size_t total;  // MemTotal, or the smallest cgroup limit
  std::string bound;  // what bounds `avail`, for messages
};

CommitReading read_commit_limit(const std::vector<CgroupLevel>& levels) {
  CommitReading r{kUnlimited, kUnlimited, "MemAvailable"};
  // stdio, not iostreams, for /proc/meminfo: see hex() in backend.cpp.
  if (FILE* f = std::fopen("/proc/meminfo", "r")) {
    char key[64];
    unsigned long long kib = 0;
    while (std::fscanf(f, "%63s %llu kB", key, &kib) == 2) {
      if (std::strcmp(key, "MemTotal:") == 0) r.total = kib * 1024;
      if (std::strcmp(key, "MemAvailable:") == 0) r.avail = kib * 1024;
    }
    std::fclose(f);
  }
  for (const auto& level : levels) {
    std::string limit_word, usage_word;
    const std::string limit_file = level.dir + (level.v2 ? "/memory.max" : "/memory.limit_in_bytes");
    if (!read_word(limit_file, limit_word)) continue;
    const std::size_t limit = parse_limit(limit_word);
    if (limit == kUnlimited) continue;
    if (!read_word(level.dir + (level.v2 ? "/memory.current" : "/memory.usage_in_bytes"),
                   usage_word)) {
      continue;
    }
    std::size_t usage = parse_limit(usage_word);
    if (usage == kUnlimited) continue;
    const std::size_t cache =
        stat_value(level.dir + "/memory.stat", level.v2 ? "inactive_file" : "total_inactive_file");
    usage -= std::min(usage, cache);
    const std::size_t room = limit > usage ? limit - usage : 0;
    r.total = std::min(r.total, limit);
    if (room < r.avail) {
      r.avail = room;
      r.bound = "the memory cgroup limit " + limit_file + " (" + std::to_string(limit) + " bytes)";
    }
  }
  return r;
}

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
    draw_budget_locked(size);
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
        budget_ += size;
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
      budget_ += size;
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
    budget_ += size;
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
    std::lock_guard<std::mutex> lock(mu_);
    const CommitReading r = read_locked();
    return MemInfo{r.avail, r.total};
  }

  void synchronize() override {}

 private:
  // Caller holds mu_. Reads the commit limit now (see the file comment).
  CommitReading read_locked() {
    if (cgroups_pid_ != getpid()) {  // once per process: a fork may be moved elsewhere
      cgroups_ = memory_cgroups();
      cgroups_pid_ = getpid();
    }
    CommitReading r = read_commit_limit(cgroups_);
    budget_ = r.avail > kCommitMargin ? r.avail - kCommitMargin : 0;
    budget_at_ = std::chrono::steady_clock::now();
    return r;
  }

  // Caller holds mu_. Takes `size` bytes from the budget or throws out of memory.
  void draw_budget_locked(std::size_t size) {
    if (budget_ < size || std::chrono::steady_clock::now() - budget_at_ > kBudgetTtl) {
      const CommitReading r = read_locked();
      if (budget_ < size) {
        throw Error(ErrorKind::kOutOfMemory,
                    "host backend: cannot commit " + std::to_string(size) + " bytes: " +
                        std::to_string(r.avail) + " bytes may still be committed (bounded by " +
                        r.bound + ") and " + std::to_string(kCommitMargin) +
                        " must stay free");
      }
    }
    budget_ -= size;
  }

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
  std::vector<CgroupLevel> cgroups_;
  pid_t cgroups_pid_ = 0;
  std::size_t budget_ = 0;  // bytes create() may commit before the next reading
  std::chrono::steady_clock::time_point budget_at_{};
  off_t file_size_ = 0;
  std::map<std::size_t, std::vector<off_t>> free_slots_;
};

}  // namespace

std::unique_ptr<Backend> make_host_backend(int device) {
  return std::make_unique<HostBackend>(device);
}

}  // namespace kvcached

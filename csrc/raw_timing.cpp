// Per-call timings of a backend's raw driver calls, no kvcached bookkeeping
// in between: the baseline the mapper benchmark compares against.
#include <chrono>

#include "raw_timing.h"

namespace kvcached {
namespace {
using Clock = std::chrono::steady_clock;

template <typename F>
double time_us(F&& f) {
  auto t0 = Clock::now();
  f();
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}
}  // namespace

RawTimings time_raw_driver_calls(const std::string& backend, int device,
                                 std::size_t page_size, std::size_t pages) {
  auto b = make_backend(backend, device);
  RawTimings out;
  const std::size_t total = page_size * pages;
  std::uintptr_t base = 0;
  out.reserve_us = time_us([&] { base = b->reserve(total, page_size); });
  std::vector<Handle> handles(pages);
  try {
    for (std::size_t i = 0; i < pages; ++i)
      out.create_us.push_back(time_us([&] { handles[i] = b->create(page_size); }));
    for (std::size_t i = 0; i < pages; ++i)
      out.map_us.push_back(
          time_us([&] { b->map(base + i * page_size, page_size, handles[i]); }));
    for (std::size_t i = 0; i < pages; ++i)
      out.set_access_us.push_back(
          time_us([&] { b->set_access(base + i * page_size, page_size); }));
    b->synchronize();
    for (std::size_t i = 0; i < pages; ++i)
      out.unmap_us.push_back(time_us([&] { b->unmap(base + i * page_size, page_size); }));
    for (std::size_t i = 0; i < pages; ++i)
      out.release_us.push_back(time_us([&] { b->release(handles[i], page_size); }));
  } catch (...) {
    b->free_range(base, total);
    throw;
  }
  b->free_range(base, total);
  return out;
}

MapperTimings time_mapper_calls(PageMapper& mapper, std::size_t pages) {
  MapperTimings out;
  auto vt = mapper.reserve(pages * mapper.page_size());
  std::vector<std::shared_ptr<VirtualTensor>> tensors{vt};
  auto each_page = [&](std::vector<double>& into, auto&& call) {
    for (std::size_t i = 0; i < pages; ++i) {
      std::vector<std::int64_t> page{static_cast<std::int64_t>(i)};
      into.push_back(time_us([&] { call(page); }));
    }
  };
  mapper.synchronize();
  each_page(out.cold_map_us, [&](const auto& p) { mapper.map(tensors, p); });
  each_page(out.unmap_us, [&](const auto& p) { mapper.unmap(tensors, p, false); });
  each_page(out.recycled_map_us, [&](const auto& p) { mapper.map(tensors, p); });
  mapper.set_pool_limit(0);
  each_page(out.unmap_release_us, [&](const auto& p) { mapper.unmap(tensors, p, false); });
  return out;
}

}  // namespace kvcached

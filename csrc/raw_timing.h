#pragma once

#include <string>
#include <vector>

#include "backend.h"
#include "page_mapper.h"

namespace kvcached {

struct RawTimings {
  double reserve_us = 0;
  std::vector<double> create_us, map_us, set_access_us, unmap_us, release_us;
};

// Reserves `pages` pages, then times each create, map, set-access, unmap and
// release call separately, one page at a time.
RawTimings time_raw_driver_calls(const std::string& backend, int device,
                                 std::size_t page_size, std::size_t pages);

struct MapperTimings {
  std::vector<double> cold_map_us, unmap_us, recycled_map_us, unmap_release_us;
};

// The same per-page sequence through a PageMapper, timed in C++: kvcached's
// own cost per call without the Python interpreter around it. Cold maps,
// unmaps keeping the handle, recycled maps, then unmaps with a pool limit of
// zero (each unmap releases its handle).
MapperTimings time_mapper_calls(PageMapper& mapper, std::size_t pages);

}  // namespace kvcached

#pragma once

#include <string>
#include <vector>

#include "backend.h"

namespace kvcached {

struct RawTimings {
  double reserve_us = 0;
  std::vector<double> create_us, map_us, set_access_us, unmap_us, release_us;
};

// Reserves `pages` pages, then times each create, map, set-access, unmap and
// release call separately, one page at a time.
RawTimings time_raw_driver_calls(const std::string& backend, int device,
                                 std::size_t page_size, std::size_t pages);

}  // namespace kvcached

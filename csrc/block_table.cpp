#include "block_table.h"

#include <algorithm>
#include <cstdio>

#include "backend.h"

namespace kvcached {

namespace {

std::string message(const char* fmt, long long a) {
  char buf[160];
  std::snprintf(buf, sizeof buf, fmt, a);
  return buf;
}

}  // namespace

BlockTable::BlockTable(std::vector<std::int64_t> starts, std::vector<std::int64_t> caps,
                       std::int64_t num_blocks)
    : starts_(std::move(starts)), caps_(std::move(caps)), num_blocks_(num_blocks) {
  const std::size_t pages = caps_.size();
  if (starts_.size() != pages || pages == 0 || num_blocks_ < 1) {
    throw Error(ErrorKind::kInvalidArgument, "BlockTable: bad page geometry");
  }
  page_of_.assign(static_cast<std::size_t>(num_blocks_), -1);
  for (std::size_t p = 0; p < pages; ++p) {
    const std::int64_t cap = caps_[p], start = starts_[p];
    if (cap < 0 || start < 0 || start + cap > num_blocks_) {
      throw Error(ErrorKind::kInvalidArgument, "BlockTable: page range outside the blocks");
    }
    for (std::int64_t b = start; b < start + cap; ++b) page_of_[b] = static_cast<std::int32_t>(p);
    max_cap_ = std::max(max_cap_, cap);
    ++unheld_by_cap_[cap];
  }
  free_bits_.assign(static_cast<std::size_t>(num_blocks_) / 64 + 1, 0);
  nfree_.assign(pages, 0);
  scan_.assign(pages, 0);
  held_.assign(pages, 0);
  state_.assign(static_cast<std::size_t>(num_blocks_), kFree);
  head_.assign(static_cast<std::size_t>(max_cap_) + 1, -1);
  next_.assign(pages, -1);
  prev_.assign(pages, -1);
  mask_.assign(static_cast<std::size_t>(max_cap_) / 64 + 1, 0);
}

std::int64_t BlockTable::page_of(std::int64_t block) const { return page_of_[block]; }

std::uint64_t BlockTable::page_word_mask(std::int64_t page, std::size_t word) const {
  const std::int64_t base = static_cast<std::int64_t>(word) * 64;
  const std::int64_t lo = std::max(starts_[page], base) - base;
  const std::int64_t hi = std::min(starts_[page] + caps_[page], base + 64) - base;
  if (hi <= lo) return 0;
  const std::uint64_t upto = hi == 64 ? ~std::uint64_t{0} : (std::uint64_t{1} << hi) - 1;
  return upto & (~std::uint64_t{0} << lo);
}

void BlockTable::set_page_bits(std::int64_t page, bool free) {
  const std::int64_t start = starts_[page], cap = caps_[page];
  if (!cap) return;
  const std::size_t first = static_cast<std::size_t>(start) >> 6;
  const std::size_t last = static_cast<std::size_t>(start + cap - 1) >> 6;
  for (std::size_t w = first; w <= last; ++w) {
    const std::uint64_t m = page_word_mask(page, w);
    free_bits_[w] = free ? (free_bits_[w] | m) : (free_bits_[w] & ~m);
  }
  scan_[page] = first;
}

void BlockTable::bucket_insert(std::int64_t page, std::int64_t k) {
  const std::int64_t h = head_[k];
  next_[page] = h;
  prev_[page] = -1;
  if (h >= 0) {
    prev_[h] = page;
  } else {
    mask_[k >> 6] |= std::uint64_t{1} << (k & 63);
  }
  head_[k] = page;
}

void BlockTable::bucket_remove(std::int64_t page, std::int64_t k) {
  const std::int64_t n = next_[page], p = prev_[page];
  if (p >= 0) {
    next_[p] = n;
  } else {
    head_[k] = n;
  }
  if (n >= 0) prev_[n] = p;
  if (head_[k] < 0) mask_[k >> 6] &= ~(std::uint64_t{1} << (k & 63));
}

std::int64_t BlockTable::lowest_bucket_from(std::int64_t k) const {
  if (k > max_cap_) return -1;
  std::size_t w = static_cast<std::size_t>(k) >> 6;
  std::uint64_t bits = mask_[w] & (~std::uint64_t{0} << (k & 63));
  while (true) {
    if (bits) return static_cast<std::int64_t>(w * 64 + __builtin_ctzll(bits));
    if (++w == mask_.size()) return -1;
    bits = mask_[w];
  }
}

std::int64_t BlockTable::highest_bucket() const {
  for (std::size_t w = mask_.size(); w-- > 0;) {
    if (mask_[w]) return static_cast<std::int64_t>(w * 64 + 63 - __builtin_clzll(mask_[w]));
  }
  return -1;
}

void BlockTable::add_pages(const std::vector<std::int64_t>& pages) {
  for (std::int64_t p : pages) {
    if (p < 0 || p >= num_pages() || held_[p]) {
      throw Error(ErrorKind::kInvalidArgument, message("BlockTable: page %lld is held or out of range", p));
    }
  }
  for (std::int64_t p : pages) {
    const std::int64_t cap = caps_[p];
    set_page_bits(p, true);
    nfree_[p] = cap;
    held_[p] = 1;
    if (cap) bucket_insert(p, cap);
    free_in_pages_ += cap;
    --unheld_by_cap_[cap];
  }
  held_pages_ += static_cast<std::int64_t>(pages.size());
}

bool BlockTable::alloc(std::int64_t n, std::vector<std::int64_t>& out) {
  if (n > free_in_pages_) return false;
  std::int64_t rem = n;
  while (rem) {
    // Best fit: the page with the fewest free blocks that still covers rem,
    // else the page with the most.
    std::int64_t k = lowest_bucket_from(rem);
    if (k < 0) k = highest_bucket();
    const std::int64_t p = head_[k];
    bucket_remove(p, k);
    const std::int64_t take = std::min(k, rem);
    std::size_t w = scan_[p];
    for (std::int64_t i = 0; i < take;) {
      std::uint64_t bits = free_bits_[w] & page_word_mask(p, w);
      if (!bits) {
        ++w;
        continue;
      }
      for (; bits && i < take; ++i) {
        const int bit = __builtin_ctzll(bits);
        bits &= bits - 1;
        free_bits_[w] &= ~(std::uint64_t{1} << bit);
        const std::int64_t b = static_cast<std::int64_t>(w) * 64 + bit;
        state_[b] = kAllocated;
        out.push_back(b);
      }
    }
    scan_[p] = w;
    nfree_[p] = k - take;
    rem -= take;
    if (k > take) bucket_insert(p, k - take);
  }
  free_in_pages_ -= n;
  num_allocated_ += n;
  return true;
}

std::string BlockTable::check_free(const std::vector<std::int64_t>& ids) {
  std::string why;
  std::size_t marked = 0;
  for (; marked < ids.size(); ++marked) {
    const std::int64_t b = ids[marked];
    if (b < 0 || b >= num_blocks_) {
      why = message("block %lld is not allocated (out of range)", b);
      break;
    }
    const std::uint8_t s = state_[b];
    if (s == kAllocated) {
      state_[b] = kMarked;
      continue;
    }
    if (s == kMarked) {
      why = message("block %lld appears twice in one free", b);
    } else if (s == kNull) {
      why = message("block %lld is the null block; it is never freed", b);
    } else {
      why = message("block %lld is not allocated (double free, or never allocated)", b);
    }
    break;
  }
  for (std::size_t i = 0; i < marked; ++i) state_[ids[i]] = kAllocated;
  return why;
}

void BlockTable::free(const std::vector<std::int64_t>& ids, std::vector<std::int64_t>& released) {
  for (std::int64_t b : ids) {
    const std::int64_t p = page_of(b);
    const std::int64_t old = nfree_[p];
    if (old) bucket_remove(p, old);
    state_[b] = kFree;
    if (old + 1 == caps_[p]) {  // the page has no allocated block left
      set_page_bits(p, false);
      nfree_[p] = 0;
      held_[p] = 0;
      ++unheld_by_cap_[caps_[p]];
      --held_pages_;
      free_in_pages_ -= old;  // its other free blocks leave with it
      released.push_back(p);
    } else {
      const std::size_t w = static_cast<std::size_t>(b) >> 6;
      free_bits_[w] |= std::uint64_t{1} << (b & 63);
      if (w < scan_[p]) scan_[p] = w;
      nfree_[p] = old + 1;
      bucket_insert(p, old + 1);
      ++free_in_pages_;
    }
  }
  num_allocated_ -= static_cast<std::int64_t>(ids.size());
}

std::vector<std::int64_t> BlockTable::release_idle(const std::vector<std::int64_t>& pages) {
  std::vector<std::int64_t> idle;
  for (std::int64_t p : pages) {
    if (p < 0 || p >= num_pages() || !held_[p]) continue;
    const std::int64_t cap = caps_[p];
    if (nfree_[p] != cap) continue;
    if (cap) bucket_remove(p, cap);
    set_page_bits(p, false);
    nfree_[p] = 0;
    held_[p] = 0;
    ++unheld_by_cap_[cap];
    --held_pages_;
    free_in_pages_ -= cap;
    idle.push_back(p);
  }
  return idle;
}

void BlockTable::set_null(std::int64_t block) {
  if (block < 0 || block >= num_blocks_ || state_[block] != kAllocated) {
    throw Error(ErrorKind::kInvalidArgument, message("BlockTable: block %lld is not allocated", block));
  }
  state_[block] = kNull;
  --num_allocated_;
}

std::int64_t BlockTable::available(std::int64_t pages) const {
  std::int64_t total = free_in_pages_;
  for (const auto& [cap, count] : unheld_by_cap_) {
    if (pages <= 0) break;
    const std::int64_t k = std::min(pages, count);
    total += k * cap;
    pages -= k;
  }
  return total;
}

std::int64_t BlockTable::page_occupancy(std::int64_t page) const {
  if (page < 0 || page >= num_pages()) {
    throw Error(ErrorKind::kInvalidArgument, message("page %lld is out of range", page));
  }
  if (!held_[page]) return 0;
  return caps_[page] - nfree_[page];
}

std::vector<std::int64_t> BlockTable::allocated_ids() const {
  std::vector<std::int64_t> ids;
  ids.reserve(static_cast<std::size_t>(num_allocated_));
  for (std::int64_t b = 0; b < num_blocks_; ++b) {
    if (state_[b] == kAllocated) ids.push_back(b);
  }
  return ids;
}

bool BlockTable::is_allocated(std::int64_t block) const {
  return block >= 0 && block < num_blocks_ && state_[block] == kAllocated;
}

}  // namespace kvcached

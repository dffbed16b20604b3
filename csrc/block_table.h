// Block bookkeeping of the KV block manager: which blocks of which held pages
// are free, picked best-fit by page, lowest ids of the page first.
//
// Lowest-first keeps a request's blocks in ascending, mostly adjacent runs
// after blocks are freed and reused in any order: attention reads a request's
// blocks one after the other, and a scattered block table reads measurably
// slower on CPUs (page-table walks lose their locality).
//
// Pure bookkeeping: no driver call, no page allocator. The Python
// KVBlockManager (kvcached_core/allocator/block_manager.py) owns the geometry
// and the page allocator, feeds pages in with add_pages() and hands the pages
// free() reports back to the page allocator. Every call runs under the GIL, so
// each is atomic with respect to Python threads.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace kvcached {

class BlockTable {
 public:
  // Page p holds block ids [starts[p], starts[p] + caps[p]); ids are < num_blocks.
  BlockTable(std::vector<std::int64_t> starts, std::vector<std::int64_t> caps,
             std::int64_t num_blocks);

  // Start holding pages (not held now): all their blocks become free.
  void add_pages(const std::vector<std::int64_t>& pages);

  // Take n free blocks from held pages, best-fit by page and lowest ids of each
  // page first, appending the ids (ascending per page) to out. False (nothing
  // taken) when held pages have fewer than n free blocks.
  bool alloc(std::int64_t n, std::vector<std::int64_t>& out);

  // Why ids cannot be freed (empty when they can): not allocated, repeated,
  // the null block, out of range.
  std::string check_free(const std::vector<std::int64_t>& ids);

  // Free ids (check_free() must have passed); appends pages left with no
  // allocated block to released (they are no longer held).
  void free(const std::vector<std::int64_t>& ids, std::vector<std::int64_t>& released);

  // Of the given pages, stop holding those whose blocks are all free; returns them.
  std::vector<std::int64_t> release_idle(const std::vector<std::int64_t>& pages);

  // Mark an allocated block as the never-freed null block.
  void set_null(std::int64_t block);

  // Blocks alloc() could give once `pages` more pages are held, counting each
  // unheld page at the smallest capacity (never optimistic).
  std::int64_t available(std::int64_t pages) const;

  std::int64_t page_occupancy(std::int64_t page) const;
  std::vector<std::int64_t> allocated_ids() const;  // null block excluded
  bool is_allocated(std::int64_t block) const;

  std::int64_t free_in_pages() const { return free_in_pages_; }
  std::int64_t held_pages() const { return held_pages_; }
  std::int64_t num_allocated() const { return num_allocated_; }  // null excluded
  std::int64_t num_pages() const { return static_cast<std::int64_t>(caps_.size()); }

 private:
  enum State : std::uint8_t { kFree = 0, kAllocated = 1, kNull = 2, kMarked = 3 };

  void bucket_insert(std::int64_t page, std::int64_t k);
  void bucket_remove(std::int64_t page, std::int64_t k);
  std::int64_t lowest_bucket_from(std::int64_t k) const;  // -1 if none
  std::int64_t highest_bucket() const;                    // -1 if none
  std::int64_t page_of(std::int64_t block) const;
  void set_page_bits(std::int64_t page, bool free);  // every block of the page
  std::uint64_t page_word_mask(std::int64_t page, std::size_t word) const;

  std::vector<std::int64_t> starts_, caps_;
  std::int64_t num_blocks_;
  std::int64_t max_cap_ = 0;
  std::vector<std::uint64_t> free_bits_;  // per block: free in a held page
  std::vector<std::int64_t> nfree_;       // per page: free blocks (0 when not held)
  std::vector<std::size_t> scan_;         // per page: no free bit below this word
  std::vector<std::uint8_t> held_;
  std::vector<std::uint8_t> state_;  // per block
  std::vector<std::int32_t> page_of_;  // per block: its page (-1 for straddling ids)
  // Pages by free count k >= 1: intrusive doubly linked lists, plus a bitmask.
  std::vector<std::int64_t> head_, next_, prev_;
  std::vector<std::uint64_t> mask_;
  std::map<std::int64_t, std::int64_t> unheld_by_cap_;
  std::int64_t free_in_pages_ = 0, held_pages_ = 0, num_allocated_ = 0;
};

}  // namespace kvcached

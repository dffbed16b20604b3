// Fault injection for reliability tests: make the n-th map / handle create /
// IPC request fail, stall or kill the process (KVCACHED_FAULTS, parsed and
// armed by kvcached_core/faults.py when the module loads).
//
// Off by default. A site costs one relaxed atomic load while nothing is armed.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

namespace kvcached {
namespace faults {

enum class Site : int { kMap = 0, kCreate = 1, kIpc = 2 };
constexpr int kNumSites = 3;

enum class Action : int { kNone = 0, kFail = 1, kStall = 2, kKill = 3 };

struct Rule {
  Site site;
  std::uint64_t first;  // 1-based call numbers, both ends included
  std::uint64_t last;
  Action action;
  double seconds;  // for kStall
};

extern std::atomic<bool> g_armed;

// Counts the call and acts on a matching rule: a stall sleeps and returns
// kNone, a kill sends SIGKILL to this process; kFail is left to the caller
// (what failing means depends on the site). Only called while armed.
Action hit_armed(Site site, std::uint64_t* call);

// What the caller must do at this site now (kNone or kFail).
inline Action hit(Site site, std::uint64_t* call = nullptr) {
  if (__builtin_expect(!g_armed.load(std::memory_order_relaxed), 1)) return Action::kNone;
  return hit_armed(site, call);
}

// Replace the rules (empty: disarm) and reset the call counters.
void arm(std::vector<Rule> rules);
// Calls counted at each site since the last arm().
std::vector<std::uint64_t> counts();
const char* site_name(Site site);

}  // namespace faults
}  // namespace kvcached

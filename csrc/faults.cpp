#include "faults.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <mutex>
#include <thread>

namespace kvcached {
namespace faults {

std::atomic<bool> g_armed{false};

namespace {
std::mutex g_mu;  // guards g_rules against a concurrent arm()
std::vector<Rule> g_rules;
std::atomic<std::uint64_t> g_counts[kNumSites];
}  // namespace

const char* site_name(Site site) {
  switch (site) {
    case Site::kMap:
      return "map";
    case Site::kCreate:
      return "create";
    case Site::kIpc:
      return "ipc";
  }
  return "?";
}

Action hit_armed(Site site, std::uint64_t* call) {
  const std::uint64_t n = g_counts[static_cast<int>(site)].fetch_add(1) + 1;
  if (call) *call = n;
  Action action = Action::kNone;
  double seconds = 0;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    for (const Rule& r : g_rules) {
      if (r.site == site && r.first <= n && n <= r.last) {
        action = r.action;
        seconds = r.seconds;
        break;
      }
    }
  }
  switch (action) {
    case Action::kStall:
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      return Action::kNone;
    case Action::kKill:
      ::kill(::getpid(), SIGKILL);
      for (;;) ::pause();
    default:
      return action;
  }
}

void arm(std::vector<Rule> rules) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_armed.store(false);
  g_rules = std::move(rules);
  for (auto& c : g_counts) c.store(0);
  g_armed.store(!g_rules.empty());
}

std::vector<std::uint64_t> counts() {
  std::vector<std::uint64_t> out;
  for (auto& c : g_counts) out.push_back(c.load());
  return out;
}

}  // namespace faults
}  // namespace kvcached

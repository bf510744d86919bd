// Build: g++ -O2 -shared -fPIC -o /tmp/libgloo_status_race.so tools/gloo_status_race.cpp -ldl
// Use:   LD_PRELOAD=/tmp/libgloo_status_race.so python tools/stress_groups.py --mode serial ...
// (docs/reliability.md, "Seen again").
// Race amplifier (LD_PRELOAD): interposes c10d::opTypeToString, which ProcessGroupGloo::runLoop
// calls right after a collective has completed and just before it writes
// pgStatus_->lastCompletedWorkName without a lock. A gloo worker thread that gets there waits
// (spinning, up to RACE_WAIT_US) for a second worker thread to get there too, then both go on
// at once. It changes timing only, never values.
#include <dlfcn.h>
#include <pthread.h>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

namespace c10d {
enum class OpType : std::uint8_t;
std::string opTypeToString(OpType);
}  // namespace c10d

using Fn = std::string (*)(c10d::OpType);
static std::atomic<int> arrivals{0};
static std::atomic<unsigned> released{0};
static std::atomic<unsigned long> meetings{0};

static bool in_gloo_worker() {
  char name[16] = {0};
  pthread_getname_np(pthread_self(), name, sizeof name);
  return std::strncmp(name, "pt_gloo_runloop", 15) == 0;
}

std::string c10d::opTypeToString(c10d::OpType t) {
  // torch's libraries are loaded RTLD_LOCAL: RTLD_NEXT does not see them; ask the library itself.
  static Fn real = reinterpret_cast<Fn>(
      dlsym(dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD), "_ZN4c10d14opTypeToStringB5cxx11ENS_6OpTypeE"));
  static long wait_us = std::getenv("RACE_WAIT_US") ? std::atol(std::getenv("RACE_WAIT_US")) : 1000;
  std::string s = real(t);
  if (!in_gloo_worker()) return s;
  unsigned gen = released.load();
  if (arrivals.fetch_add(1) == 0) {
    auto t0 = std::chrono::steady_clock::now();
    while (released.load() == gen &&
           std::chrono::steady_clock::now() - t0 < std::chrono::microseconds(wait_us)) {
    }
    if (released.load() == gen) {
      int one = 1;
      if (arrivals.compare_exchange_strong(one, 0)) return s;  // nobody came
      while (released.load() == gen) {
      }
    }
  } else {
    arrivals.store(0);
    released.fetch_add(1);
    meetings.fetch_add(1);
    volatile int spin = std::rand() % 64;  // the two threads line up now and then
    while (spin > 0) spin = spin - 1;
  }
  return s;
}

extern "C" unsigned long race_meetings() { return meetings.load(); }

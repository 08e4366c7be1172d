// Which CPUs the model thread's OpenMP threads may run on. Python can set the calling thread's
// affinity (os.sched_setaffinity(0, ...)) but cannot reach the pool's other threads: this op runs
// one parallel region in the calling thread's pool (torch's libgomp, native.py) and each thread
// sets its own.
//
// torch.ops.tengyun.set_openmp_worker_affinity(threads, cpus, pin) -> where
//   threads: the team size, torch.get_num_threads() of the calling thread (the pool it runs steps
//   with); pin: thread i (i >= 1) runs on cpus[i] only (cpus has at least threads entries); else
//   each thread i >= 1 may run on any of cpus. Thread 0, the caller, is left as it is: the caller
//   pins and releases it around each step (platforms/cpu/runtime/thread_binding.py).
//   where[i]: the CPU thread i runs on after the call (sched_getcpu; pinning migrates the thread
//   before sched_setaffinity returns), -1 for thread 0.
//   Errors: not Linux; a team smaller than threads (called inside a parallel region); a CPU the
//   process may not use (EINVAL), naming it.

#include <c10/util/ArrayRef.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#if defined(__linux__)
#include <omp.h>
#include <sched.h>
#endif

namespace tengyun {
namespace {

std::vector<int64_t> set_openmp_worker_affinity(int64_t threads, c10::IntArrayRef cpus, bool pin) {
#if defined(__linux__)
  TORCH_CHECK(threads >= 1, "set_openmp_worker_affinity: threads must be at least 1, got ", threads);
  TORCH_CHECK(!cpus.empty(), "set_openmp_worker_affinity: cpus is empty");
  for (const int64_t cpu : cpus) {
    TORCH_CHECK(cpu >= 0 && cpu < CPU_SETSIZE, "set_openmp_worker_affinity: CPU ", cpu, " is outside 0..",
                CPU_SETSIZE - 1);
  }
  TORCH_CHECK(!pin || static_cast<int64_t>(cpus.size()) >= threads, "set_openmp_worker_affinity: ", cpus.size(),
              " CPUs to pin ", threads, " threads to");
  std::vector<int64_t> where(threads, -1);
  std::vector<int64_t> failed(threads, -1);  // the CPU (pinned) or -2 (spread) a thread could not take
  int team = 0;
#pragma omp parallel num_threads(static_cast<int>(threads))
  {
    const int i = omp_get_thread_num();
#pragma omp single
    team = omp_get_num_threads();
    if (i > 0 && i < threads) {
      cpu_set_t set;
      CPU_ZERO(&set);
      if (pin) {
        CPU_SET(cpus[i], &set);
      } else {
        for (const int64_t cpu : cpus) CPU_SET(cpu, &set);
      }
      if (sched_setaffinity(0, sizeof(set), &set) != 0) failed[i] = pin ? cpus[i] : -2;
      where[i] = sched_getcpu();
    }
  }
  TORCH_CHECK(team == threads, "set_openmp_worker_affinity: the team has ", team, " threads, not ", threads,
              " (called inside a parallel region?)");
  for (int64_t i = 1; i < threads; ++i) {
    TORCH_CHECK(failed[i] == -1, "set_openmp_worker_affinity: OpenMP thread ", i, " could not be placed on ",
                failed[i] >= 0 ? "CPU " + std::to_string(failed[i]) : std::string("the given CPUs"),
                " (sched_setaffinity refused: a CPU this process may not use?)");
  }
  return where;
#else
  TORCH_CHECK(false, "set_openmp_worker_affinity: thread affinity is set on Linux only");
#endif
}

}  // namespace
}  // namespace tengyun

TORCH_LIBRARY_FRAGMENT(tengyun, m) {
  m.def("set_openmp_worker_affinity(int threads, int[] cpus, bool pin) -> int[]", &tengyun::set_openmp_worker_affinity);
}

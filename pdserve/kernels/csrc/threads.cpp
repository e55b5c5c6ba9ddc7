// Where torch's OpenMP threads run. A prefill worker that borrows an idle decode worker's
// cores (pdserve/serve/core_share.py) grows its team and must put the new threads on the borrowed
// cores, its own thread on its own: left to the scheduler, two of them share a core for a
// while after each change, and the prefill loses what it borrowed.
#include "cpu_ops.h"
#include <omp.h>
#include <sched.h>

// Thread i of the team of cores.size() threads (torch's team once set_num_threads(that))
// runs on cores[i] only; thread 0 is the caller. libgomp keeps a pool thread's index from
// team to team of one size, so the pinning holds for every later parallel region.
void pin_openmp_threads(std::vector<int64_t> cores) {
  TORCH_CHECK(!cores.empty(), "no cores");
  for (int64_t core : cores) TORCH_CHECK(core >= 0 && core < CPU_SETSIZE, "core ", core);
  const int num_threads = static_cast<int>(cores.size());
  int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(+ : failed)
  {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cores[omp_get_thread_num()], &set);
    failed += sched_setaffinity(0, sizeof(set), &set) != 0;
  }
  TORCH_CHECK(failed == 0, failed, " thread(s) could not be moved (a core outside the "
              "process's cpuset?)");
}

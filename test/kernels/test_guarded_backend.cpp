// The guarded backend (KEEL_GUARD_BACKEND_MEMORY): ops work as on the CPU reference, and host
// code that touches backend memory between ops dies at once with a message naming it.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

#include "kernels/guarded_backend.h"

using namespace keel;

TEST_CASE("guarded backend: ops and copies work, the host touching its memory faults with a message",
          "[guard]") {
  auto be = make_guarded_backend(make_cpu_backend());
  CHECK(be->device() == Device::CPU);
  CHECK_THAT(be->name(), Catch::Contains("guarded"));
  void* p = be->allocate(1000 * sizeof(float));
  Tensor t(p, DType::F32, {1000}, Device::CPU);
  be->fill(t, 2.0f);
  be->scale(t, 1.5f);
  std::vector<float> back(1000, 0.0f);
  be->copy_to_host(back.data(), t);
  CHECK(back[0] == 3.0f);
  CHECK(back[999] == 3.0f);
  CHECK(be->sum(t) == 3000.0);

  // A child process reads the memory directly, as host code holding a device pointer would.
  int err_pipe[2];
  REQUIRE(pipe(err_pipe) == 0);
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    dup2(err_pipe[1], 2);
    volatile float x = static_cast<float*>(p)[10];
    (void)x;
    _exit(0);  // not reached when the guard works
  }
  close(err_pipe[1]);
  std::string err;
  char buf[512];
  for (ssize_t n; (n = read(err_pipe[0], buf, sizeof buf)) > 0;) err.append(buf, static_cast<size_t>(n));
  close(err_pipe[0]);
  int status = 0;
  waitpid(child, &status, 0);
  INFO(err);
  REQUIRE(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGSEGV);
  CHECK_THAT(err, Catch::Contains("host code touched backend memory outside a backend op") &&
                      Catch::Contains("byte 40 of a " + std::to_string(sysconf(_SC_PAGESIZE)) + "-byte allocation"));
  be->release(p);
}

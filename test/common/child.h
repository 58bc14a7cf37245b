// Running a piece of a test in a forked child: for code that ends the process (a signal handler
// that exits, a watchdog that aborts), whose exit code and stderr the test then checks.
#pragma once

#include <catch2/catch.hpp>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <functional>
#include <string>

namespace keel::test {

struct ChildResult {
  int exit_code = -1;       // the child's exit status, or -1 when a signal ended it
  std::string stderr_text;  // what it wrote to stderr
  double seconds = 0;       // from the fork to the child's end
};

// Runs body() in a forked child with stderr captured; the child exits 0 if body returns.
inline ChildResult run_child(const std::function<void()>& body) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const auto t0 = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(fds[0]);
    ::dup2(fds[1], STDERR_FILENO);
    body();
    _exit(0);
  }
  ::close(fds[1]);
  ChildResult r;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) r.stderr_text.append(buf, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  return r;
}

}  // namespace keel::test

// Running the real keel binary from tests: capture its output and exit code, or start it in
// the background and kill it (crash-safety tests).
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace keel::test {

struct ProcessResult {
  int code = -1;       // exit status, or -signal when killed
  std::string output;  // stdout and stderr together
};

// Runs a shell command line, stdout and stderr together.
inline ProcessResult run_shell(const std::string& cmd) {
  ProcessResult r;
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof buf, p)) > 0) r.output.append(buf, n);
  const int status = pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : (WIFSIGNALED(status) ? -WTERMSIG(status) : -1);
  return r;
}

// Runs `keel <args>` through the shell (args are shell words; env assignments may prefix it via `env`).
inline ProcessResult run_keel(const std::string& args, const std::string& env = "") {
  return run_shell((env.empty() ? "" : "env " + env + " ") + std::string(KEEL_BINARY) + " " + args);
}

#ifdef KEEL_MPIEXEC
// Runs `mpirun -np N keel <args>` (one OpenMP thread per rank: the ranks share the cores).
inline ProcessResult run_keel_mpi(int np, const std::string& args, const std::string& env = "") {
  std::string exports = " -x OMP_NUM_THREADS=1";
  for (size_t start = 0; start < env.size();) {
    const size_t end = env.find(' ', start);
    exports += " -x " + env.substr(start, end - start);
    start = end == std::string::npos ? env.size() : end + 1;
  }
  return run_shell(std::string(KEEL_MPIEXEC) + " -np " + std::to_string(np) + exports + " " + KEEL_BINARY + " " + args);
}
#endif

// Starts `keel <argv...>` in the background with stdout/stderr to `log`; returns its pid.
inline pid_t spawn_keel(const std::vector<std::string>& argv, const std::string& log) {
  pid_t pid = fork();
  if (pid == 0) {
    FILE* f = std::fopen(log.c_str(), "a");
    if (f) {
      dup2(fileno(f), 1);
      dup2(fileno(f), 2);
    }
    std::vector<char*> args;
    std::string bin = KEEL_BINARY;
    args.push_back(bin.data());
    std::vector<std::string> copy = argv;
    for (auto& a : copy) args.push_back(a.data());
    args.push_back(nullptr);
    execv(bin.c_str(), args.data());
    _exit(127);
  }
  return pid;
}

// Waits for pid; returns its exit code, or -signal.
inline int wait_for(pid_t pid) {
  int status = 0;
  waitpid(pid, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : (WIFSIGNALED(status) ? -WTERMSIG(status) : -1);
}

}  // namespace keel::test

#include "launch/launch.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <thread>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

namespace vlmgraph::launch {
namespace {

const char* Get(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? v : nullptr;
}

int64_t IntVar(const char* name, const char* value, int64_t min) {
  try {
    size_t used = 0;
    const int64_t v = std::stoll(value, &used);
    if (used == std::strlen(value) && v >= min) return v;
  } catch (const std::exception&) {
  }
  throw std::invalid_argument(std::string("environment variable ") + name + "='" + value +
                              "': must be an integer >= " + std::to_string(min));
}

volatile sig_atomic_t g_forward_signal = 0;
void OnSignal(int sig) { g_forward_signal = sig; }

}  // namespace

RankEnv RankEnvFromEnvironment() {
  RankEnv env;
  const char* rank = Get("RANK");
  const char* world = Get("WORLD_SIZE");
  const char* local = Get("LOCAL_RANK");
  if (rank == nullptr && world == nullptr && Get("SLURM_PROCID") && Get("SLURM_NTASKS")) {
    env.source = "slurm";
    rank = Get("SLURM_PROCID");
    world = Get("SLURM_NTASKS");
    local = Get("SLURM_LOCALID");
  } else if (rank != nullptr || world != nullptr) {
    env.source = Get("TORCHELASTIC_RUN_ID") ? "torchrun" : "env";
  }
  if ((rank == nullptr) != (world == nullptr)) {
    throw std::invalid_argument(
        "environment: RANK and WORLD_SIZE must be set together (torchrun sets both)");
  }
  if (world != nullptr) {
    env.world_size = IntVar("WORLD_SIZE", world, 1);
    env.rank = IntVar("RANK", rank, 0);
    if (env.rank >= env.world_size) {
      throw std::invalid_argument("environment: RANK=" + std::to_string(env.rank) +
                                  " must be < WORLD_SIZE=" + std::to_string(env.world_size));
    }
    env.local_rank = local ? IntVar("LOCAL_RANK", local, 0) : 0;
  }
  if (const char* a = Get("MASTER_ADDR")) env.master_addr = a;
  if (const char* p = Get("MASTER_PORT")) env.master_port = IntVar("MASTER_PORT", p, 0);
  if (env.world_size > 1 && env.source == "slurm" && !Get("MASTER_ADDR")) {
    throw std::invalid_argument(
        "environment: under srun, export MASTER_ADDR (the first node's host name) and "
        "MASTER_PORT");
  }
  env.store_port = env.master_port;
  const char* agent_store = Get("TORCHELASTIC_USE_AGENT_STORE");
  env.agent_store = agent_store != nullptr && std::string(agent_store) == "True";
  if (const char* attempt = Get("TORCHELASTIC_RESTART_COUNT"))
    env.group_name += "/attempt_" + std::string(attempt);
  return env;
}

int LaunchLocalRanks(const std::vector<std::string>& argv, int64_t nproc, double grace_seconds) {
  if (nproc < 1) throw std::invalid_argument("--nproc-per-node: must be >= 1");
  const std::string master_addr = Get("MASTER_ADDR") ? Get("MASTER_ADDR") : "127.0.0.1";
  // The store, served here as torchrun's agent serves it: on the kernel's choice of port unless
  // MASTER_PORT names one, so that no other process can take the port between choosing and
  // binding it. It outlives every rank, so a rank that dies takes nothing of the others' with it.
  c10d::TCPStoreOptions so;
  so.port =
      Get("MASTER_PORT") ? static_cast<uint16_t>(IntVar("MASTER_PORT", Get("MASTER_PORT"), 0)) : 0;
  so.isServer = true;
  so.waitWorkers = false;
  so.numWorkers = static_cast<int>(nproc) + 1;
  std::unique_ptr<c10d::TCPStore> store;
  try {
    store = std::make_unique<c10d::TCPStore>(master_addr, so);
  } catch (const std::exception& e) {
    std::cerr << "vlmgraph-train: launcher: cannot serve the store on " << master_addr << ":"
              << so.port << ": " << e.what()
              << " (set MASTER_PORT to a free port, or leave it unset for any free port)"
              << std::endl;
    return 1;
  }
  const std::string master_port = std::to_string(store->getPort());
  char exe[4096];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  const std::string program = n > 0 ? std::string(exe, n) : argv.at(0);

  // Every child's arguments and environment are built before the first fork: the store's threads
  // run by then, so a child does nothing but exec.
  std::vector<char*> args;
  args.push_back(const_cast<char*>(program.c_str()));
  for (size_t k = 1; k < argv.size(); ++k) args.push_back(const_cast<char*>(argv[k].c_str()));
  args.push_back(nullptr);
  const char* const set_here[] = {"RANK=",
                                  "LOCAL_RANK=",
                                  "WORLD_SIZE=",
                                  "LOCAL_WORLD_SIZE=",
                                  "MASTER_ADDR=",
                                  "MASTER_PORT=",
                                  "TORCHELASTIC_USE_AGENT_STORE="};
  std::vector<std::string> inherited;
  for (char** e = environ; *e != nullptr; ++e) {
    bool replaced = false;
    for (const char* prefix : set_here)
      replaced |= std::strncmp(*e, prefix, std::strlen(prefix)) == 0;
    if (!replaced) inherited.emplace_back(*e);
  }
  // As torchrun does: with several ranks on one host and OMP_NUM_THREADS unset, each rank gets
  // one OpenMP thread, so N ranks do not each start a thread per core (2 CPU ranks trained 4x
  // slower without it: 99.6 s against 25.1 s).
  if (nproc > 1 && std::getenv("OMP_NUM_THREADS") == nullptr) {
    inherited.emplace_back("OMP_NUM_THREADS=1");
    std::cerr << "vlmgraph-train: launcher: OMP_NUM_THREADS set to 1 for each of the " << nproc
              << " ranks (as torchrun does); export it to choose another value" << std::endl;
  }
  std::vector<std::vector<std::string>> child_env(nproc, inherited);
  std::vector<std::vector<char*>> child_envp(nproc);
  for (int64_t i = 0; i < nproc; ++i) {
    auto& env = child_env[i];
    env.push_back("RANK=" + std::to_string(i));
    env.push_back("LOCAL_RANK=" + std::to_string(i));
    env.push_back("WORLD_SIZE=" + std::to_string(nproc));
    env.push_back("LOCAL_WORLD_SIZE=" + std::to_string(nproc));
    env.push_back("MASTER_ADDR=" + master_addr);
    env.push_back("MASTER_PORT=" + master_port);
    env.push_back("TORCHELASTIC_USE_AGENT_STORE=True");
    for (auto& v : env) child_envp[i].push_back(v.data());
    child_envp[i].push_back(nullptr);
  }

  struct sigaction sa {};
  sa.sa_handler = OnSignal;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  std::vector<pid_t> children;
  for (int64_t i = 0; i < nproc; ++i) {
    const pid_t pid = ::fork();
    if (pid < 0) {
      std::perror("vlmgraph-train: fork");
      for (pid_t c : children) ::kill(c, SIGKILL);
      return 1;
    }
    if (pid == 0) {
      ::execve(program.c_str(), args.data(), child_envp[i].data());
      static const char msg[] = "vlmgraph-train: launcher: exec failed\n";
      (void)!::write(2, msg, sizeof(msg) - 1);
      ::_exit(127);
    }
    children.push_back(pid);
  }

  // Wait for every child; the first failure ends the others (SIGTERM, then SIGKILL).
  int status_out = 0;
  int64_t alive = nproc;
  bool stopping = false;
  auto stop_deadline = std::chrono::steady_clock::time_point::max();
  std::vector<bool> done(children.size(), false);
  auto stop_others = [&](int sig) {
    for (size_t k = 0; k < children.size(); ++k) {
      if (!done[k]) ::kill(children[k], sig);
    }
  };
  while (alive > 0) {
    if (g_forward_signal != 0 && !stopping) {
      stopping = true;
      status_out = 128 + g_forward_signal;
      stop_others(g_forward_signal);
      stop_deadline = std::chrono::steady_clock::now() +
                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                          std::chrono::duration<double>(grace_seconds));
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (size_t k = 0; k < children.size(); ++k) {
        if (children[k] != pid || done[k]) continue;
        done[k] = true;
        --alive;
        const int code = WIFEXITED(status)     ? WEXITSTATUS(status)
                         : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                               : 1;
        if (code != 0 && !stopping) {
          std::cerr << "vlmgraph-train: launcher: rank " << k << " (pid " << pid << ") "
                    << (WIFSIGNALED(status)
                            ? "was killed by signal " + std::to_string(WTERMSIG(status))
                            : "exited with status " + std::to_string(code))
                    << "; stopping the other ranks" << std::endl;
          status_out = code;
          stopping = true;
          stop_others(SIGTERM);
          stop_deadline = std::chrono::steady_clock::now() +
                          std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                              std::chrono::duration<double>(grace_seconds));
        }
      }
      continue;
    }
    if (stopping && std::chrono::steady_clock::now() > stop_deadline) {
      stop_others(SIGKILL);
      stop_deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return status_out;
}

}  // namespace vlmgraph::launch

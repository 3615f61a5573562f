// launch/launch.h: where a process stands in its distributed job (its rank), and the built-in
// launcher that starts N local ranks without torchrun (vlmgraph-train and vlmgraph-train-bench use
// both).
//
// Rank environment (torchrun's, which srun and Kubernetes' PyTorchJob also set or can set):
//   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Under Slurm without those,
//   SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID stand for RANK, WORLD_SIZE and LOCAL_RANK
//   (MASTER_ADDR and MASTER_PORT must still be exported). None set: one rank (rank 0 of 1).
// The store (engine/data_parallel.h's TCPStore) lives on MASTER_ADDR:MASTER_PORT, served by
// rank 0. Under torchrun, whose agent already serves that store
// (TORCHELASTIC_USE_AGENT_STORE=True), every rank joins the agent's store as a client, as
// torch.distributed's env:// init does, and its keys carry TORCHELASTIC_RESTART_COUNT so a
// restarted job does not read the old one's.
//
//   RankEnv env = RankEnvFromEnvironment();
//   int status = LaunchLocalRanks(argv_without_the_flag, 4);  // forks 4 ranks, waits for them
//
// Launcher (as torchrun's local agent): it serves the store itself, on MASTER_PORT or, unset, on
// the kernel's choice of free port (no race with other processes for it), and each child gets
// RANK = LOCAL_RANK = i, WORLD_SIZE = LOCAL_WORLD_SIZE = n, MASTER_ADDR (127.0.0.1 unless set),
// MASTER_PORT = the store's port and TORCHELASTIC_USE_AGENT_STORE=True, and runs this program
// again. When a child exits non-zero or is killed, the others get SIGTERM, then SIGKILL after a
// grace period, and the launcher returns that child's status (128 + signal for a signal). SIGINT
// and SIGTERM to the launcher are passed on to the children. A store that cannot be served
// (MASTER_PORT taken) returns 1 with a message.
//
// Errors: std::invalid_argument naming the variable for a malformed environment.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vlmgraph::launch {

struct RankEnv {
  int64_t rank = 0;
  int64_t world_size = 1;
  int64_t local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int64_t master_port = 29500;
  int64_t store_port = 29500;  // the store's port: MASTER_PORT
  bool agent_store = false;    // torchrun's agent serves the store (see the file comment)
  std::string group_name = "vlmgraph-train";
  std::string source = "single";  // "torchrun", "env", "slurm" or "single"
};

RankEnv RankEnvFromEnvironment();

// Forks `nproc` children running `argv` (argv[0] is the program, resolved through /proc/self/exe)
// with the rank variables set; returns the job's exit status (see the file comment).
int LaunchLocalRanks(const std::vector<std::string>& argv, int64_t nproc,
                     double grace_seconds = 10);

}  // namespace vlmgraph::launch

// engine/engine_internal.h: the Engine's private types and helpers shared by its source files
// (engine.cc: construction, regions, vision and prefill, scoring; continuous_batching.cc: slots,
// KV pages, admission, a sequence's end; decode_step.cc: the decode steps).
// Not part of the engine's interface; include only from engine/*.cc.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <memory>

#include "base/clock.h"
#include "engine/device.h"
#include "engine/engine.h"
#include "engine/logprobs.h"
#include "model/kv_cache.h"

namespace vlmgraph {
namespace engine_internal {

// dec_in's layout: tokens (int64), positions (int64), carry flags (bool), max_batch of each,
// padded to whole int64s so that every row of the host staging (2, bytes) starts aligned.
inline int64_t DecodeInputBytes(int64_t max_batch) {
  return (max_batch * (2 * sizeof(int64_t) + 1) + 7) / 8 * 8;
}

struct DecodeInputs {
  at::Tensor tokens, positions, carry;
};

// Views of one dec_in-shaped byte vector (device or host).
inline DecodeInputs DecodeInputViews(const at::Tensor& bytes, int64_t max_batch) {
  const int64_t n = max_batch * static_cast<int64_t>(sizeof(int64_t));
  return {bytes.narrow(0, 0, n).view(at::kLong), bytes.narrow(0, n, n).view(at::kLong),
          bytes.narrow(0, 2 * n, max_batch).view(at::kBool)};
}

}  // namespace engine_internal

struct Engine::Sequence {
  SequenceId id = -1;
  int64_t slot = -1;
  int64_t length = 0;  // tokens in the KV cache; the next token's position
  int64_t generated = 0;
  int64_t last_token = -1;  // fed to the next decode step
  // Decode steps queued with this sequence whose tokens it has not been given yet (0 or 1
  // between Step() calls): its next step feeds position length + queued.
  int64_t queued = 0;
  SamplingParams sampling;
  LogprobsParams logprobs;
  // Its KV pages, in position order: page_table[slot, j] = pages[j] (Note [KV pages per
  // sequence], engine.h).
  std::vector<int32_t> pages;
};

// Static device buffers shared by every bucket's region function. Each bucket reads a prefix
// view of them, so addresses stay fixed across replays (what a CUDA graph needs).
struct Engine::Buffers {
  at::Tensor ids;         // (max_batch * max_seq) int64, prefill prompts, row-major (b, s) prefix
  at::Tensor slots;       // (max_batch) int64, KV cache row written by each prefill row
  at::Tensor last;        // (max_batch) int64, index of each prefill row's last real token
  at::Tensor tiles;       // (max_tiles, 3, S, S) model dtype, vision input
  at::Tensor image_rows;  // (max_batch * max_seq, H) model dtype, image embeddings for prefill
  // Decode inputs, one host-to-device copy per step: dec_in (DecodeInputBytes(max_batch)) uint8
  // holds the three views below (see DecodeInputs).
  at::Tensor dec_in;
  at::Tensor dec_tokens;      // (max_batch) int64, token fed to each decode row ...
  at::Tensor dec_carry_flag;  // (max_batch) bool, ... unless set: then dec_carry's is fed
  at::Tensor dec_pos;         // (max_batch) int64, position of that token
  // (max_batch) int64, each row's token from the last decode step queued: its region writes
  // the greedy tokens here (and the engine the sampled rows' after it), the next step reads the
  // rows flagged in dec_carry_flag. Engine-owned, not a region output: those are valid only until
  // the runner's next run (Note [Graph memory pool], engine/step_runner.h).
  at::Tensor dec_carry;
  // Host staging of decode steps (pinned when the device is CUDA, so the copies are truly
  // asynchronous), two halves used by alternate steps, since a step is staged while the one
  // before it is still queued: dec_in's contents, and each row's token read back.
  at::Tensor host_dec_in;                    // (2, DecodeInputBytes(max_batch)) uint8
  at::Tensor host_dec_tokens;                // (2, max_batch) int64
  std::unique_ptr<DeviceEvent> dec_done[2];  // recorded after each half's token copy
  // Paged: max_batch + 1 page-table rows, one per slot and a scratch row (padding rows,
  // Forward) whose entries stay 0, the scratch page; a free slot's row is all 0 too.
  KVCache cache;
  int64_t scratch_row = 0;
};

// A decode step queued on the device whose tokens the host has not read yet.
struct Engine::QueuedStep {
  std::vector<std::pair<SequenceId, int64_t>> rows;  // (sequence, KV cache row) of each fed row
  BucketKey key;  // its bucket, or the exact shape of an eager fallback
  RunKind kind = RunKind::kEager;
  int half = 0;       // host staging half (Buffers::host_dec_in, host_dec_tokens, dec_done)
  Clock::time_point queued_at;
  // The rows that asked for logprobs (Note [Logprobs off the graph], engine/logprobs.h): their KV
  // cache rows, and their logprobs copied towards the host before dec_done[half] was recorded.
  std::vector<int64_t> logprob_slots;
  LogprobRows logprobs;  // host, one row per logprob_slots entry
};

}  // namespace vlmgraph

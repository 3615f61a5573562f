// The Train RPC of VlmGraphService (server/grpc/service.h): one training job per stream, its steps
// and saves run on the engines' GPU threads by TrainBackends on the engines' Trainers
// (server/train/graphed_trainer.h): graphed buckets for bucket policy PAD, exact shapes for EXACT.
// A server with several engines trains on every one of them, as data-parallel ranks of one job
// (server/train/train_ranks.h, Note [In-process ranks]).
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <thread>

#include "base/log.h"
#include "base/safetensors.h"
#include "model/checkpoint.h"
#include "server/core/status.h"
#include "server/core/tokenizer_files.h"
#include "server/grpc/convert.h"
#include "server/grpc/service.h"
#include "server/train/checkpoint_dir.h"
#include "server/train/checkpoint_quota.h"
#include "server/train/graphed_trainer.h"
#include "server/train/train_ranks.h"
#include "server/train/weights_publisher.h"

namespace vlmgraph::server {
namespace {

// Note [Hyperparameter ranges]: every number of a TrainConfig is checked against a documented
// range (proto/vlmgraph/v1/train.proto) before the job starts, INVALID_ARGUMENT naming the field,
// the range and the value. The ranges hold every setting that trains a model and refuse those
// that can only destroy it: an AdamW update moves each weight by about the learning rate, so a
// rate above 1 (or a decay factor 1 - lr * weight_decay below 0) overshoots any weight a model
// has. The learning rates' range is LearningRates::kMaxLearningRate (ToLearningRates). The publish
// gate (server/train/publish_gate.h) still checks what a job publishes.
constexpr double kMaxWeightDecay = 1.0;
constexpr double kMinEps = 1e-12, kMaxEps = 1.0;
constexpr double kMaxGradNorm = 1e6;
constexpr int64_t kMaxConsecutiveSkippedSteps = 1000;

std::string NumberText(double v) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", v);
  return text;
}

// The field's value (or `fallback` when unset) when it lies in [min, max] (max excluded when
// `open_max`); INVALID_ARGUMENT "config.<field>: must lie in [min, max], got v" otherwise.
double InRange(bool has, double value, double fallback, double min, double max, const char* field,
               bool open_max = false) {
  const double v = has ? value : fallback;
  if (!(v >= min && (open_max ? v < max : v <= max))) {
    throw InvalidArgument(std::string("config.") + field + ": must lie in [" + NumberText(min) +
                          ", " + NumberText(max) + (open_max ? ")" : "]") + ", got " +
                          NumberText(v));
  }
  return v;
}

// The flag that model part `part` (config.<field>[i]) sets: vision, projector or language;
// projector == nullptr where the projector is not a valid choice. INVALID_ARGUMENT otherwise.
bool* PartFlag(int part, const char* field, int i, bool* vision, bool* projector, bool* language) {
  switch (part) {
    case v1::MODEL_PART_VISION:
      return vision;
    case v1::MODEL_PART_LANGUAGE:
      return language;
    case v1::MODEL_PART_PROJECTOR:
      if (projector != nullptr) return projector;
      break;
    default:
      break;
  }
  throw InvalidArgument(std::string("config.") + field + "[" + std::to_string(i) + "]: must be " +
                        (projector != nullptr
                             ? "MODEL_PART_VISION, MODEL_PART_PROJECTOR or MODEL_PART_LANGUAGE"
                             : "MODEL_PART_VISION or MODEL_PART_LANGUAGE"));
}

TrainJobOptions ToTrainJobOptions(const v1::TrainConfig& c) {
  if (c.optimizer() != v1::OPTIMIZER_UNSPECIFIED && c.optimizer() != v1::OPTIMIZER_ADAMW) {
    throw InvalidArgument("config.optimizer: only OPTIMIZER_ADAMW is supported");
  }
  // Open proto3 enums carry any number a client sends: each value is checked, none defaults.
  if (c.bucket_policy() != v1::TRAIN_BUCKET_POLICY_UNSPECIFIED &&
      c.bucket_policy() != v1::TRAIN_BUCKET_POLICY_PAD &&
      c.bucket_policy() != v1::TRAIN_BUCKET_POLICY_EXACT) {
    throw InvalidArgument(
        "config.bucket_policy: must be TRAIN_BUCKET_POLICY_PAD or "
        "TRAIN_BUCKET_POLICY_EXACT, got " +
        std::to_string(c.bucket_policy()));
  }
  TrainJobOptions job;
  vlmgraph::TrainOptions& o = job.trainer;
  o.learning_rates = ToLearningRates(c);  // with trainable_parts
  o.weight_decay = InRange(c.has_weight_decay(), c.weight_decay(), o.weight_decay, 0,
                           kMaxWeightDecay, "weight_decay");
  o.beta1 = InRange(c.has_beta1(), c.beta1(), o.beta1, 0, 1, "beta1", /*open_max=*/true);
  o.beta2 = InRange(c.has_beta2(), c.beta2(), o.beta2, 0, 1, "beta2", /*open_max=*/true);
  o.eps = InRange(c.has_eps(), c.eps(), o.eps, kMinEps, kMaxEps, "eps");
  o.max_grad_norm = InRange(c.has_max_grad_norm(), c.max_grad_norm(), o.max_grad_norm, 0,
                            kMaxGradNorm, "max_grad_norm");
  if (c.has_max_tiles_per_example()) {
    if (c.max_tiles_per_example() < 1) {
      throw InvalidArgument("config.max_tiles_per_example: must be >= 1, got " +
                            std::to_string(c.max_tiles_per_example()));
    }
    o.max_tiles_per_example = c.max_tiles_per_example();
  }
  o.exact_shapes = c.bucket_policy() == v1::TRAIN_BUCKET_POLICY_EXACT;
  for (int i = 0; i < c.recompute_parts_size(); ++i) {
    *PartFlag(c.recompute_parts(i), "recompute_parts", i, &o.recompute_vision, nullptr,
              &o.recompute_language) = true;
  }
  return job;
}

// What the Train RPC itself does with a job (the trainer never sees these).
struct JobPolicy {
  bool publish_on_end = false;
  int64_t max_consecutive_skipped_steps = 5;
  int64_t save_every_steps = 0;
  std::optional<CheckpointDir> save_directory;  // none = no autosave
};

JobPolicy ToJobPolicy(const v1::TrainConfig& c, const std::string& checkpoint_root) {
  JobPolicy p;
  p.publish_on_end = c.publish_on_end();
  if (c.has_max_consecutive_skipped_steps()) {
    if (c.max_consecutive_skipped_steps() < 1 ||
        c.max_consecutive_skipped_steps() > kMaxConsecutiveSkippedSteps) {
      throw InvalidArgument("config.max_consecutive_skipped_steps: must lie in [1, " +
                            std::to_string(kMaxConsecutiveSkippedSteps) + "], got " +
                            std::to_string(c.max_consecutive_skipped_steps()));
    }
    p.max_consecutive_skipped_steps = c.max_consecutive_skipped_steps();
  }
  if (c.save_every_steps() < 0) {
    throw InvalidArgument("config.save_every_steps: must be >= 0, got " +
                          std::to_string(c.save_every_steps()));
  }
  p.save_every_steps = c.save_every_steps();
  if (p.save_every_steps > 0 && c.save_directory().empty())
    throw InvalidArgument("config.save_directory: required when save_every_steps is set");
  if (!c.save_directory().empty()) {
    p.save_directory =
        OpenCheckpointDir(checkpoint_root, c.save_directory(), "config.save_directory");
  }
  return p;
}

// The rate a step took, as TrainStepResult.learning_rate reports it: the language model's, else
// (language frozen) the projector's, else the vision encoder's.
double LanguageLearningRate(const TrainStepResult& r) {
  const LearningRates& l = r.learning_rates;
  return l.language > 0 ? l.language : l.projector > 0 ? l.projector : l.vision;
}

// Ends a Train stream that waits longer than `timeout` for its client's next message: a watchdog
// thread calls `on_fire` (which marks the job slot ending, server/train/train_slot.h) and then
// cancels the call (grpc::ServerContext::TryCancel, which makes the blocked Read return false and
// tells the client at once). Time spent on the GPU thread does not count: only Wait() .. Got()
// does.
class IdleWatchdog {
 public:
  IdleWatchdog(grpc::ServerContext* context, double timeout_seconds, std::function<void()> on_fire)
      : context_(context),
        on_fire_(std::move(on_fire)),
        timeout_(std::chrono::duration_cast<Clock::duration>(
            std::chrono::duration<double>(timeout_seconds))) {
    if (timeout_seconds > 0) thread_ = std::thread([this] { Run(); });
  }
  ~IdleWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }
  void Wait() {  // about to block on the client
    std::lock_guard<std::mutex> lock(mu_);
    waiting_since_ = Clock::now();
    waiting_ = true;
    cv_.notify_all();
  }
  void Got() {
    std::lock_guard<std::mutex> lock(mu_);
    waiting_ = false;
  }
  bool fired() const { return fired_.load(); }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (!stop_) {
      if (!waiting_) {
        cv_.wait(lock);
        continue;
      }
      const auto deadline = waiting_since_ + timeout_;
      if (Clock::now() >= deadline) {
        fired_ = true;
        on_fire_();  // before the client can learn that the job ended
        context_->TryCancel();
        return;
      }
      cv_.wait_until(lock, deadline);
    }
  }

  grpc::ServerContext* context_;
  const std::function<void()> on_fire_;
  const Clock::duration timeout_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, waiting_ = false;
  Clock::time_point waiting_since_;
  std::atomic<bool> fired_{false};
  std::thread thread_;
};

// A save that the file system refused (no space, no permission, a name too long for it): the
// server's state, not a bug, so never INTERNAL.
ServerError SaveFailed(const CheckpointDir& dir, std::string what) {
  // Errors name the files by the path they were written through (/proc/self/fd/N/...).
  const std::string io = dir.io_path();
  for (size_t at = what.find(io); at != std::string::npos; at = what.find(io, at + dir.path.size()))
    what.replace(at, io.size(), dir.path);
  return ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                     "save.directory: cannot write the checkpoint to " + dir.path + ": " + what);
}

v1::StepMode ToProto(RunKind kind) {
  switch (kind) {
    case RunKind::kEager:
      return v1::STEP_MODE_EAGER;
    case RunKind::kReplay:
      return v1::STEP_MODE_GRAPH_REPLAY;
    case RunKind::kCaptureAndReplay:
      return v1::STEP_MODE_GRAPH_CAPTURE;
  }
  return v1::STEP_MODE_UNSPECIFIED;
}

}  // namespace

grpc::Status VlmGraphService::Train(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::TrainResponse, v1::TrainRequest>* stream) {
  const auto accepted = Clock::now();
  return RpcGuard("Train", Scope::kTrain, context, accepted, [&] { RunTrain(context, stream); });
}

void VlmGraphService::RunTrain(
    grpc::ServerContext* context,
    grpc::ServerReaderWriter<v1::TrainResponse, v1::TrainRequest>* stream) {
  // A job that is ending still holds the slot until it is destroyed (below, in reverse order):
  // Acquire waits for it (server/train/train_slot.h).
  train_slot_.Acquire([context] { return context->IsCancelled(); });
  struct Release {
    TrainSlot* slot;
    ~Release() { slot->Release(); }
  } release{&train_slot_};

  const double idle_seconds = config_.train.idle_timeout_seconds;
  IdleWatchdog watchdog(context, idle_seconds, [this] { train_slot_.MarkEnding(); });
  auto idle_error = [&] {
    char text[160];
    std::snprintf(text, sizeof(text),
                  "no TrainRequest for %g s (train.idle_timeout_seconds): the job ended",
                  idle_seconds);
    return ServerError(grpc::StatusCode::DEADLINE_EXCEEDED, text);
  };
  v1::TrainRequest message;
  watchdog.Wait();
  if (!stream->Read(&message)) {
    if (watchdog.fired()) throw idle_error();
    if (context->IsCancelled())
      throw ServerError(grpc::StatusCode::CANCELLED, "cancelled by the client");
    throw InvalidArgument(
        "the stream ended before its first message; send TrainRequest{config} first");
  }
  watchdog.Got();
  if (!message.has_config())
    throw InvalidArgument("the first message must be TrainRequest{config}");
  TrainJobOptions options = ToTrainJobOptions(message.config());
  const JobPolicy policy = ToJobPolicy(message.config(), config_.train.checkpoint_dir);
  // Training and saving need the train scope (RpcGuard); changing what every client is served
  // needs the publish scope too.
  if (policy.publish_on_end) Authorize(context, Scope::kPublish, "Train with publish_on_end");
  // Held open while the job loads from it (Note [Checkpoint directories]).
  CheckpointDir resume;
  if (!message.config().resume_from().empty()) {
    resume = OpenCheckpointDir(config_.train.checkpoint_dir, message.config().resume_from(),
                               "config.resume_from", /*create=*/false);
    options.resume_from = resume.io_path();
  }

  // The job lives on the GPU threads: one rank per serving engine, each created, stepped and
  // destroyed on its engine's GPU thread (server/train/train_ranks.h, Note [In-process ranks]).
  // Note [A job allocates late]: the ranks (a float32 copy of the weights, the AdamW state, the
  // graphs: 3.4 GB for nanovlm-460m per engine) are made by the first request that needs them: a
  // batch once ToTrainBatch accepted it, a save or a publish. A stream whose first batch is
  // refused, or that sends only its config, allocates nothing.
  std::unique_ptr<TrainRanks> job;
  int64_t saved_at_step = 0;
  auto ensure_job = [&]() -> TrainRanks& {
    if (job) return *job;
    job = std::make_unique<TrainRanks>(*router_, options, metrics_,
                                       config_.train.data_parallel_timeout_seconds);
    saved_at_step = job->steps();  // a resumed job starts saved
    LogInfo("Train job started by " + context->peer() +
            (resume.path.empty()
                 ? ""
                 : " from " + resume.path + " at step " + std::to_string(job->steps())));
    return *job;
  };

  // Saves run on the GPU thread; file-system refusals are the server's state, not a bug.
  auto save = [&](const CheckpointDir& dir, Clock::time_point received,
                  Scheduler::Admission admission) {
    int64_t steps = 0;
    const int64_t quota = config_.train.checkpoint_quota_bytes;
    const CheckpointUsage usage = quota > 0
                                      ? MeasureCheckpointUsage(config_.train.checkpoint_dir, dir)
                                      : CheckpointUsage{};  // the walk here, not on a GPU thread
    ensure_job().GatherOptimizerState("Train", received, admission);
    // The tokenizer files the server was started with go beside the weights, so the directory
    // serves chat as it is (server/core/tokenizer_files.h).
    const std::string tokenizer_json = text_ ? text_->tokenizer_path() : "";
    ensure_job().OnFirstRank(
        "Train",
        [&](TrainBackend& rank) {
          CheckCheckpointQuota(config_.train.checkpoint_dir, usage,
                               rank.checkpoint_bytes() + TokenizerFilesBytes(tokenizer_json),
                               quota);
          try {
            rank.Save(dir.io_path());  // Note [Checkpoint directories]: the opened directory
            CopyTokenizerFiles(tokenizer_json, dir.io_path());
          } catch (const std::system_error& e) {  // std::filesystem_error included
            throw SaveFailed(dir, e.what());
          } catch (const CheckpointError& e) {
            throw SaveFailed(dir, e.what());
          } catch (const SafetensorsError& e) {
            throw SaveFailed(dir, e.what());
          }
          steps = rank.steps();
        },
        received, admission);
    return steps;
  };
  // Publishes run on the GPU threads, through the publish gate: each rank's weights into its own
  // engine (server/train/weights_publisher.h, Note [Publishing on several engines]).
  auto publish = [&](Clock::time_point received, v1::WeightsPublished* out) {
    if (publisher_ == nullptr) {
      throw ServerError(grpc::StatusCode::FAILED_PRECONDITION,
                        "this server cannot publish weights (no publisher is set up)");
    }
    ensure_job().GatherOptimizerState("Train", received, Scheduler::Admission::kInFlight);
    const PublishReport report = publisher_->Publish(ensure_job().Weights(), "Train", received);
    const int64_t steps = job->steps();
    out->set_step(steps);
    out->set_seconds(SecondsSince(received));
    if (report.gated) {
      v1::PublishGateResult* g = out->mutable_gate();
      g->set_served_loss(report.served.loss);
      g->set_published_loss(report.candidate.loss);
      g->set_prompts(report.candidate.prompts);
      g->set_loss_tokens(report.candidate.loss_tokens);
    }
    out->set_max_abs_weight(report.max_abs_weight);
    return steps;
  };
  // Note [Durable training]: with autosave on, a job that ends for any reason (client gone, idle
  // timeout, ABORTED, shutdown) after unsaved steps saves once more, so a client loses at most the
  // step in flight; the job resumes with TrainConfig.resume_from.
  auto final_autosave = [&] {
    if (!policy.save_directory || !job || job->steps() == saved_at_step) return;
    try {
      save(*policy.save_directory, Clock::now(), Scheduler::Admission::kCleanup);
      LogInfo("Train job autosaved " + policy.save_directory->path + " at step " +
              std::to_string(job->steps()) + " as it ended");
    } catch (const std::exception& e) {
      LogWarn("Train job could not autosave " + policy.save_directory->path +
              " as it ended: " + LogSafe(e.what(), 512));
    }
  };
  struct AutosaveOnExit {
    std::function<void()> fn;
    bool armed = true;
    ~AutosaveOnExit() {
      if (armed) fn();
    }
  } autosave_on_exit{final_autosave};

  int64_t consecutive_skips = 0;
  for (;;) {
    watchdog.Wait();
    if (!stream->Read(&message)) {
      // The stream ended (closed, cancelled by the client or the watchdog): what is left (a
      // publish_on_end, the final autosave, destroying the job) runs while a new job waits.
      train_slot_.MarkEnding();
      break;
    }
    watchdog.Got();
    const auto received = Clock::now();
    v1::TrainResponse response;
    bool autosave_now = false;
    switch (message.kind_case()) {
      case v1::TrainRequest::kBatch: {
        std::vector<TrainExample> batch =
            ToTrainBatch(message.batch(), engine_->model_config(), config_.limits,
                         engine_->max_context(), text_);
        {
          // The tiles' conversion here, on the handler's thread, not on a GPU thread's step
          // (Note [Staged tiles] in engine/trainer.h).
          const EngineOptions& eo = engine_->options();
          for (TrainExample& e : batch) StageTrainExample(e, eo.device, TrainComputeDtype(eo));
        }
        // Each rank's shard in pieces, one micro-batch per piece: the GPU threads decode between
        // them (Note [Interleaving bound] in server/core/scheduler.h).
        double queue_seconds = 0;
        const TrainStepResult stats =
            ensure_job().Step(std::move(batch), received, &queue_seconds);
        const double learning_rate = LanguageLearningRate(stats);
        metrics_->ObserveTrainStep(stats.target_tokens, stats.loss, learning_rate, stats.skipped);
        consecutive_skips = stats.skipped ? consecutive_skips + 1 : 0;
        v1::TrainStepResult* r = response.mutable_step();
        r->set_step(stats.step);
        r->set_loss(stats.loss);
        r->set_loss_tokens(stats.target_tokens);
        r->set_grad_norm(stats.grad_norm);
        r->set_learning_rate(learning_rate);
        r->set_step_seconds(stats.seconds);
        r->set_queue_seconds(queue_seconds);
        r->set_bucket(stats.buckets.front().Label());
        r->set_mode(ToProto(stats.kind));
        r->set_skipped(stats.skipped);
        r->set_consecutive_skipped_steps(consecutive_skips);
        autosave_now = policy.save_every_steps > 0 && stats.step % policy.save_every_steps == 0;
        break;
      }
      case v1::TrainRequest::kSave: {
        const CheckpointDir dir =
            OpenCheckpointDir(config_.train.checkpoint_dir, message.save().directory());
        const int64_t steps = save(dir, received, Scheduler::Admission::kInFlight);
        if (policy.save_directory && dir.path == policy.save_directory->path) saved_at_step = steps;
        v1::CheckpointSaved* s = response.mutable_saved();
        s->set_directory(dir.path);
        s->set_step(steps);
        s->set_seconds(SecondsSince(received));
        LogInfo("Train job saved a checkpoint to " + dir.path + " after " + std::to_string(steps) +
                " steps");
        break;
      }
      case v1::TrainRequest::kPublish: {
        Authorize(context, Scope::kPublish, "Train publish");
        const int64_t steps = publish(received, response.mutable_published());
        LogInfo("Train job published its weights after " + std::to_string(steps) + " steps");
        break;
      }
      case v1::TrainRequest::kConfig:
        throw InvalidArgument("config may only be sent once, as the first message");
      default:
        throw InvalidArgument("empty TrainRequest; set batch, save or publish");
    }
    if (!stream->Write(response))
      throw ServerError(grpc::StatusCode::CANCELLED, "client went away mid-stream");
    if (autosave_now) {
      v1::TrainResponse saved;
      v1::CheckpointSaved* s = saved.mutable_saved();
      const auto t0 = Clock::now();
      s->set_step(save(*policy.save_directory, t0, Scheduler::Admission::kInFlight));
      s->set_directory(policy.save_directory->path);
      s->set_seconds(SecondsSince(t0));
      s->set_automatic(true);
      saved_at_step = s->step();
      if (!stream->Write(saved))
        throw ServerError(grpc::StatusCode::CANCELLED, "client went away mid-stream");
    }
    if (consecutive_skips >= policy.max_consecutive_skipped_steps) {
      throw ServerError(grpc::StatusCode::ABORTED,
                        std::to_string(consecutive_skips) +
                            " steps in a row had NaN or infinite gradients and were skipped "
                            "(config.max_consecutive_skipped_steps); the served weights are "
                            "unchanged. Lower the learning rates or weight decay, or check the "
                            "data, and start a new job");
    }
  }
  if (watchdog.fired()) throw idle_error();
  if (context->IsCancelled())
    throw ServerError(grpc::StatusCode::CANCELLED, "cancelled by the client");
  if (policy.publish_on_end) {
    // Answered like a publish request, so the client sees what was published (and the gate's
    // losses) before the stream closes OK.
    v1::TrainResponse response;
    publish(Clock::now(), response.mutable_published());
    LogInfo("Train job published its weights as it ended");
    if (!stream->Write(response))
      throw ServerError(grpc::StatusCode::CANCELLED, "client went away mid-stream");
  }
  LogInfo("Train job ended after " + std::to_string(job ? job->steps() : 0) + " steps");
}

}  // namespace vlmgraph::server

#include "engine/bucket.h"

#include <algorithm>
#include <iterator>
#include <stdexcept>
#include <tuple>

namespace vlmgraph {

const char* RegionName(Region r) {
  switch (r) {
    case Region::kVision:
      return "vision";
    case Region::kPrefill:
      return "prefill";
    case Region::kDecode:
      return "decode";
    case Region::kTrain:
      return "train";
  }
  return "unknown";
}

std::string BucketKey::Label() const {
  switch (region) {
    case Region::kVision:
      return "t" + std::to_string(tiles);
    case Region::kDecode:
      return "b" + std::to_string(batch) + "xc" + std::to_string(seq);
    case Region::kPrefill:
    case Region::kTrain:
      return "b" + std::to_string(batch) + "xs" + std::to_string(seq);
  }
  return "?";
}

bool BucketKey::operator<(const BucketKey& o) const {
  return std::tie(region, batch, seq, tiles) < std::tie(o.region, o.batch, o.seq, o.tiles);
}
bool BucketKey::operator==(const BucketKey& o) const {
  return std::tie(region, batch, seq, tiles) == std::tie(o.region, o.batch, o.seq, o.tiles);
}

namespace {
void Normalise(std::vector<int64_t>* list, const char* name, bool may_be_empty = false) {
  if (list->empty() && !may_be_empty)
    throw std::invalid_argument(std::string("buckets.") + name + " must not be empty");
  for (int64_t v : *list) {
    if (v < 1) {
      throw std::invalid_argument(std::string("buckets.") + name + " has " + std::to_string(v) +
                                  "; every bucket must be >= 1");
    }
  }
  std::sort(list->begin(), list->end());
  list->erase(std::unique(list->begin(), list->end()), list->end());
}
}  // namespace

void BucketSpec::Validate() {
  Normalise(&batch_sizes, "batch_sizes", /*may_be_empty=*/true);
  Normalise(&seq_lens, "seq_lens");
  Normalise(&context_lens, "context_lens");
  Normalise(&tile_counts, "tile_counts");
  Normalise(&train_batch_sizes, "train_batch_sizes");
  Normalise(&train_seq_lens, "train_seq_lens");
  if (max_seq() > max_context()) {
    throw std::invalid_argument(
        "buckets.seq_lens max (" + std::to_string(max_seq()) +
        ") exceeds buckets.context_lens max (" + std::to_string(max_context()) +
        "): a prompt must fit the KV cache; raise context_lens or lower seq_lens");
  }
  if (!(gpu_memory_utilization > 0 && gpu_memory_utilization <= 1)) {
    throw std::invalid_argument("buckets.gpu_memory_utilization must lie in (0, 1], got " +
                                std::to_string(gpu_memory_utilization));
  }
  if (max_decode_batch < 1) {
    throw std::invalid_argument("buckets.max_decode_batch must be >= 1, got " +
                                std::to_string(max_decode_batch));
  }
  if (max_prefill_batch < 1) {
    throw std::invalid_argument("buckets.max_prefill_batch must be >= 1, got " +
                                std::to_string(max_prefill_batch));
  }
  if (!batch_sizes.empty() && batch_sizes.front() > max_prefill_batch) {
    throw std::invalid_argument("buckets.max_prefill_batch (" + std::to_string(max_prefill_batch) +
                                ") is below every buckets.batch_sizes entry (smallest " +
                                std::to_string(batch_sizes.front()) +
                                "): no prefill bucket; raise max_prefill_batch");
  }
}

std::vector<int64_t> BucketSpec::prefill_batch_sizes() const {
  std::vector<int64_t> out;
  for (int64_t b : batch_sizes) {
    if (b <= max_prefill_batch) out.push_back(b);
  }
  return out;
}

int64_t BucketSpec::max_prefill() const {
  auto it = std::upper_bound(batch_sizes.begin(), batch_sizes.end(), max_prefill_batch);
  return it == batch_sizes.begin() ? 0 : *std::prev(it);
}

std::optional<int64_t> BucketSpec::Smallest(const std::vector<int64_t>& list, int64_t n) {
  auto it = std::lower_bound(list.begin(), list.end(), n);
  if (it == list.end()) return std::nullopt;
  return *it;
}

std::optional<BucketKey> BucketSpec::PickPrefill(int64_t batch, int64_t seq) const {
  auto b = Smallest(batch_sizes, batch);
  auto s = Smallest(seq_lens, seq);
  if (!b || !s || *b > max_prefill_batch) return std::nullopt;
  return BucketKey{Region::kPrefill, *b, *s, 0};
}

std::optional<BucketKey> BucketSpec::PickDecode(int64_t batch, int64_t context) const {
  auto b = Smallest(batch_sizes, batch);
  auto c = Smallest(context_lens, context);
  if (!b || !c) return std::nullopt;
  return BucketKey{Region::kDecode, *b, *c, 0};
}

std::optional<BucketKey> BucketSpec::PickVision(int64_t tiles) const {
  auto t = Smallest(tile_counts, tiles);
  if (!t) return std::nullopt;
  return BucketKey{Region::kVision, 0, 0, *t};
}

std::optional<BucketKey> BucketSpec::PickTrain(int64_t batch, int64_t seq) const {
  auto b = Smallest(train_batch_sizes, batch);
  auto s = Smallest(train_seq_lens, seq);
  if (!b || !s) return std::nullopt;
  return BucketKey{Region::kTrain, *b, *s, 0};
}

std::vector<BucketKey> BucketSpec::All(Region region) const {
  std::vector<BucketKey> out;
  switch (region) {
    case Region::kVision:
      for (int64_t t : tile_counts) out.push_back({region, 0, 0, t});
      break;
    case Region::kPrefill:
      for (int64_t b : prefill_batch_sizes())
        for (int64_t s : seq_lens) out.push_back({region, b, s, 0});
      break;
    case Region::kDecode:
      for (int64_t b : batch_sizes)
        for (int64_t c : context_lens) out.push_back({region, b, c, 0});
      break;
    case Region::kTrain:
      for (int64_t b : train_batch_sizes)
        for (int64_t s : train_seq_lens) out.push_back({region, b, s, 0});
      break;
  }
  std::sort(out.begin(), out.end(), [](const BucketKey& a, const BucketKey& b) {
    return std::max<int64_t>(1, a.batch) * std::max<int64_t>(1, a.seq) *
               std::max<int64_t>(1, a.tiles) >
           std::max<int64_t>(1, b.batch) * std::max<int64_t>(1, b.seq) *
               std::max<int64_t>(1, b.tiles);
  });
  return out;
}

}  // namespace vlmgraph

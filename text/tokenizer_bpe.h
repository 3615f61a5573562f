// text/tokenizer_bpe.h: the BPE model of a byte-level tokenizer.json (text/tokenizer.h): one word
// (the raw bytes of a pre-token) in, token ids out.
//
//   BpeModel bpe(vocab, merges, BpeOptions{});
//   std::vector<int64_t> ids;
//   bpe.Encode(" world", &ids);   // the ids of "Ġworld" (or of its pieces)
//
// Algorithm (tokenizers' models/bpe/model.rs and word.rs): each byte starts as the token of its
// GPT-2 byte-level character; then, repeatedly, the adjacent pair with the lowest merge rank is
// merged (the leftmost one among equal ranks) until no pair has a merge. With ignore_merges a word
// that is itself a vocab entry is emitted as that one token. A byte whose character is not in the
// vocab is dropped, or becomes unk_token when one is set (consecutive ones fused with fuse_unk).
// Words shorter than 256 bytes are cached, as tokenizers does.
//
// Memory: the word cache holds at most kShards x kShardCapacityBytes (8 MiB), whatever the text
// (a full shard is emptied); the per-thread symbol buffer is given back after a word that grew it
// past BpeModel::kMaxKeptSymbols.
//
// Thread rules: immutable after construction except the word cache, which is split into shards
// that each have a mutex; Encode may run on many threads at once.
// Errors: the constructor throws TokenizerError for a merge whose parts or result are not in the
// vocab and for an unk_token that is not in the vocab.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace vlmgraph::tokenizer_detail {

struct BpeOptions {
  bool ignore_merges = false;
  std::optional<std::string> unk_token;
  bool fuse_unk = false;
};

// (left id, right id) -> (rank, merged id), open addressing.
class MergeTable {
 public:
  struct Merge {
    uint32_t rank;
    int32_t id;
  };
  void Reserve(size_t n);
  void Insert(int32_t left, int32_t right, Merge merge);  // a later insert of a pair wins
  const Merge* Find(int32_t left, int32_t right) const {
    const uint64_t key = Key(left, right);
    for (size_t i = Slot(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return &values_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  static uint64_t Key(int32_t l, int32_t r) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(l)) << 32) | static_cast<uint32_t>(r);
  }
  size_t Slot(uint64_t key) const { return (key * 0x9E3779B97F4A7C15ull) >> shift_; }
  std::vector<uint64_t> keys_;
  std::vector<Merge> values_;
  size_t mask_ = 0;
  int shift_ = 64;
  size_t size_ = 0;
};

// Word (bytes) -> ids, in shards with their own mutex; a shard that would hold more than
// kShardCapacityBytes is emptied first.
class WordCache {
 public:
  static constexpr size_t kShards = 32;
  static constexpr size_t kShardCapacityBytes = size_t{256} << 10;
  // What one entry costs besides its ids and bytes (hash node, key, allocation headers).
  static constexpr size_t kEntryOverheadBytes = 64;

  WordCache();
  ~WordCache();
  // Appends the cached ids of `word` to *out; false when absent.
  bool Find(std::string_view word, std::vector<int64_t>* out) const;
  void Insert(std::string_view word, const int32_t* ids, size_t n) const;
  // Bytes the entries hold now, overhead included (at most kShards x kShardCapacityBytes).
  size_t bytes() const;

 private:
  struct Shard;
  std::array<std::unique_ptr<Shard>, kShards> shards_;
};

// Bytes the calling thread's BPE symbol buffer holds now.
size_t BpeScratchBytes();

class BpeModel {
 public:
  // `vocab`: token string (byte-level form, e.g. "Ġthe") -> id; `merges`: pairs of token strings
  // in rank order.
  BpeModel(const std::unordered_map<std::string, int64_t>& vocab,
           const std::vector<std::pair<std::string, std::string>>& merges,
           const BpeOptions& options);

  // Appends the ids of `word` (raw bytes, not byte-level characters) to *ids.
  void Encode(std::string_view word, std::vector<int64_t>* ids) const;

  // Whether byte `b` makes a token when it is alone: its own, or the unknown token (without
  // fuse_unk). A byte that does not is dropped (no unk_token) or fused with its neighbours.
  bool ByteMakesTokens(uint8_t b) const {
    return byte_ids_[b] >= 0 || (unk_id_ >= 0 && !options_.fuse_unk);
  }
  bool fuse_unk() const { return unk_id_ >= 0 && options_.fuse_unk; }
  const WordCache& cache() const { return cache_; }

  static constexpr size_t kMaxKeptSymbols = 16384;  // 64 KiB

 private:
  static constexpr size_t kMaxCachedBytes = 256;  // tokenizers' MAX_LENGTH
  static constexpr size_t kShortWord = 128;       // longer words merge through a heap

  // Initial symbols of `word` (byte tokens, unk handling) into *symbols.
  void InitialSymbols(std::string_view word, std::vector<int32_t>* symbols) const;
  void MergeShort(std::vector<int32_t>* symbols) const;
  void MergeLong(std::vector<int32_t>* symbols) const;

  std::array<int32_t, 256> byte_ids_;                        // -1: not in vocab
  std::unordered_map<std::string, int32_t> words_by_bytes_;  // ignore_merges lookups
  MergeTable merges_;
  BpeOptions options_;
  int32_t unk_id_ = -1;
  WordCache cache_;
};

}  // namespace vlmgraph::tokenizer_detail

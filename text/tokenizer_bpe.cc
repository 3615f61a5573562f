#include "text/tokenizer_bpe.h"

#include <cstring>
#include <functional>
#include <queue>

#include "text/tokenizer_error.h"
#include "text/tokenizer_unicode.h"

namespace vlmgraph::tokenizer_detail {

// ---- MergeTable -------------------------------------------------------------------------------

void MergeTable::Reserve(size_t n) {
  size_t capacity = 16;
  int bits = 4;
  while (capacity < 2 * n) capacity <<= 1, ++bits;
  keys_.assign(capacity, kEmpty);
  values_.assign(capacity, Merge{0, 0});
  mask_ = capacity - 1;
  shift_ = 64 - bits;
  size_ = 0;
}

void MergeTable::Insert(int32_t left, int32_t right, Merge merge) {
  if (2 * (size_ + 1) > keys_.size()) {
    std::vector<uint64_t> old_keys = std::move(keys_);
    std::vector<Merge> old_values = std::move(values_);
    Reserve(size_ + 1);
    for (size_t i = 0; i < old_keys.size(); ++i) {
      if (old_keys[i] != kEmpty) {
        Insert(static_cast<int32_t>(old_keys[i] >> 32), static_cast<int32_t>(old_keys[i]),
               old_values[i]);
      }
    }
  }
  const uint64_t key = Key(left, right);
  size_t i = Slot(key);
  while (keys_[i] != kEmpty && keys_[i] != key) i = (i + 1) & mask_;
  if (keys_[i] == kEmpty) ++size_;
  keys_[i] = key;
  values_[i] = merge;
}

// ---- WordCache --------------------------------------------------------------------------------

namespace {
// ids then word bytes, in one allocation that the map's key points into.
struct CacheEntry {
  std::unique_ptr<char[]> data;
  uint32_t n_ids;
};

size_t EntryBytes(size_t word_bytes, size_t n_ids) {
  return n_ids * sizeof(int32_t) + word_bytes + WordCache::kEntryOverheadBytes;
}

// The symbols of the word being encoded on this thread.
thread_local std::vector<int32_t> tls_symbols;
}  // namespace

size_t BpeScratchBytes() { return tls_symbols.capacity() * sizeof(int32_t); }

struct WordCache::Shard {
  std::mutex mu;
  std::unordered_map<std::string_view, CacheEntry> map;  // guarded by mu
  size_t bytes = 0;                                      // guarded by mu
};

WordCache::WordCache() {
  for (auto& shard : shards_) shard = std::make_unique<Shard>();
}
WordCache::~WordCache() = default;

bool WordCache::Find(std::string_view word, std::vector<int64_t>* out) const {
  const size_t hash = std::hash<std::string_view>()(word);
  Shard& shard = *shards_[(hash >> 7) % kShards];
  std::lock_guard<std::mutex> lock(shard.mu);
  auto it = shard.map.find(word);
  if (it == shard.map.end()) return false;
  const char* data = it->second.data.get();
  for (uint32_t i = 0; i < it->second.n_ids; ++i) {
    int32_t id;
    std::memcpy(&id, data + i * sizeof(int32_t), sizeof(int32_t));
    out->push_back(id);
  }
  return true;
}

void WordCache::Insert(std::string_view word, const int32_t* ids, size_t n) const {
  CacheEntry entry;
  entry.n_ids = static_cast<uint32_t>(n);
  entry.data.reset(new char[n * sizeof(int32_t) + word.size()]);
  std::memcpy(entry.data.get(), ids, n * sizeof(int32_t));
  char* key = entry.data.get() + n * sizeof(int32_t);
  std::memcpy(key, word.data(), word.size());
  const std::string_view key_view(key, word.size());
  const size_t hash = std::hash<std::string_view>()(word);
  Shard& shard = *shards_[(hash >> 7) % kShards];
  const size_t bytes = EntryBytes(word.size(), n);
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.bytes + bytes > kShardCapacityBytes) {
    std::unordered_map<std::string_view, CacheEntry>().swap(shard.map);  // the buckets too
    shard.bytes = 0;
  }
  if (shard.map.emplace(key_view, std::move(entry)).second) shard.bytes += bytes;
}

size_t WordCache::bytes() const {
  size_t total = 0;
  for (const auto& shard : shards_) {
    std::lock_guard<std::mutex> lock(shard->mu);
    total += shard->bytes;
  }
  return total;
}

// ---- BpeModel ---------------------------------------------------------------------------------

BpeModel::BpeModel(const std::unordered_map<std::string, int64_t>& vocab,
                   const std::vector<std::pair<std::string, std::string>>& merges,
                   const BpeOptions& options)
    : options_(options) {
  const auto& chars = ByteLevelChars();
  for (int b = 0; b < 256; ++b) {
    auto it = vocab.find(chars[b]);
    byte_ids_[b] = it == vocab.end() ? -1 : static_cast<int32_t>(it->second);
  }
  if (options_.ignore_merges) {
    // Entries made only of byte-level characters, keyed by the bytes they stand for.
    for (const auto& [token, id] : vocab) {
      std::string bytes;
      bool ok = true;
      for (size_t i = 0; i < token.size() && ok;) {
        size_t len;
        const int b = ByteLevelByte(DecodeUtf8(token, i, &len));
        ok = b >= 0;
        bytes.push_back(static_cast<char>(b));
        i += len;
      }
      if (ok) words_by_bytes_.emplace(std::move(bytes), static_cast<int32_t>(id));
    }
  }
  if (options_.unk_token) {
    auto it = vocab.find(*options_.unk_token);
    if (it == vocab.end()) {
      throw TokenizerError("model.unk_token \"" + *options_.unk_token + "\" is not in the vocab");
    }
    unk_id_ = static_cast<int32_t>(it->second);
  }
  merges_.Reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [left, right] = merges[rank];
    auto l = vocab.find(left), r = vocab.find(right), m = vocab.find(left + right);
    const char* missing = l == vocab.end()   ? "left part"
                          : r == vocab.end() ? "right part"
                                             : nullptr;
    if (!missing && m == vocab.end()) missing = "merged token";
    if (missing) {
      throw TokenizerError("model.merges[" + std::to_string(rank) + "] \"" + left + " " + right +
                           "\": the " + missing + " is not in the vocab");
    }
    merges_.Insert(static_cast<int32_t>(l->second), static_cast<int32_t>(r->second),
                   {static_cast<uint32_t>(rank), static_cast<int32_t>(m->second)});
  }
}

void BpeModel::InitialSymbols(std::string_view word, std::vector<int32_t>* symbols) const {
  symbols->clear();
  bool pending_unk = false;
  for (char c : word) {
    const int32_t id = byte_ids_[static_cast<uint8_t>(c)];
    if (id >= 0) {
      if (pending_unk) symbols->push_back(unk_id_), pending_unk = false;
      symbols->push_back(id);
    } else if (unk_id_ >= 0) {
      if (pending_unk && !options_.fuse_unk) symbols->push_back(unk_id_);
      pending_unk = true;
    }
  }
  if (pending_unk) symbols->push_back(unk_id_);
}

void BpeModel::MergeShort(std::vector<int32_t>* symbols) const {
  constexpr uint32_t kNone = ~0u;
  int32_t* s = symbols->data();
  size_t n = symbols->size();
  MergeTable::Merge pairs[kShortWord];  // pairs[i]: merge of (s[i], s[i + 1])
  auto lookup = [&](size_t i) {
    const MergeTable::Merge* m = merges_.Find(s[i], s[i + 1]);
    pairs[i] = m ? *m : MergeTable::Merge{kNone, 0};
  };
  for (size_t i = 0; i + 1 < n; ++i) lookup(i);
  while (n > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < n; ++i) {
      if (pairs[i].rank < pairs[best].rank) best = i;
    }
    if (pairs[best].rank == kNone) break;
    s[best] = pairs[best].id;
    for (size_t i = best + 1; i + 1 < n; ++i) s[i] = s[i + 1], pairs[i] = pairs[i + 1];
    --n;
    if (best > 0) lookup(best - 1);
    if (best + 1 < n) lookup(best);
  }
  symbols->resize(n);
}

void BpeModel::MergeLong(std::vector<int32_t>* symbols) const {
  // tokenizers' Word::merge_all: a heap of (rank, position) over a linked list of symbols.
  struct Symbol {
    int32_t id;
    int32_t prev, next;  // -1: none
    bool alive;
  };
  struct Candidate {
    uint32_t rank;
    int32_t pos;
    int32_t id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  const auto n = static_cast<int32_t>(symbols->size());
  std::vector<Symbol> sym(n);
  for (int32_t i = 0; i < n; ++i) sym[i] = {(*symbols)[i], i - 1, i + 1 < n ? i + 1 : -1, true};
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto push = [&](int32_t pos) {
    const int32_t next = sym[pos].next;
    if (next < 0) return;
    if (const MergeTable::Merge* m = merges_.Find(sym[pos].id, sym[next].id)) {
      queue.push({m->rank, pos, m->id});
    }
  };
  for (int32_t i = 0; i + 1 < n; ++i) push(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = sym[top.pos];
    if (!left.alive || left.next < 0) continue;
    const MergeTable::Merge* m = merges_.Find(left.id, sym[left.next].id);
    if (m == nullptr || m->id != top.id) continue;  // stale entry
    Symbol& right = sym[left.next];
    left.id = top.id;
    right.alive = false;
    left.next = right.next;
    if (right.next >= 0) sym[right.next].prev = top.pos;
    if (left.prev >= 0) push(left.prev);
    push(top.pos);
  }
  symbols->clear();
  for (int32_t i = 0; i < n; ++i) {
    if (sym[i].alive) symbols->push_back(sym[i].id);
  }
}

void BpeModel::Encode(std::string_view word, std::vector<int64_t>* ids) const {
  if (word.empty()) return;
  std::vector<int32_t>& symbols = tls_symbols;
  struct Trim {  // a long word's buffer is not kept
    std::vector<int32_t>& v;
    ~Trim() {
      if (v.capacity() > kMaxKeptSymbols) std::vector<int32_t>().swap(v);
    }
  } trim{symbols};
  if (word.size() == 1) {  // one byte: its token (merges need two)
    InitialSymbols(word, &symbols);
    for (int32_t id : symbols) ids->push_back(id);
    return;
  }
  // The cache holds final results, with ignore_merges applied.
  const bool cacheable = word.size() < kMaxCachedBytes;
  if (cacheable && cache_.Find(word, ids)) return;
  auto whole =
      options_.ignore_merges ? words_by_bytes_.find(std::string(word)) : words_by_bytes_.end();
  if (whole != words_by_bytes_.end()) {
    symbols.assign(1, whole->second);
  } else {
    InitialSymbols(word, &symbols);
    if (symbols.size() <= kShortWord) {
      MergeShort(&symbols);
    } else {
      MergeLong(&symbols);
    }
  }
  for (int32_t id : symbols) ids->push_back(id);
  if (cacheable) cache_.Insert(word, symbols.data(), symbols.size());
}

}  // namespace vlmgraph::tokenizer_detail

#include "server/core/text_stream.h"

#include <algorithm>

namespace vlmgraph::server {

TextStream::TextStream(const Tokenizer* tokenizer, std::vector<std::string> stop_strings)
    : decode_(*tokenizer, /*skip_special_tokens=*/true) {
  for (std::string& s : stop_strings) {
    if (!s.empty()) stop_strings_.push_back(std::move(s));
  }
}

std::string TextStream::Emit(size_t n) {
  std::string out = pending_.substr(0, n);
  pending_.erase(0, n);
  emitted_ += out;
  return out;
}

TextStream::Delta TextStream::Push(int64_t token_id) {
  Delta d;
  if (stopped_) {
    d.stopped = true;
    return d;
  }
  const size_t before = pending_.size();
  pending_ += decode_.Step(token_id);
  if (stop_strings_.empty()) {
    d.text = Emit(pending_.size());
    return d;
  }
  // The earliest stop string that the new text completes. Only matches ending in the new text
  // are new: earlier text held no match (it would have stopped), so search from where a stop
  // string ending in the new text could begin.
  size_t cut = std::string::npos;
  for (const std::string& s : stop_strings_) {
    const size_t from = before >= s.size() - 1 ? before - (s.size() - 1) : 0;
    const size_t at = pending_.find(s, from);
    if (at != std::string::npos) cut = std::min(cut, at);
  }
  if (cut != std::string::npos) {
    d.text = Emit(cut);
    pending_.clear();
    stopped_ = true;
    d.stopped = true;
    return d;
  }
  // Hold back the longest tail of the text that a stop string starts with.
  size_t hold = 0;
  for (const std::string& s : stop_strings_) {
    for (size_t n = std::min(s.size() - 1, pending_.size()); n > hold; --n) {
      if (pending_.compare(pending_.size() - n, n, s, 0, n) == 0) {
        hold = n;
        break;
      }
    }
  }
  d.text = Emit(pending_.size() - hold);
  return d;
}

std::string TextStream::Finish() {
  if (stopped_) return {};
  pending_ += decode_.Flush();
  return Emit(pending_.size());
}

}  // namespace vlmgraph::server

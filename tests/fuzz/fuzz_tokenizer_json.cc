// Fuzz target: loading tokenizer.json (text/tokenizer.h: Tokenizer::FromJson), then encoding and
// decoding a few texts with what loaded. Input: the file's text. Expected error: TokenizerError.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "text/tokenizer.h"
#include "tests/fuzz/fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace vlmgraph;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::ExpectOnly<TokenizerError>("tokenizer_json", [&] {
    const Tokenizer tok = Tokenizer::FromJson(text);
    std::vector<int64_t> all;
    for (const char* s : {"Hello world! 123 <|im_end|>", " the  thin\n\tcaf\xc3\xa9 \xf0\x9f\x98\x80",
                          "<|im_start|>user\nhi<|im_end|>"}) {
      for (bool special : {false, true}) {
        const std::vector<int64_t> ids = tok.Encode(s, special);
        tok.Decode(ids, false);
        tok.Decode(ids, true);
        all.insert(all.end(), ids.begin(), ids.end());
      }
    }
    // Every id of the vocabulary range: its token, and its decoding alone and streamed.
    const int64_t n = std::min<int64_t>(tok.vocab_size(), 4096);
    DecodeStream stream(tok, /*skip_special_tokens=*/false);
    for (int64_t id = 0; id < n; ++id) {
      if (!tok.IdToToken(id)) continue;
      tok.Decode({id});
      tok.IsSpecial(id);
      stream.Step(id);
    }
    stream.Flush();
    for (const AddedToken& t : tok.added_tokens()) tok.TokenToId(t.content);
  });
  return 0;
}

// server/core/tokenizer_files.h: the tokenizer files a checkpoint carries beside its weights, so
// that the directory serves chat and text requests as it is (`vlmgraph-server --model DIR`) and
// trains again (`vlmgraph-train` with `model: DIR`), as transformers' save_pretrained keeps a
// model's tokenizer files beside it.
//
//   for (const TokenizerFile& f : TokenizerFilesBeside(text->tokenizer_path()))
//     WriteFileAtomically(dir + "/" + f.name, ReadFile(f.path));
//   CopyTokenizerFiles(text->tokenizer_path(), dir);   // the same, in one call
//
// The files (TextModel::Load reads exactly these, server/core/text_prompt.h): the tokenizer.json
// the model was loaded with, and beside it, when they exist, tokenizer_config.json (chat template,
// EOS token), chat_template.jinja and generation_config.json (EOS ids). Copied as they are: a
// transformers tokenizer without nanoVLM's image tokens gets them added again on load.
//
// Thread rules: none of its own. Errors: std::system_error naming the file (AtomicFile's, or a
// source that cannot be read).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace vlmgraph::server {

// The names a checkpoint's tokenizer files take, in the order they are written.
inline constexpr const char* kTokenizerFileNames[] = {
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"};

struct TokenizerFile {
  std::string name;    // one of kTokenizerFileNames
  std::string path;    // where it is read from
  int64_t bytes = 0;   // its size
};

// The tokenizer files that exist for `tokenizer_json` (a tokenizer.json path; "" = none: an empty
// list). Regular files only (a symbolic link is followed, as the server follows it on load).
std::vector<TokenizerFile> TokenizerFilesBeside(const std::string& tokenizer_json);

// Bytes of those files (a checkpoint quota's share for them).
int64_t TokenizerFilesBytes(const std::string& tokenizer_json);

// Writes each of them into `dir` under its name (AtomicFile: never through a symbolic link in
// `dir`), skipping a file that is already the destination. Returns the names written.
std::vector<std::string> CopyTokenizerFiles(const std::string& tokenizer_json,
                                            const std::string& dir);

}  // namespace vlmgraph::server

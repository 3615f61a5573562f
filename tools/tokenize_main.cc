// vlmgraph-tokenize: encodes or decodes with a Hugging Face tokenizer.json (text/tokenizer.h),
// one JSON value per line, for scripts and for checking against the Python `tokenizers` package.
//
//   echo '"Hello world"' | vlmgraph-tokenize tokenizer.json            # [19556,905]
//   echo '[19556,905]' | vlmgraph-tokenize tokenizer.json --decode     # "Hello world"
//   vlmgraph-tokenize tokenizer.json --bench --repeat 5 < lines.jsonl  # single-thread speed
//
// Input: one JSON string per line (so a text may hold newlines and CRs), or with --decode one
// JSON array of ids per line. Output: one JSON array of ids (or JSON string) per input line.
// --add-special-tokens applies the post-processor's template; --skip-special-tokens drops special
// tokens when decoding. --bench encodes every input line --repeat times on one thread and prints
// one JSON object: {"bytes", "repeats", "seconds", "bytes_per_second"} (encoding time only).
// Exit status: 0, 1 on a tokenizer error, 2 on bad arguments or input.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "text/tokenizer.h"

namespace {

using json = nlohmann::json;

int Usage() {
  std::cerr << "usage: vlmgraph-tokenize TOKENIZER_JSON [--decode] [--add-special-tokens]\n"
               "                         [--skip-special-tokens] [--bench [--repeat N]]\n"
               "  reads one JSON string (or with --decode one JSON array of ids) per line\n";
  return 2;
}

int Bench(const vlmgraph::Tokenizer& tokenizer, const std::vector<std::string>& texts,
          bool add_special_tokens, int repeats) {
  size_t bytes = 0;
  for (const std::string& t : texts) bytes += t.size();
  size_t tokens = 0;
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < repeats; ++r) {
    for (const std::string& t : texts) tokens += tokenizer.Encode(t, add_special_tokens).size();
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  json out = {{"bytes", bytes},
              {"repeats", repeats},
              {"tokens", tokens / repeats},
              {"seconds", seconds},
              {"bytes_per_second", seconds > 0 ? bytes * repeats / seconds : 0.0}};
  std::cout << out.dump() << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string path;
  bool decode = false, add_special = false, skip_special = false, bench = false;
  int repeats = 3;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--decode") {
      decode = true;
    } else if (arg == "--add-special-tokens") {
      add_special = true;
    } else if (arg == "--skip-special-tokens") {
      skip_special = true;
    } else if (arg == "--bench") {
      bench = true;
    } else if (arg == "--repeat" && i + 1 < argc) {
      repeats = std::atoi(argv[++i]);
      if (repeats < 1) return Usage();
    } else if (arg == "-h" || arg == "--help") {
      Usage();
      return 0;
    } else if (!arg.empty() && arg[0] != '-' && path.empty()) {
      path = arg;
    } else {
      return Usage();
    }
  }
  if (path.empty() || (bench && decode)) return Usage();

  try {
    const vlmgraph::Tokenizer tokenizer = vlmgraph::Tokenizer::FromFile(path);
    std::vector<std::string> texts;
    std::string line;
    for (size_t line_number = 1; std::getline(std::cin, line); ++line_number) {
      json value;
      try {
        value = json::parse(line);
      } catch (const json::exception& e) {
        std::cerr << "vlmgraph-tokenize: stdin line " << line_number << ": " << e.what() << "\n";
        return 2;
      }
      if (decode) {
        if (!value.is_array()) {
          std::cerr << "vlmgraph-tokenize: stdin line " << line_number << ": not an array\n";
          return 2;
        }
        std::vector<int64_t> ids;
        for (const json& id : value) {
          if (!id.is_number_integer()) {
            std::cerr << "vlmgraph-tokenize: stdin line " << line_number << ": not an id\n";
            return 2;
          }
          ids.push_back(id.get<int64_t>());
        }
        std::cout << json(tokenizer.Decode(ids, skip_special)).dump() << "\n";
        continue;
      }
      if (!value.is_string()) {
        std::cerr << "vlmgraph-tokenize: stdin line " << line_number << ": not a string\n";
        return 2;
      }
      if (bench) {
        texts.push_back(value.get<std::string>());
      } else {
        std::cout << json(tokenizer.Encode(value.get<std::string>(), add_special)).dump() << "\n";
      }
    }
    if (bench) return Bench(tokenizer, texts, add_special, repeats);
  } catch (const vlmgraph::TokenizerError& e) {
    std::cerr << "vlmgraph-tokenize: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

// server/openai/http_text.h: text of HTTP heads that the OpenAI-compatible API reads: the
// Content-Type's media type and percent-encoded model names in paths (/v1/models/{model}).
//
//   IsJsonContentType("application/json; charset=utf-8");   // true
//   PercentDecodeModel("org%2Fmodel");                       // "org/model"
//
// Thread rules: pure functions, safe from any thread. Errors: none.
#pragma once

#include <string>

namespace vlmgraph::server::openai {

// Whether the media type of a Content-Type value is application/json; media types compare
// case-insensitively (RFC 9110), parameters are ignored.
bool IsJsonContentType(const std::string& value);

// `text` with each %XX escape (two hexadecimal digits, RFC 3986) replaced by its byte; anything
// else, a malformed escape included, as it is.
std::string PercentDecodeModel(const std::string& text);

}  // namespace vlmgraph::server::openai

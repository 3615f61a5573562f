// DecodeImageUrl of server/openai/requests.h: the bytes of an image's data URL (RFC 2397).
#include <absl/strings/escaping.h>

#include <algorithm>
#include <cctype>
#include <string_view>

#include "server/openai/requests.h"

namespace vlmgraph::server::openai {
namespace {

std::string Lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool StartsWith(const std::string& s, const std::string& prefix) {
  return s.size() >= prefix.size() && s.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

std::string DecodeImageUrl(const std::string& url, const Limits& limits, const std::string& param) {
  const std::string head = Lower(url.substr(0, std::min<size_t>(url.size(), 16)));
  if (StartsWith(head, "http://") || StartsWith(head, "https://")) {
    throw BadRequest(param +
                         ": remote image URLs are not supported; this server fetches nothing. "
                         "Send the image inline as a data URL: data:image/png;base64,<the file "
                         "in base64>",
                     param);
  }
  if (!StartsWith(head, "data:")) {
    throw BadRequest(param + ": must be a data URL, data:image/png;base64,<the file in base64>",
                     param);
  }
  const size_t comma = url.find(',');
  if (comma == std::string::npos)
    throw BadRequest(param + ": malformed data URL: no ',' before the data", param);
  // "image/png;base64": media type, then parameters; base64 must be the last one (RFC 2397).
  const std::string meta = Lower(url.substr(5, comma - 5));
  const std::string media_type = meta.substr(0, meta.find(';'));
  if (!StartsWith(media_type, "image/")) {
    throw BadRequest(param + ": the data URL's media type must be image/png or image/jpeg, got '" +
                         media_type + "'",
                     param);
  }
  if (meta.size() < 7 || meta.compare(meta.size() - 7, 7, ";base64") != 0) {
    throw BadRequest(
        param + ": the data URL must be base64-encoded (data:" + media_type + ";base64,...)",
        param);
  }
  const std::string_view data = std::string_view(url).substr(comma + 1);
  // Refuse before decoding: base64 carries 3 bytes per 4 characters.
  if (static_cast<int64_t>(data.size() / 4) * 3 > limits.max_image_bytes + 3) {
    throw BadRequest(param + ": the image has about " + std::to_string(data.size() / 4 * 3) +
                         " bytes; at most " + std::to_string(limits.max_image_bytes) +
                         " are allowed (limits.max_image_bytes)",
                     param);
  }
  std::string bytes;
  if (!absl::Base64Unescape(absl::string_view(data.data(), data.size()), &bytes))
    throw BadRequest(param + ": the image data is not valid base64", param);
  if (bytes.empty()) throw BadRequest(param + ": the image data is empty", param);
  return bytes;
}

}  // namespace vlmgraph::server::openai

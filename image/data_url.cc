#include "image/data_url.h"

#include <absl/strings/escaping.h>

#include <algorithm>
#include <cctype>
#include <string_view>

#include "image/image_processor.h"

namespace vlmgraph {
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

std::string DecodeImageDataUrl(const std::string& url, int64_t max_bytes,
                               const std::string& limit_name) {
  const std::string head = Lower(url.substr(0, std::min<size_t>(url.size(), 16)));
  if (StartsWith(head, "http://") || StartsWith(head, "https://")) {
    throw ImageError(
        "remote image URLs are not supported; this server fetches nothing. Send the image inline "
        "as a data URL: data:image/png;base64,<the file in base64>");
  }
  if (!StartsWith(head, "data:")) {
    throw ImageError("must be a data URL, data:image/png;base64,<the file in base64>");
  }
  const size_t comma = url.find(',');
  if (comma == std::string::npos) throw ImageError("malformed data URL: no ',' before the data");
  // "image/png;base64": media type, then parameters; base64 must be the last one (RFC 2397).
  const std::string meta = Lower(url.substr(5, comma - 5));
  const std::string media_type = meta.substr(0, meta.find(';'));
  if (!StartsWith(media_type, "image/")) {
    throw ImageError("the data URL's media type must be image/png or image/jpeg, got '" +
                     media_type + "'");
  }
  if (meta.size() < 7 || meta.compare(meta.size() - 7, 7, ";base64") != 0) {
    throw ImageError("the data URL must be base64-encoded (data:" + media_type + ";base64,...)");
  }
  const std::string_view data = std::string_view(url).substr(comma + 1);
  // Refuse before decoding: base64 carries 3 bytes per 4 characters.
  if (static_cast<int64_t>(data.size() / 4) * 3 > max_bytes + 3) {
    throw ImageError("the image has about " + std::to_string(data.size() / 4 * 3) +
                     " bytes; at most " + std::to_string(max_bytes) + " are allowed (" +
                     limit_name + ")");
  }
  std::string bytes;
  if (!absl::Base64Unescape(absl::string_view(data.data(), data.size()), &bytes))
    throw ImageError("the image data is not valid base64");
  if (bytes.empty()) throw ImageError("the image data is empty");
  return bytes;
}

}  // namespace vlmgraph

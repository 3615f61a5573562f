// image/data_url.h: the bytes of an image sent inline as a data URL (RFC 2397),
// `data:image/<type>;base64,<data>`, as the OpenAI API's image_url parts and vlmgraph-train's
// datasets carry them. Base64 through Abseil, which accepts missing padding and skips whitespace.
// Pure function, any thread.
#pragma once

#include <cstdint>
#include <string>

namespace vlmgraph {

// The decoded bytes of `url`. Throws ImageError (image/image_processor.h) with a message that
// says what to send instead, for: a remote (http, https) or other non-data URL, a media type that
// is not image/*, data that is not base64 or is empty, and more than `max_bytes` bytes (checked
// before decoding; the message names the limit as `limit_name`).
std::string DecodeImageDataUrl(const std::string& url, int64_t max_bytes,
                               const std::string& limit_name);

}  // namespace vlmgraph

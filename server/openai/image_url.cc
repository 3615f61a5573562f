// DecodeImageUrl of server/openai/requests.h: image/data_url.h's decoder, its refusals as 400s
// naming the request's field.
#include "image/data_url.h"
#include "image/image_processor.h"
#include "server/openai/requests.h"

namespace vlmgraph::server::openai {

std::string DecodeImageUrl(const std::string& url, const Limits& limits, const std::string& param) {
  try {
    return DecodeImageDataUrl(url, limits.max_image_bytes, "limits.max_image_bytes");
  } catch (const ImageError& e) {
    throw BadRequest(param + ": " + e.what(), param);
  }
}

}  // namespace vlmgraph::server::openai

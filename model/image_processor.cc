#include "model/image_processor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <sstream>
#include <tuple>

// stb_image: only the two formats the API documents, private to this file.
#define STB_IMAGE_STATIC
#define STB_IMAGE_IMPLEMENTATION
#define STBI_ONLY_PNG
#define STBI_ONLY_JPEG
#define STBI_NO_STDIO
#define STBI_NO_HDR
#define STBI_NO_LINEAR
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#endif
#include <stb/stb_image.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

namespace vlmgraph {
namespace {

int64_t RoundUpTo(double x, int64_t multiple) {
  return static_cast<int64_t>(std::ceil(x / static_cast<double>(multiple))) * multiple;
}

uint64_t Be16(const std::string& b, size_t i) {
  return uint64_t{static_cast<unsigned char>(b[i])} << 8 | static_cast<unsigned char>(b[i + 1]);
}

uint64_t Be32(const std::string& b, size_t i) { return Be16(b, i) << 16 | Be16(b, i + 2); }

// Width and height as the header declares them, before anything is decoded: stb_image refuses
// large sizes itself (and its info call then answers "unknown image type"), so the pixel limit
// is checked on these. Each side < 2^32, so width * height fits in 64 bits.
struct DeclaredSize {
  uint64_t width = 0;
  uint64_t height = 0;
};

ImageError Truncated(const std::string& format, size_t size, const std::string& where) {
  return ImageError("corrupt " + format + " image: truncated: the data ends after " +
                    std::to_string(size) + " bytes, " + where);
}

// PNG: the 8-byte signature, then the IHDR chunk: length 13, "IHDR", width, height (PNG
// specification, 5.2 and 11.2.2).
DeclaredSize PngSize(const std::string& b) {
  if (b.size() < 8 + 8 + 8) throw Truncated("png", b.size(), "inside the IHDR header");
  if (b.compare(12, 4, "IHDR") != 0)
    throw ImageError("corrupt png image: the first chunk is not IHDR");
  return {Be32(b, 16), Be32(b, 20)};
}

// Throws unless the chunks (length, type, data, CRC) run whole up to IEND, as stb_image needs
// them to (its reason for a cut file is often empty).
void CheckPngChunks(const std::string& b) {
  for (size_t i = 8;;) {
    if (b.size() - i < 12) throw Truncated("png", b.size(), "before the IEND chunk");
    const uint64_t length = Be32(b, i);
    const std::string type = b.substr(i + 4, 4);
    const bool named = std::all_of(type.begin(), type.end(), [](char c) {
      return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z');
    });
    if (length > b.size() - i - 12) {
      throw Truncated("png", b.size(),
                      "inside the " + (named ? type + " " : std::string()) + "chunk at byte " +
                          std::to_string(i) + " (" + std::to_string(length) + " data bytes)");
    }
    if (type == "IEND") return;
    i += 12 + length;
  }
}

// JPEG: the segments after SOI up to the frame header (SOFn: length, precision, height, width),
// skipping bytes between segments as stb_image does (ITU T.81, B.1.1 and B.2.2).
DeclaredSize JpegSize(const std::string& b) {
  auto byte = [&](size_t i) { return static_cast<unsigned char>(b[i]); };
  for (size_t i = 2;;) {
    while (i < b.size() && byte(i) != 0xff) ++i;
    while (i < b.size() && byte(i) == 0xff) ++i;  // fill bytes
    if (i >= b.size()) throw Truncated("jpeg", b.size(), "before the frame header (SOF)");
    const unsigned marker = byte(i++);
    if (marker == 0x01 || (marker >= 0xd0 && marker <= 0xd8)) continue;  // no length field
    if (marker == 0xd9 || marker == 0xda)
      throw ImageError("corrupt jpeg image: no frame header (SOF) before the image data");
    if (b.size() - i < 2) throw Truncated("jpeg", b.size(), "before the frame header (SOF)");
    const uint64_t length = Be16(b, i);
    if (length < 2) throw ImageError("corrupt jpeg image: bad segment length");
    if (marker >= 0xc0 && marker <= 0xcf && marker != 0xc4 && marker != 0xc8 && marker != 0xcc) {
      if (b.size() - i < 7) throw Truncated("jpeg", b.size(), "inside the frame header (SOF)");
      return {Be16(b, i + 5), Be16(b, i + 3)};
    }
    i += length;
  }
}

// Throws on the two kinds of Huffman table that stb_image 2.27 (Debian bookworm's libstb-dev)
// decodes with out-of-bounds memory accesses (upstream stb_image 2.28 checks the first and bounds
// the symbol index of the second):
//   - a table (DHT) of more than 256 codes: its code counts write past the table's arrays inside
//     the decoder's state;
//   - a scan (SOS) that selects a table no earlier DHT defined: stb_image decodes with the
//     uninitialized table, whose symbol index then reads anywhere.
// A scan uses its DC table (in a progressive JPEG: a first DC scan) and its AC table (in a
// progressive JPEG: an AC scan, spectral start > 0). DHT segments may also follow a scan
// (progressive JPEG), so every segment is checked; entropy-coded data between segments is skipped
// as stb_image skips it (0xff 0x00 is a data byte, 0xff 0xd0..0xd7 a restart marker), and bytes
// past the end read as zeros, as stb_image reads them.
void CheckJpegHuffmanTables(const std::string& b) {
  auto byte = [&](size_t i) { return i < b.size() ? static_cast<unsigned char>(b[i]) : 0u; };
  bool progressive = false;
  bool defined[2][4] = {};  // [DC = 0 / AC = 1][table id]
  for (size_t i = 2; i < b.size();) {
    if (byte(i) != 0xff) {
      ++i;
      continue;
    }
    while (i < b.size() && byte(i) == 0xff) ++i;
    if (i >= b.size()) return;
    const unsigned marker = byte(i++);
    if (marker == 0x00 || marker == 0x01 || (marker >= 0xd0 && marker <= 0xd8)) continue;
    if (marker == 0xd9 || b.size() - i < 2) return;  // end of image, or cut (stb_image refuses it)
    const size_t length = Be16(b, i);
    if (length < 2) return;  // stb_image refuses it
    if (marker == 0xc0 || marker == 0xc1 || marker == 0xc2) progressive = marker == 0xc2;
    if (marker == 0xc4) {
      // Tables as stb_image reads them: class/id byte, 16 code counts, then that many symbols,
      // while the segment has bytes left.
      for (size_t p = i + 2, left = length - 2; left > 0 && p < b.size();) {
        const unsigned table_class = byte(p) >> 4, id = byte(p) & 15;
        size_t codes = 0;
        for (size_t k = p + 1; k <= p + 16; ++k) codes += byte(k);
        if (codes > 256) {
          throw ImageError("corrupt jpeg image: a Huffman table (DHT) has " +
                           std::to_string(codes) + " codes; at most 256 are allowed");
        }
        if (table_class <= 1 && id <= 3) defined[table_class][id] = true;
        if (17 + codes >= left || b.size() - p < 17 + codes) break;
        left -= 17 + codes;
        p += 17 + codes;
      }
    }
    if (marker == 0xda) {
      // Components (id, DC table << 4 | AC table), then spectral start, end, approximation.
      const size_t components = byte(i + 2), tail = i + 3 + 2 * components;
      const unsigned spectral_start = byte(tail), approximation_high = byte(tail + 2) >> 4;
      const bool uses_dc = !progressive || (spectral_start == 0 && approximation_high == 0);
      const bool uses_ac = !progressive || spectral_start > 0;
      for (size_t c = 0; c < components; ++c) {
        const unsigned dc = byte(i + 4 + 2 * c) >> 4, ac = byte(i + 4 + 2 * c) & 15;
        for (const auto& [used, table_class, id] :
             {std::tuple{uses_dc, 0u, dc}, std::tuple{uses_ac, 1u, ac}}) {
          if (used && id <= 3 && !defined[table_class][id]) {
            throw ImageError(std::string("corrupt jpeg image: a scan uses Huffman table ") +
                             (table_class == 0 ? "DC" : "AC") + std::to_string(id) +
                             ", which no DHT segment before it defines");
          }
        }
      }
    }
    i += length;
  }
}

// stb_image's reason for a failed load of a `format` image, never empty: some of its failures set
// none, and a failed JPEG load can leave the reason of the PNG probe before it ("bad png sig").
std::string DecodeFailure(const std::string& format) {
  const char* r = stbi_failure_reason();
  const std::string reason = r != nullptr ? r : "";
  if (reason.empty() || reason == "unknown image type" ||
      (format != "png" && reason.find("png") != std::string::npos)) {
    return "cannot decode its data (truncated or corrupt)";
  }
  return reason;
}

}  // namespace

std::string DetectImageFormat(const std::string& bytes) {
  static const unsigned char kPng[] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  if (bytes.size() >= sizeof(kPng) &&
      std::equal(kPng, kPng + sizeof(kPng), bytes.begin(),
                 [](unsigned char a, char b) { return a == static_cast<unsigned char>(b); })) {
    return "png";
  }
  if (bytes.size() >= 3 && static_cast<unsigned char>(bytes[0]) == 0xff &&
      static_cast<unsigned char>(bytes[1]) == 0xd8 &&
      static_cast<unsigned char>(bytes[2]) == 0xff) {
    return "jpeg";
  }
  return "";
}

at::Tensor DecodeImage(const std::string& bytes, const ImageLimits& limits) {
  if (bytes.empty()) throw ImageError("image is empty (0 bytes); send a PNG or JPEG file");
  if (static_cast<int64_t>(bytes.size()) > limits.max_bytes) {
    throw ImageError("image has " + std::to_string(bytes.size()) + " bytes; at most " +
                     std::to_string(limits.max_bytes) + " are allowed (limits.max_image_bytes)");
  }
  const std::string format = DetectImageFormat(bytes);
  if (format.empty()) {
    throw ImageError(
        "unknown image format (not PNG or JPEG by its first bytes); send a PNG or JPEG file");
  }
  if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    throw ImageError("image is too large to decode");
  }
  const DeclaredSize declared = format == "png" ? PngSize(bytes) : JpegSize(bytes);
  const std::string size_text =
      std::to_string(declared.width) + "x" + std::to_string(declared.height);
  if (declared.width == 0 || declared.height == 0)
    throw ImageError(format + " image has no pixels (" + size_text + ")");
  const uint64_t declared_pixels = declared.width * declared.height;
  if (declared_pixels > static_cast<uint64_t>(std::max<int64_t>(0, limits.max_pixels))) {
    throw ImageError(format + " image is " + size_text + " = " + std::to_string(declared_pixels) +
                     " pixels; at most " + std::to_string(limits.max_pixels) +
                     " are allowed (limits.max_image_pixels)");
  }
  if (format == "png") CheckPngChunks(bytes);
  if (format == "jpeg") CheckJpegHuffmanTables(bytes);
  const auto* data = reinterpret_cast<const stbi_uc*>(bytes.data());
  const int len = static_cast<int>(bytes.size());
  int w = 0, h = 0, comp = 0;
  std::unique_ptr<stbi_uc, void (*)(void*)> pixels(
      stbi_load_from_memory(data, len, &w, &h, &comp, 3), stbi_image_free);
  if (!pixels) {
    const std::string reason = DecodeFailure(format);
    if (reason == "too large") {  // stb_image's own caps: 2^24 a side, 2^30 bytes
      throw ImageError(format + " image of " + size_text +
                       " is too large for the decoder (stb_image: too large)");
    }
    throw ImageError("corrupt " + format + " image: " + reason);
  }
  at::Tensor hwc = at::from_blob(pixels.get(), {h, w, 3}, at::kByte);
  // clone, not contiguous(): a 1-pixel-wide permute is already contiguous and would still view the
  // stb buffer freed on return.
  return hwc.permute({2, 0, 1}).clone(at::MemoryFormat::Contiguous);  // (3, H, W), owns its memory
}

std::pair<int64_t, int64_t> ResizedSize(int64_t height, int64_t width, const VlmConfig& cfg) {
  const int64_t p = cfg.vit_img_size, m = cfg.max_img_size;
  const bool wide = width >= height;
  const int64_t long_side = wide ? width : height, short_side = wide ? height : width;
  const int64_t target_long = cfg.resize_to_max_side_len ? m : std::min(m, RoundUpTo(long_side, p));
  const double scale = static_cast<double>(target_long) / static_cast<double>(long_side);
  const int64_t target_short = std::max(p, RoundUpTo(static_cast<double>(short_side) * scale, p));
  return wide ? std::make_pair(target_short, target_long)
              : std::make_pair(target_long, target_short);
}

ImageTiles TileImage(const at::Tensor& image, const VlmConfig& cfg) {
  if (image.dim() != 3 || image.size(0) != 3 || image.size(1) < 1 || image.size(2) < 1) {
    std::ostringstream o;
    o << "an image must be (3, H, W) RGB, got shape " << image.sizes();
    throw ImageError(o.str());
  }
  const bool is_uint8 = image.scalar_type() == at::kByte;
  const auto [out_h, out_w] = ResizedSize(image.size(1), image.size(2), cfg);
  at::Tensor x = image.to(at::kFloat).unsqueeze(0);  // (1, 3, H, W)
  at::Tensor resized;                                // (1, 3, out_h, out_w) in [0, 1]
  if (is_uint8) {
    // PIL's bicubic resize on 8-bit data (ImagingResample): antialiased Keys kernel (a = -0.5),
    // separable, the horizontal pass first, each pass rounded and clamped to uint8; ToTensor then
    // divides by 255. Rounding between the passes, as PIL does, matches its output to within one
    // level on a handful of pixels (tests/e2e/test_image.py).
    auto to_uint8_levels = [](at::Tensor t) { return t.round_().clamp_(0, 255); };
    at::Tensor wide =
        to_uint8_levels(at::_upsample_bicubic2d_aa(x, {x.size(2), out_w}, /*align_corners=*/false));
    resized = to_uint8_levels(at::_upsample_bicubic2d_aa(wide, {out_h, out_w}, false)).div_(255.0);
  } else {
    resized = at::_upsample_bicubic2d_aa(x, {out_h, out_w}, false).clamp_(0, 1);
  }
  const int64_t s = cfg.vit_img_size;
  ImageTiles out;
  out.grid_rows = out_h / s;
  out.grid_cols = out_w / s;
  // (1, 3, nh*s, nw*s) -> (nh*nw, 3, s, s), row-major over the grid (einops
  // 'b c (nh ph) (nw pw) -> (b nh nw) c ph pw').
  at::Tensor tiles = resized.view({3, out.grid_rows, s, out.grid_cols, s})
                         .permute({1, 3, 0, 2, 4})
                         .reshape({out.grid_rows * out.grid_cols, 3, s, s});
  if (out.grid_rows * out.grid_cols > 1) {
    // torchvision resize(tensor, [s, s]): bilinear, antialias=True, on the float image.
    at::Tensor global =
        at::_upsample_bilinear2d_aa(resized, {s, s}, /*align_corners=*/false).clamp_(0, 1);
    tiles = at::cat({global, tiles}, 0);
    out.has_global = true;
  }
  out.tiles = tiles.contiguous();
  return out;
}

ImageTiles PreprocessEncodedImage(const std::string& bytes, const VlmConfig& cfg,
                                  const ImageLimits& limits) {
  return TileImage(DecodeImage(bytes, limits), cfg);
}

}  // namespace vlmgraph

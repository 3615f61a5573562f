// tests/image_fixtures.h: hand-built image files for the image and request tests: headers that
// declare any size, with no pixel data or with garbage for it.
#pragma once

#include <cstdint>
#include <string>

namespace vlmgraph::testing {

// PNG's CRC-32 (ISO 3309, as zlib's crc32), so hand-built chunks are valid ones.
inline uint32_t Crc32(const std::string& bytes) {
  uint32_t c = 0xffffffffu;
  for (unsigned char b : bytes) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
  }
  return c ^ 0xffffffffu;
}

inline std::string Be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

// One PNG chunk: length, type, data, CRC.
inline std::string PngChunk(const std::string& type, const std::string& data) {
  return Be32(static_cast<uint32_t>(data.size())) + type + data + Be32(Crc32(type + data));
}

// A PNG of the signature and one IHDR chunk declaring `width` x `height` (8-bit RGB): what a
// client that lies about the size sends; no pixel data follows.
inline std::string PngHeader(uint32_t width, uint32_t height) {
  return std::string("\x89PNG\r\n\x1a\n", 8) +
         PngChunk("IHDR", Be32(width) + Be32(height) + std::string("\x08\x02\0\0\0", 5));
}

// A whole PNG file of `width` x `height` 16-bit RGBA (the 6324 x 6324 images) whose IDAT
// chunk is garbage: its header is valid, any decoder fails on its data.
inline std::string PngWithGarbageData(uint32_t width, uint32_t height) {
  return std::string("\x89PNG\r\n\x1a\n", 8) +
         PngChunk("IHDR", Be32(width) + Be32(height) + std::string("\x10\x06\0\0\0", 5)) +
         PngChunk("IDAT", std::string(64, '\x5a')) + PngChunk("IEND", "");
}

}  // namespace vlmgraph::testing

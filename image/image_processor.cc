#include "image/image_processor.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <csetjmp>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <tuple>

// The decoders: C libraries that report errors by longjmp (Note [Decoding with longjmp]).
#include <jerror.h>
#include <jpeglib.h>
#include <png.h>

namespace vlmgraph {
namespace {

int64_t RoundUpTo(double x, int64_t multiple) {
  return static_cast<int64_t>(std::ceil(x / static_cast<double>(multiple))) * multiple;
}

uint64_t Be16(const std::string& b, size_t i) {
  return uint64_t{static_cast<unsigned char>(b[i])} << 8 | static_cast<unsigned char>(b[i + 1]);
}

uint64_t Be32(const std::string& b, size_t i) { return Be16(b, i) << 16 | Be16(b, i + 2); }

// Width and height as the header declares them, read here before a decoder sees the data, so that
// any size over ImageLimits::max_pixels gets the pixel-limit message before anything is allocated.
// Each side < 2^32, so width * height fits in 64 bits.
struct DeclaredSize {
  uint64_t width = 0;
  uint64_t height = 0;
};

ImageError Truncated(const std::string& format, size_t size, const std::string& where) {
  return ImageError("corrupt " + format + " image: truncated: the data ends after " +
                    std::to_string(size) + " bytes, " + where);
}

// Throws unless `size` has pixels and at most limits.max_pixels of them.
void CheckPixels(const std::string& format, DeclaredSize size, const ImageLimits& limits) {
  const std::string size_text = std::to_string(size.width) + "x" + std::to_string(size.height);
  if (size.width == 0 || size.height == 0)
    throw ImageError(format + " image has no pixels (" + size_text + ")");
  const uint64_t pixels = size.width * size.height;
  if (pixels > static_cast<uint64_t>(std::max<int64_t>(0, limits.max_pixels))) {
    throw ImageError(format + " image is " + size_text + " = " + std::to_string(pixels) +
                     " pixels; at most " + std::to_string(limits.max_pixels) +
                     " are allowed (limits.max_image_pixels)");
  }
}

// PNG: the 8-byte signature, then the IHDR chunk: length 13, "IHDR", width, height (PNG
// specification, 5.2 and 11.2.2).
DeclaredSize PngSize(const std::string& b) {
  if (b.size() < 8 + 8 + 8) throw Truncated("png", b.size(), "inside the IHDR header");
  if (b.compare(12, 4, "IHDR") != 0)
    throw ImageError("corrupt png image: the first chunk is not IHDR");
  return {Be32(b, 16), Be32(b, 20)};
}

// Throws unless the chunks (length, type, data, CRC) run whole up to IEND, so that a cut file gets
// a message saying where its data ends (libpng's own reason names only the step that failed).
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
// skipping bytes between segments as libjpeg does (ITU T.81, B.1.1 and B.2.2).
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

// Note [Decoding with longjmp]
// libpng and libjpeg report an error by calling a handler that must not return; ours copy the
// message and longjmp back to the setjmp of the function that called into the library. A longjmp
// runs no destructor of the frames it leaves (undefined behaviour in C++ where one is
// non-trivial), and no C++ exception may unwind through the libraries' C frames. So:
//   - the functions that call setjmp (PngReadHeader, PngReadRows, JpegReadHeader, JpegReadRows)
//     have only trivially destructible locals and, after a longjmp, return false at once;
//   - the handlers (PngOnError, PngRead, JpegOnError, JpegOnMessage, JpegOnProgress) throw
//     nothing and write only into a plain struct (PngSource, JpegState) that the caller owns;
//   - the callers (DecodePng, DecodeJpeg) own the libraries' state through RAII guards and the
//     output tensor, allocated once the header's size is checked, and turn `false` into an
//     ImageError.

// --- PNG: libpng ---------------------------------------------------------------------------------

// The encoded bytes and the error of a libpng read (Note [Decoding with longjmp]).
struct PngSource {
  const unsigned char* data = nullptr;
  size_t size = 0;
  size_t offset = 0;
  bool read_past_end = false;
  char message[256] = {};
};

void PngOnError(png_structp png, png_const_charp message) {
  auto* source = static_cast<PngSource*>(png_get_error_ptr(png));
  std::snprintf(source->message, sizeof(source->message), "%s", message);
  png_longjmp(png, 1);
}

// Warnings (a bad CRC of an ancillary chunk, extra compressed data, ...) are not errors.
void PngOnWarning(png_structp /*png*/, png_const_charp /*message*/) {}

void PngRead(png_structp png, png_bytep out, size_t n) {
  auto* source = static_cast<PngSource*>(png_get_io_ptr(png));
  if (n > source->size - source->offset) {
    source->read_past_end = true;
    png_error(png, "read past the end of the data");
  }
  std::memcpy(out, source->data + source->offset, n);
  source->offset += n;
}

// libpng's read and info structs, freed with this object.
class PngDecoder {
 public:
  explicit PngDecoder(PngSource* source)
      : png_(png_create_read_struct(PNG_LIBPNG_VER_STRING, source, PngOnError, PngOnWarning)),
        info_(png_ != nullptr ? png_create_info_struct(png_) : nullptr) {}
  ~PngDecoder() { png_destroy_read_struct(&png_, &info_, nullptr); }
  PngDecoder(const PngDecoder&) = delete;
  PngDecoder& operator=(const PngDecoder&) = delete;

  png_structp png() const { return png_; }
  png_infop info() const { return info_; }

 private:
  png_structp png_;
  png_infop info_;
};

// The rows libpng delivers once the transforms are set.
struct PngRows {
  png_uint_32 width = 0;
  png_uint_32 height = 0;
  int passes = 1;  // 7 for an Adam7-interlaced image
  int channels = 0;
  int bit_depth = 0;
  size_t row_bytes = 0;
};

// Reads the chunks up to the image data and sets the transforms to 8-bit RGB: 16-bit samples keep
// their high byte, palettes and 1/2/4-bit grey expand, grey replicates, alpha is dropped (not
// composited). Only IHDR, PLTE, IDAT and IEND are read: every other chunk (tRNS, gAMA, iCCP, text,
// unknown) is skipped after its CRC, as Pillow's convert("RGB") ignores them. False on a libpng
// error (Note [Decoding with longjmp]).
bool PngReadHeader(png_structp png, png_infop info, PngSource* source, png_uint_32 max_side,
                   png_alloc_size_t max_chunk_bytes, PngRows* rows) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_read_fn(png, source, PngRead);
  png_set_user_limits(png, max_side, max_side);
  png_set_chunk_malloc_max(png, max_chunk_bytes);
  // Every chunk but IHDR, PLTE, tRNS, IDAT and IEND, then tRNS.
  png_set_keep_unknown_chunks(png, PNG_HANDLE_CHUNK_NEVER, nullptr, -1);
  static const png_byte kTrns[] = "tRNS";
  png_set_keep_unknown_chunks(png, PNG_HANDLE_CHUNK_NEVER, kTrns, 1);
  png_read_info(png, info);
  const int bit_depth = png_get_bit_depth(png, info);
  const int color_type = png_get_color_type(png, info);
  if (bit_depth == 16) png_set_strip_16(png);
  if (color_type == PNG_COLOR_TYPE_PALETTE) png_set_palette_to_rgb(png);
  if (color_type == PNG_COLOR_TYPE_GRAY && bit_depth < 8) png_set_expand_gray_1_2_4_to_8(png);
  if ((color_type & PNG_COLOR_MASK_COLOR) == 0) png_set_gray_to_rgb(png);
  if ((color_type & PNG_COLOR_MASK_ALPHA) != 0) png_set_strip_alpha(png);
  rows->passes = png_set_interlace_handling(png);
  png_read_update_info(png, info);
  rows->width = png_get_image_width(png, info);
  rows->height = png_get_image_height(png, info);
  rows->channels = png_get_channels(png, info);
  rows->bit_depth = png_get_bit_depth(png, info);
  rows->row_bytes = png_get_rowbytes(png, info);
  return true;
}

// Reads every row into `pixels` (each pass of an interlaced image fills in its pixels of the same
// rows), then the chunks after the image data up to IEND. False on a libpng error.
bool PngReadRows(png_structp png, const PngRows& rows, uint8_t* pixels) {
  if (setjmp(png_jmpbuf(png))) return false;
  for (int pass = 0; pass < rows.passes; ++pass) {
    for (png_uint_32 y = 0; y < rows.height; ++y) {
      png_read_row(png, pixels + size_t{y} * rows.row_bytes, nullptr);
    }
  }
  png_read_end(png, nullptr);
  return true;
}

ImageError PngFailure(const PngSource& source) {
  if (source.read_past_end) return Truncated("png", source.size, "inside the image data");
  return ImageError(std::string("corrupt png image: ") + source.message);
}

// (H, W, 3) uint8 RGB.
at::Tensor DecodePng(const std::string& bytes, const ImageLimits& limits) {
  PngSource source;
  source.data = reinterpret_cast<const unsigned char*>(bytes.data());
  source.size = bytes.size();
  PngDecoder decoder(&source);
  if (decoder.png() == nullptr || decoder.info() == nullptr)
    throw ImageError("png image: libpng could not allocate its decoder");
  // libpng's own caps, consistent with the limits checked before: no side longer than
  // max_pixels, no chunk buffer larger than the encoded image may be.
  const auto max_side =
      static_cast<png_uint_32>(std::clamp<int64_t>(limits.max_pixels, 1, int64_t{PNG_UINT_31_MAX}));
  const auto max_chunk_bytes =
      static_cast<png_alloc_size_t>(std::max<int64_t>(1, limits.max_bytes));
  PngRows rows;
  if (!PngReadHeader(decoder.png(), decoder.info(), &source, max_side, max_chunk_bytes, &rows))
    throw PngFailure(source);
  CheckPixels("png", {rows.width, rows.height}, limits);
  if (rows.channels != 3 || rows.bit_depth != 8 || rows.row_bytes != size_t{rows.width} * 3) {
    throw ImageError("png image: libpng delivers rows of " + std::to_string(rows.channels) +
                     " channels of " + std::to_string(rows.bit_depth) +
                     " bits, not 8-bit RGB (a decoder bug)");
  }
  at::Tensor hwc = at::empty({int64_t{rows.height}, int64_t{rows.width}, 3}, at::kByte);
  if (!PngReadRows(decoder.png(), rows, hwc.data_ptr<uint8_t>())) throw PngFailure(source);
  return hwc;
}

// --- JPEG: libjpeg-turbo -------------------------------------------------------------------------

// The most scans a JPEG may have. A progressive JPEG has about 10; each scan passes over every
// block of the image, so a small file of thousands of tiny scans would cost seconds of CPU
// (libjpeg-turbo's "Two Issues with the JPEG Standard"; TurboJPEG's TJPARAM_SCANLIMIT,
// nvImageCodec's limit of 256).
constexpr int kMaxJpegScans = 256;

// libjpeg's decompressor and what its handlers report (Note [Decoding with longjmp]).
struct JpegState {
  jpeg_decompress_struct cinfo;
  jpeg_error_mgr error;
  jpeg_progress_mgr progress;
  std::jmp_buf jump;
  bool truncated;
  bool too_many_scans;
  int message_code;  // J_MESSAGE_CODE of the error
  char message[JMSG_LENGTH_MAX];
};

JpegState* StateOf(j_common_ptr cinfo) { return static_cast<JpegState*>(cinfo->client_data); }

// error_exit: keeps libjpeg's message and leaves the library.
void JpegOnError(j_common_ptr cinfo) {
  JpegState* state = StateOf(cinfo);
  (*cinfo->err->format_message)(cinfo, state->message);
  state->message_code = cinfo->err->msg_code;
  std::longjmp(state->jump, 1);
}

// emit_message: level -1 is a warning about corrupt data, levels >= 0 are trace messages. The end
// of the data before the end of the image (JWRN_JPEG_EOF, after which libjpeg would go on with an
// EOI marker of its own and grey rows) is an error. Other warnings (bad Huffman code, extraneous
// bytes before a marker, ...) are ignored, as Pillow ignores them, so that the pixels are the ones
// upstream nanoVLM decodes.
void JpegOnMessage(j_common_ptr cinfo, int msg_level) {
  if (msg_level >= 0) return;
  if (cinfo->err->msg_code == JWRN_JPEG_EOF) {
    StateOf(cinfo)->truncated = true;
    JpegOnError(cinfo);
  }
  ++cinfo->err->num_warnings;
}

void JpegOnOutput(j_common_ptr /*cinfo*/) {}  // nothing is printed

// Called between scans and rows: stops a JPEG of more than kMaxJpegScans scans.
void JpegOnProgress(j_common_ptr cinfo) {
  if (reinterpret_cast<j_decompress_ptr>(cinfo)->input_scan_number > kMaxJpegScans) {
    JpegState* state = StateOf(cinfo);
    state->too_many_scans = true;
    std::longjmp(state->jump, 1);
  }
}

// Frees libjpeg's memory (nothing before jpeg_create_decompress ran: cinfo.mem is null).
class JpegDecoder {
 public:
  JpegDecoder() : state_(std::make_unique<JpegState>()) {  // value-initialized: all zero
    state_->cinfo.err = jpeg_std_error(&state_->error);
    state_->error.error_exit = JpegOnError;
    state_->error.emit_message = JpegOnMessage;
    state_->error.output_message = JpegOnOutput;
    state_->cinfo.client_data = state_.get();
    state_->progress.progress_monitor = JpegOnProgress;
  }
  ~JpegDecoder() { jpeg_destroy_decompress(&state_->cinfo); }
  JpegDecoder(const JpegDecoder&) = delete;
  JpegDecoder& operator=(const JpegDecoder&) = delete;

  JpegState* state() const { return state_.get(); }

 private:
  std::unique_ptr<JpegState> state_;
};

// Creates the decompressor and reads the markers up to the first scan. False on a libjpeg error.
bool JpegReadHeader(JpegState* state, const unsigned char* data, unsigned long size) {
  if (setjmp(state->jump)) return false;
  jpeg_create_decompress(&state->cinfo);
  state->cinfo.progress = &state->progress;
  jpeg_mem_src(&state->cinfo, data, size);
  jpeg_read_header(&state->cinfo, TRUE);
  return true;
}

// Decodes every row into `pixels` (row_bytes apart), then reads on to EOI. False on a libjpeg error
// or when the output is not the expected size.
bool JpegReadRows(JpegState* state, uint8_t* pixels, JDIMENSION height, size_t row_bytes) {
  if (setjmp(state->jump)) return false;
  jpeg_decompress_struct* cinfo = &state->cinfo;
  jpeg_start_decompress(cinfo);
  if (cinfo->output_height != height ||
      size_t{cinfo->output_width} * static_cast<size_t>(cinfo->output_components) != row_bytes) {
    std::snprintf(state->message, sizeof(state->message),
                  "the decoder's output (%u x %u x %d) is not the header's size",
                  cinfo->output_width, cinfo->output_height, cinfo->output_components);
    return false;
  }
  while (cinfo->output_scanline < cinfo->output_height) {
    JSAMPROW row = pixels + size_t{cinfo->output_scanline} * row_bytes;
    if (jpeg_read_scanlines(cinfo, &row, 1) != 1) {
      std::snprintf(state->message, sizeof(state->message), "the decoder returned no row");
      return false;
    }
  }
  jpeg_finish_decompress(cinfo);
  return true;
}

ImageError JpegFailure(const JpegState& state, size_t size) {
  const std::string message = state.message;
  if (state.truncated)
    return Truncated("jpeg", size, "before the end of the image (libjpeg: " + message + ")");
  if (state.too_many_scans) {
    return ImageError("jpeg image has more than " + std::to_string(kMaxJpegScans) +
                      " scans; at most " + std::to_string(kMaxJpegScans) + " are allowed");
  }
  switch (state.message_code) {
    case JERR_OUT_OF_MEMORY:
      return ImageError("jpeg image needs more memory than the decoder could get: " + message);
    case JERR_ARITH_NOTIMPL:
    case JERR_BAD_PRECISION:
    case JERR_CCIR601_NOTIMPL:
    case JERR_CONVERSION_NOTIMPL:
    case JERR_IMAGE_TOO_BIG:
    case JERR_NOT_COMPILED:
    case JERR_NOTIMPL:
    case JERR_SOF_UNSUPPORTED:
      return ImageError("unsupported jpeg image: " + message);
    default:
      return ImageError("corrupt jpeg image: " + message);
  }
}

// Pillow's CMYK -> RGB for a 4-component JPEG, which Pillow always reads as Adobe's inverted CMYK
// (JpegImagePlugin.py: rawmode "CMYK;I"; libjpeg converts YCCK to that CMYK). With the decoded
// values c' = 255 - cyan, ..., k' = 255 - black, each channel is k' - cyan * k' / 255, rounded as
// Pillow's MULDIV255 (libImaging/Convert.c, cmyk2rgb). (H, W, 4) uint8 -> (H, W, 3) uint8.
at::Tensor InvertedCmykToRgb(const at::Tensor& cmyk) {
  at::Tensor rgb = at::empty({cmyk.size(0), cmyk.size(1), 3}, at::kByte);
  const uint8_t* in = cmyk.data_ptr<uint8_t>();
  uint8_t* out = rgb.data_ptr<uint8_t>();
  const int64_t pixels = cmyk.size(0) * cmyk.size(1);
  for (int64_t p = 0; p < pixels; ++p, in += 4, out += 3) {
    const int k = in[3];
    for (int c = 0; c < 3; ++c) {
      const int t = (255 - in[c]) * k + 128;
      out[c] = static_cast<uint8_t>(k - (((t >> 8) + t) >> 8));
    }
  }
  return rgb;
}

// (H, W, 3) uint8 RGB: libjpeg's default decoding (ISLOW IDCT, fancy upsampling), as Pillow's.
at::Tensor DecodeJpeg(const std::string& bytes, const ImageLimits& limits) {
  JpegDecoder decoder;
  JpegState* state = decoder.state();
  jpeg_decompress_struct& cinfo = state->cinfo;
  if (!JpegReadHeader(state, reinterpret_cast<const unsigned char*>(bytes.data()), bytes.size()))
    throw JpegFailure(*state, bytes.size());
  CheckPixels("jpeg", {cinfo.image_width, cinfo.image_height}, limits);
  const int components = cinfo.num_components;
  if (components != 1 && components != 3 && components != 4) {
    throw ImageError("unsupported jpeg image: it has " + std::to_string(components) +
                     " colour components; 1 (grey), 3 (YCbCr or RGB) or 4 (CMYK or YCCK) are "
                     "supported");
  }
  cinfo.out_color_space = components == 4 ? JCS_CMYK : JCS_RGB;
  cinfo.dct_method = JDCT_ISLOW;
  cinfo.do_fancy_upsampling = TRUE;
  const int64_t channels = components == 4 ? 4 : 3;
  at::Tensor hwc =
      at::empty({int64_t{cinfo.image_height}, int64_t{cinfo.image_width}, channels}, at::kByte);
  if (!JpegReadRows(state, hwc.data_ptr<uint8_t>(), cinfo.image_height,
                    static_cast<size_t>(cinfo.image_width * channels))) {
    throw JpegFailure(*state, bytes.size());
  }
  return channels == 4 ? InvertedCmykToRgb(hwc) : hwc;
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

ImageSize ReadImageSize(const std::string& bytes, const ImageLimits& limits) {
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
  const DeclaredSize size = format == "png" ? PngSize(bytes) : JpegSize(bytes);
  CheckPixels(format, size, limits);
  return {static_cast<int64_t>(size.width), static_cast<int64_t>(size.height)};
}

at::Tensor DecodeImage(const std::string& bytes, const ImageLimits& limits) {
  ReadImageSize(bytes, limits);  // every check that needs no decoder, first
  const std::string format = DetectImageFormat(bytes);
  at::Tensor hwc;  // (H, W, 3) uint8
  if (format == "png") {
    CheckPngChunks(bytes);
    hwc = DecodePng(bytes, limits);
  } else {
    hwc = DecodeJpeg(bytes, limits);
  }
  return hwc.permute({2, 0, 1}).contiguous();  // (3, H, W)
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

std::pair<int64_t, int64_t> TileGrid(int64_t height, int64_t width, const VlmConfig& cfg) {
  const auto [out_h, out_w] = ResizedSize(height, width, cfg);
  return {out_h / cfg.vit_img_size, out_w / cfg.vit_img_size};
}

int64_t ImageTileCount(int64_t height, int64_t width, const VlmConfig& cfg) {
  const auto [rows, cols] = TileGrid(height, width, cfg);
  return rows * cols + (rows * cols > 1 ? 1 : 0);
}

int64_t MaxTilesPerImage(const VlmConfig& cfg) {
  const int64_t side = std::max<int64_t>(1, cfg.max_img_size / cfg.vit_img_size);
  return side * side + (side > 1 ? 1 : 0);
}

void CheckTileCount(const std::vector<int64_t>& tiles_per_image, int64_t max_tiles,
                    const VlmConfig& cfg) {
  int64_t total = 0;
  for (int64_t t : tiles_per_image) total += t;
  if (total <= max_tiles) return;
  std::string each;
  for (size_t i = 0; i < tiles_per_image.size(); ++i) {
    if (i == 8) {
      each += " + ...";
      break;
    }
    each += (i == 0 ? "" : " + ") + std::to_string(tiles_per_image[i]);
  }
  const int64_t p = cfg.vit_img_size;
  const std::string smaller = ImageTileCount(p, p, cfg) == 1
                                  ? ", or smaller ones (an image of at most " + std::to_string(p) +
                                        "x" + std::to_string(p) + " pixels makes 1 tile)"
                                  : "";
  throw ImageError("the " + std::to_string(tiles_per_image.size()) + " images make " +
                   std::to_string(total) + " image tiles (" + each + "); at most " +
                   std::to_string(max_tiles) + " are allowed per request: send fewer images" +
                   smaller);
}

int64_t ResizeWorkingPixels(int64_t height, int64_t width, const VlmConfig& cfg) {
  const auto [out_h, out_w] = ResizedSize(height, width, cfg);
  return std::max({height * width, height * out_w, out_h * out_w});
}

void CheckResizeFits(int64_t height, int64_t width, const VlmConfig& cfg,
                     const ImageLimits& limits) {
  if (height < 1 || width < 1) return;  // the shape checks say what is wrong
  // Both sides are at most limits.max_pixels here (the input's own check), so the products fit.
  if (height > limits.max_pixels || width > limits.max_pixels ||
      height * width > limits.max_pixels) {
    throw ImageError("image is " + std::to_string(width) + "x" + std::to_string(height) +
                     " pixels; at most " + std::to_string(limits.max_pixels) +
                     " are allowed (limits.max_image_pixels)");
  }
  const int64_t working = ResizeWorkingPixels(height, width, cfg);
  if (working <= limits.max_pixels) return;
  const auto [out_h, out_w] = ResizedSize(height, width, cfg);
  throw ImageError("image of " + std::to_string(width) + "x" + std::to_string(height) +
                   " pixels: resizing it to " + std::to_string(out_w) + "x" +
                   std::to_string(out_h) + " passes through " + std::to_string(out_w) + "x" +
                   std::to_string(height) + " = " + std::to_string(working) +
                   " pixels, over limits.max_image_pixels (" + std::to_string(limits.max_pixels) +
                   "); crop it to at most " + std::to_string(limits.max_pixels / out_w) +
                   " pixels of height, or pad it to a less extreme aspect ratio");
}

ImageTiles TileImage(const at::Tensor& image, const VlmConfig& cfg, const ImageLimits& limits) {
  if (image.dim() != 3 || image.size(0) != 3 || image.size(1) < 1 || image.size(2) < 1) {
    std::ostringstream o;
    o << "an image must be (3, H, W) RGB, got shape " << image.sizes();
    throw ImageError(o.str());
  }
  CheckResizeFits(image.size(1), image.size(2), cfg, limits);
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
  std::tie(out.grid_rows, out.grid_cols) = TileGrid(image.size(1), image.size(2), cfg);
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
  const ImageSize size = ReadImageSize(bytes, limits);
  CheckResizeFits(size.height, size.width, cfg, limits);  // before the decoder allocates
  return TileImage(DecodeImage(bytes, limits), cfg, limits);
}

}  // namespace vlmgraph

// image/image_processor.h: images -> ViT tiles, as upstream nanoVLM preprocesses them
// (data/processors.py get_image_processor, data/custom_transforms.py DynamicResize and
// GlobalAndSplitImages).
//
//   ImageLimits limits;                                     // bytes / pixel caps, checked first
//   ImageTiles t = PreprocessEncodedImage(png_bytes, cfg, limits);
//   t.tiles;  // (N, 3, S, S) float32 in [0, 1], CPU; S = cfg.vit_img_size
//
// Steps: decode PNG (libpng) or JPEG (libjpeg-turbo) to 8-bit RGB as Pillow's
// Image.open(...).convert("RGB") does, which upstream nanoVLM calls: alpha dropped, not
// composited; grey replicated; palettes expanded; tRNS and gAMA ignored; 16-bit samples keep their
// high byte (Pillow clips 16-bit grey to 255 instead; every other 16-bit PNG matches); JPEG with
// libjpeg's default ISLOW IDCT and fancy upsampling, 4-component JPEGs read as Adobe's inverted
// CMYK and converted with Pillow's formula (tests/fixtures/images/ holds Pillow's pixels). Then
// resize (bicubic, antialiased like PIL) to ResizedSize(); split into an n_h x n_w grid of S x S
// tiles in row-major order; when the grid has more than one tile, prepend a "global" tile: the
// whole resized image scaled to S x S (bilinear, antialiased, as torchvision's tensor resize).
// Pixels are uint8 until the bicubic resize, rounded back to uint8 after it (PIL works on uint8),
// then divided by 255 (torchvision's ToTensor).
//
// Errors: ImageError (a std::invalid_argument) saying what is wrong: unknown format, corrupt data
// ("corrupt png image: <libpng's reason>", "corrupt jpeg image: <libjpeg's reason>"), truncated
// data ("corrupt ... image: truncated: ..."; a JPEG whose data ends before its EOI marker too),
// an unsupported JPEG (12-bit, lossless) or one of more than 256 scans, too many bytes or pixels,
// bad tensor shape or values. Width and height are read from the PNG IHDR / JPEG SOF header here,
// before a decoder sees the data, so any declared size over ImageLimits::max_pixels gets the
// pixel-limit message; ReadImageSize runs the same checks alone, so that a server can count an
// image's tiles (ImageTileCount) and refuse a request before it decodes anything. libjpeg's
// warnings about corrupt data other than its end are ignored, as
// Pillow ignores them. Thread rules: pure functions, safe from any thread (no shared state).
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"

namespace vlmgraph {

class ImageError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct ImageLimits {
  int64_t max_bytes = 32 << 20;   // encoded size, checked before decoding
  int64_t max_pixels = 50000000;  // width x height, checked from the header before decoding
};

struct ImageTiles {
  at::Tensor tiles;         // (N, 3, S, S) float32 in [0, 1], CPU, contiguous
  int64_t grid_rows = 1;    // n_h: tiles along the height of the resized image
  int64_t grid_cols = 1;    // n_w
  bool has_global = false;  // tiles[0] is the global tile (grid has more than one tile)
};

// The image file format detected from its first bytes; "" when neither PNG nor JPEG.
std::string DetectImageFormat(const std::string& bytes);

struct ImageSize {
  int64_t width = 0;
  int64_t height = 0;
};

// Width and height as the PNG IHDR or JPEG frame header (SOF) declares them, after the checks that
// DecodeImage makes before decoding (empty, limits.max_bytes, format, header, limits.max_pixels),
// with the same ImageError messages. Reads the header only: no decoder runs.
ImageSize ReadImageSize(const std::string& bytes, const ImageLimits& limits);

// Decodes PNG or JPEG bytes to (3, H, W) uint8 RGB (the conversions above). Throws ImageError.
at::Tensor DecodeImage(const std::string& bytes, const ImageLimits& limits);

// nanoVLM DynamicResize._get_new_hw: (height, width) after resizing an h x w image. The long side
// becomes max_img_size (resize_to_max_side_len) or min(max_img_size, long rounded up to a multiple
// of vit_img_size); the short side keeps the aspect ratio, rounded up to a multiple of
// vit_img_size, at least vit_img_size.
std::pair<int64_t, int64_t> ResizedSize(int64_t height, int64_t width, const VlmConfig& cfg);

// The grid TileImage cuts an image of height x width into: ResizedSize / vit_img_size, as
// {rows, cols}.
std::pair<int64_t, int64_t> TileGrid(int64_t height, int64_t width, const VlmConfig& cfg);
// The tiles TileImage makes of an image of height x width: the grid's cells, plus the global tile
// when there is more than one.
int64_t ImageTileCount(int64_t height, int64_t width, const VlmConfig& cfg);
// The most tiles one image makes: (max_img_size / vit_img_size)^2, plus the global tile when that
// is more than one. The engine's default max_tiles_per_request (engine/engine.h).
int64_t MaxTilesPerImage(const VlmConfig& cfg);
// Throws ImageError when images that make tiles_per_image[i] tiles each make more than max_tiles
// together, saying how many each makes and what to change.
void CheckTileCount(const std::vector<int64_t>& tiles_per_image, int64_t max_tiles,
                    const VlmConfig& cfg);

// Pixels of the largest image the resize of a height x width image passes through: the image
// itself, the horizontal pass's height x out_w (PIL's order: horizontal first), and the resized
// out_h x out_w (ResizedSize). A thin image is widened by the horizontal pass: 1 x 400000 pixels
// pass through 400000 x 512 of them.
int64_t ResizeWorkingPixels(int64_t height, int64_t width, const VlmConfig& cfg);
// Throws ImageError unless ResizeWorkingPixels fits limits.max_pixels: the pixel limit bounds
// what the resize allocates (3 float32 planes of that many pixels), not only the input. Saying
// which pass, and what to change. Checked before decoding where the header gives the size.
void CheckResizeFits(int64_t height, int64_t width, const VlmConfig& cfg,
                     const ImageLimits& limits);

// Resizes and tiles one RGB image: (3, H, W) uint8, or float32 in [0, 1] (a raw tensor from a
// client; rounded to uint8 levels like a decoded image after the bicubic resize). Throws
// ImageError for a bad shape and, before allocating anything, where CheckResizeFits does.
ImageTiles TileImage(const at::Tensor& image, const VlmConfig& cfg,
                     const ImageLimits& limits = ImageLimits{});

// DecodeImage + TileImage.
ImageTiles PreprocessEncodedImage(const std::string& bytes, const VlmConfig& cfg,
                                  const ImageLimits& limits);

}  // namespace vlmgraph

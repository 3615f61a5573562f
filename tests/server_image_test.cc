// Image preprocessing (model/image_processor.h) as the server uses it: nanoVLM's resize rule,
// tiling order, the global tile, RGB conversion and refusal of bad or oversized images; the
// image workers that run it (server/image_workers.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "model/image_processor.h"
#include "server/convert.h"
#include "server/image_workers.h"
#include "server/status.h"

#define STB_IMAGE_WRITE_STATIC
#define STB_IMAGE_WRITE_IMPLEMENTATION
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#endif
#include <stb/stb_image_write.h>
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif

namespace vlmgraph {
namespace {

void Append(void* context, void* data, int size) {
  static_cast<std::string*>(context)->append(static_cast<const char*>(data),
                                             static_cast<size_t>(size));
}

// (H, W, C) uint8 pixels -> PNG or JPEG bytes.
std::string Encode(const at::Tensor& hwc, bool jpeg = false) {
  at::Tensor p = hwc.contiguous();
  std::string out;
  const int h = static_cast<int>(p.size(0)), w = static_cast<int>(p.size(1)),
            c = static_cast<int>(p.size(2));
  if (jpeg) {
    stbi_write_jpg_to_func(Append, &out, w, h, c, p.data_ptr<uint8_t>(), 95);
  } else {
    stbi_write_png_to_func(Append, &out, w, h, c, p.data_ptr<uint8_t>(), w * c);
  }
  return out;
}

at::Tensor Gradient(int64_t h, int64_t w) {
  at::Tensor y = at::arange(h).view({h, 1, 1}).expand({h, w, 1});
  at::Tensor x = at::arange(w).view({1, w, 1}).expand({h, w, 1});
  return at::cat({x * 255 / std::max<int64_t>(1, w - 1), y * 255 / std::max<int64_t>(1, h - 1),
                  at::full({h, w, 1}, 77, at::kLong)},
                 2)
      .to(at::kByte);
}

std::pair<int64_t, int64_t> HW(int64_t h, int64_t w) { return {h, w}; }

VlmConfig Tiny() { return VlmConfig::Preset("nanovlm-tiny"); }  // 64 px tiles, max 256 px

TEST(ServerImage, ResizedSizeFollowsNanoVlm) {
  VlmConfig cfg = Tiny();
  ASSERT_TRUE(cfg.resize_to_max_side_len);
  // Long side -> max_img_size; short side scaled, rounded up to a multiple of the tile.
  EXPECT_EQ(ResizedSize(300, 451, cfg), HW(192, 256));  // chelsea.png
  EXPECT_EQ(ResizedSize(451, 300, cfg), HW(256, 192));
  EXPECT_EQ(ResizedSize(10, 10, cfg), HW(256, 256));  // upscales
  EXPECT_EQ(ResizedSize(1, 1000, cfg), HW(64, 256));  // at least a tile
  cfg.resize_to_max_side_len = false;
  EXPECT_EQ(ResizedSize(10, 10, cfg), HW(64, 64));
  EXPECT_EQ(ResizedSize(100, 130, cfg), HW(192, 192));
  EXPECT_EQ(ResizedSize(2000, 3000, cfg), HW(192, 256));
}

TEST(ServerImage, TilesAreRowMajorCropsAfterTheGlobalTile) {
  const VlmConfig cfg = Tiny();
  at::Tensor img = Gradient(30, 45).permute({2, 0, 1}).contiguous();  // (3, 30, 45) -> 192 x 256
  ImageTiles t = TileImage(img, cfg);
  EXPECT_EQ(t.grid_rows, 3);
  EXPECT_EQ(t.grid_cols, 4);
  EXPECT_TRUE(t.has_global);
  ASSERT_EQ(t.tiles.sizes(), (std::vector<int64_t>{13, 3, 64, 64}));
  EXPECT_GE(t.tiles.min().item<float>(), 0.0f);
  EXPECT_LE(t.tiles.max().item<float>(), 1.0f);
  // Rebuild the resized image from tiles 1.. and compare a tile to its crop: tile (r, c) is index
  // 1 + r * cols + c. The red channel grows left to right, green top to bottom.
  at::Tensor grid = t.tiles.narrow(0, 1, 12)
                        .view({3, 4, 3, 64, 64})
                        .permute({2, 0, 3, 1, 4})
                        .reshape({3, 192, 256});
  EXPECT_TRUE(at::equal(grid.narrow(1, 64, 64).narrow(2, 128, 64), t.tiles[1 + 1 * 4 + 2]));
  EXPECT_LT(grid[0][100][10].item<float>(), grid[0][100][250].item<float>());
  EXPECT_LT(grid[1][10][100].item<float>(), grid[1][180][100].item<float>());
  // The global tile is the whole image scaled down: its mean matches the grid's.
  EXPECT_NEAR(t.tiles[0].mean().item<float>(), grid.mean().item<float>(), 0.01);
  // Values are uint8 levels after the bicubic resize (PIL works on 8-bit images).
  at::Tensor levels = grid * 255;
  EXPECT_LT((levels - levels.round()).abs().max().item<float>(), 1e-3);
}

TEST(ServerImage, OneTileImageHasNoGlobalTile) {
  VlmConfig cfg = Tiny();
  cfg.max_img_size = 64;
  ImageTiles t = TileImage(Gradient(40, 50).permute({2, 0, 1}), cfg);
  EXPECT_FALSE(t.has_global);
  EXPECT_EQ(t.tiles.size(0), 1);
}

TEST(ServerImage, ConstantColourSurvivesResizeAndTiling) {
  at::Tensor img = at::full({3, 50, 70}, 200, at::kByte);
  ImageTiles t = TileImage(img, Tiny());
  EXPECT_NEAR(t.tiles.min().item<float>(), 200.0 / 255, 1e-4);
  EXPECT_NEAR(t.tiles.max().item<float>(), 200.0 / 255, 1e-4);
}

TEST(ServerImage, DecodesPngAndJpegToRgb) {
  const ImageLimits limits;
  at::Tensor rgb = Gradient(20, 30);
  at::Tensor png = DecodeImage(Encode(rgb), limits);
  ASSERT_EQ(png.sizes(), (std::vector<int64_t>{3, 20, 30}));
  EXPECT_TRUE(at::equal(png, rgb.permute({2, 0, 1})));
  at::Tensor jpg = DecodeImage(Encode(rgb, /*jpeg=*/true), limits);
  ASSERT_EQ(jpg.sizes(), (std::vector<int64_t>{3, 20, 30}));
  EXPECT_LT((jpg.to(at::kFloat) - rgb.permute({2, 0, 1}).to(at::kFloat)).abs().mean().item<float>(),
            8.0f);
  // Grey replicates to three channels; alpha is dropped.
  at::Tensor grey = at::full({5, 6, 1}, 90, at::kByte);
  at::Tensor g = DecodeImage(Encode(grey), limits);
  EXPECT_EQ(g.size(0), 3);
  EXPECT_EQ(g.min().item<int>(), 90);
  EXPECT_EQ(g.max().item<int>(), 90);
  at::Tensor rgba = at::cat({rgb, at::zeros({20, 30, 1}, at::kByte)}, 2);
  EXPECT_TRUE(at::equal(DecodeImage(Encode(rgba), limits), rgb.permute({2, 0, 1})));
}

TEST(ServerImage, DecodedImageOwnsItsPixelsEvenWhenOnePixelWide) {
  // A (3, 1, 1) or (3, H, 1) permute is already contiguous; the decoder must still copy out of the
  // stb_image buffer it frees (a view of it was a use-after-free under ASan).
  const ImageLimits limits;
  for (auto hw : {std::pair<int64_t, int64_t>{1, 1}, {7, 1}, {1, 9}}) {
    at::Tensor rgb = Gradient(hw.first, hw.second);
    at::Tensor img = DecodeImage(Encode(rgb), limits);
    ASSERT_EQ(img.sizes(), (std::vector<int64_t>{3, hw.first, hw.second}));
    EXPECT_NE(img.storage().data_ptr().get_context(), nullptr) << "pixels are a borrowed view";
    EXPECT_TRUE(at::equal(img, rgb.permute({2, 0, 1})));
  }
}

std::string ErrorOf(const std::string& bytes, const ImageLimits& limits) {
  try {
    DecodeImage(bytes, limits);
  } catch (const ImageError& e) {
    return e.what();
  }
  return "";
}

TEST(ServerImage, RefusesBadImagesWithPreciseMessages) {
  const ImageLimits limits;
  const std::string png = Encode(Gradient(20, 30));
  EXPECT_NE(ErrorOf("GIF89a....", limits).find("unknown image format"), std::string::npos);
  EXPECT_NE(ErrorOf("", limits).find("empty"), std::string::npos);
  EXPECT_NE(ErrorOf(png.substr(0, 40), limits).find("corrupt png"), std::string::npos);
  ImageLimits few_bytes;
  few_bytes.max_bytes = 100;
  EXPECT_NE(ErrorOf(png, few_bytes).find("limits.max_image_bytes"), std::string::npos);
  ImageLimits few_pixels;
  few_pixels.max_pixels = 599;  // 20 x 30 = 600
  const std::string msg = ErrorOf(png, few_pixels);
  EXPECT_NE(msg.find("30x20"), std::string::npos) << msg;
  EXPECT_NE(msg.find("limits.max_image_pixels"), std::string::npos) << msg;
  EXPECT_THROW(TileImage(at::zeros({4, 10, 10}, at::kByte), Tiny()), ImageError);
}

// PNG's CRC-32 (ISO 3309, as zlib's crc32), so hand-built chunks are valid ones.
uint32_t Crc32(const std::string& bytes) {
  uint32_t c = 0xffffffffu;
  for (unsigned char b : bytes) {
    c ^= b;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
  }
  return c ^ 0xffffffffu;
}

std::string Be32(uint32_t v) {
  return {static_cast<char>(v >> 24), static_cast<char>(v >> 16), static_cast<char>(v >> 8),
          static_cast<char>(v)};
}

// A PNG of the signature and one IHDR chunk declaring `width` x `height` (8-bit RGB): what a
// client that lies about the size sends; no pixel data follows.
std::string PngHeader(uint32_t width, uint32_t height) {
  const std::string ihdr = "IHDR" + Be32(width) + Be32(height) + std::string("\x08\x02\0\0\0", 5);
  return std::string("\x89PNG\r\n\x1a\n", 8) + Be32(13) + ihdr + Be32(Crc32(ihdr));
}

// A JPEG of SOI, then a baseline frame header (SOF0) declaring `width` x `height`.
std::string JpegHeader(uint16_t width, uint16_t height) {
  std::string sof = "\xff\xd8\xff\xc0";
  sof += std::string("\x00\x11\x08", 3);
  sof += {static_cast<char>(height >> 8), static_cast<char>(height), static_cast<char>(width >> 8),
          static_cast<char>(width), 3};
  for (int c = 1; c <= 3; ++c) sof += {static_cast<char>(c), 0x11, 0};
  return sof;
}

TEST(ServerImage, HugeDeclaredSizesGetThePixelLimitMessage) {
  const ImageLimits limits;  // 50,000,000 pixels
  const std::vector<std::pair<uint32_t, uint32_t>> sizes = {
      {20000, 20000}, {65536, 65536}, {1u << 31, 2}, {0xffffffffu, 0xffffffffu}};
  for (const auto& [w, h] : sizes) {
    const std::string size = std::to_string(w) + "x" + std::to_string(h);
    for (const std::string& bytes : {PngHeader(w, h), PngHeader(w, h) + Encode(Gradient(2, 2))}) {
      const std::string msg = ErrorOf(bytes, limits);
      EXPECT_NE(msg.find("limits.max_image_pixels"), std::string::npos) << size << ": " << msg;
      EXPECT_NE(msg.find(size), std::string::npos) << size << ": " << msg;
    }
  }
  // 2^64 - 2^33 + 1 pixels: the product is not cut to 64 bits on the way.
  EXPECT_NE(ErrorOf(PngHeader(0xffffffffu, 0xffffffffu), limits).find("18446744065119617025"),
            std::string::npos);
  const std::string jpeg = ErrorOf(JpegHeader(65535, 65535), limits);
  EXPECT_NE(jpeg.find("65535x65535"), std::string::npos) << jpeg;
  EXPECT_NE(jpeg.find("limits.max_image_pixels"), std::string::npos) << jpeg;
  EXPECT_NE(ErrorOf(PngHeader(0, 5), limits).find("no pixels"), std::string::npos);
}

TEST(ServerImage, TruncatedImagesSayWhy) {
  const ImageLimits limits;
  const std::string png = Encode(Gradient(60, 90));
  const std::string jpeg = Encode(Gradient(60, 90), /*jpeg=*/true);
  ASSERT_GT(png.size(), 100u);
  const std::string prefix = "corrupt png image: ";
  // Cut inside the header, right after IHDR, inside the pixel data, before IEND, by one byte.
  for (size_t n :
       {size_t{20}, size_t{33}, size_t{60}, png.size() / 2, png.size() - 12, png.size() - 1}) {
    const std::string msg = ErrorOf(png.substr(0, n), limits);
    EXPECT_EQ(msg.rfind(prefix, 0), 0u) << n << ": " << msg;
    EXPECT_NE(msg.find("truncated"), std::string::npos) << n << ": " << msg;
    EXPECT_GT(msg.size(), prefix.size() + 10) << n << ": " << msg;
  }
  EXPECT_EQ(ErrorOf(png, limits), "");
  EXPECT_EQ(ErrorOf(png + "trailing bytes", limits), "");
  // Cut before the frame header, inside the Huffman tables, inside the scan, before EOI.
  for (size_t n : {size_t{4}, size_t{40}, size_t{200}, jpeg.size() / 2, jpeg.size() - 2}) {
    const std::string msg = ErrorOf(jpeg.substr(0, n), limits);
    EXPECT_EQ(msg.rfind("corrupt jpeg image: ", 0), 0u) << n << ": " << msg;
    EXPECT_GT(msg.size(), std::string("corrupt jpeg image: ").size() + 5) << n << ": " << msg;
    EXPECT_EQ(msg.find("png"), std::string::npos) << n << ": " << msg;  // not the PNG probe's
  }
}

TEST(ServerImage, DetectsFormatFromMagicBytes) {
  EXPECT_EQ(DetectImageFormat(Encode(Gradient(4, 4))), "png");
  EXPECT_EQ(DetectImageFormat(Encode(Gradient(4, 4), true)), "jpeg");
  EXPECT_EQ(DetectImageFormat("BM\x36\x00"), "");
}

}  // namespace
}  // namespace vlmgraph

// --- Image workers (server/image_workers.h) -------------------------------------------------------

namespace vlmgraph::server {
namespace {

int64_t ThreadsOfThisProcess() {
  int64_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

TEST(ImageWorkers, RunsWorkOnAPoolThreadAndReturnsItsValueOrError) {
  const std::thread::id caller = std::this_thread::get_id();
  std::thread::id ran_on;
  EXPECT_EQ(RunImageWork([&] {
              ran_on = std::this_thread::get_id();
              return 42;
            }),
            42);
  EXPECT_NE(ran_on, caller);
  EXPECT_GE(image_worker_threads(), 1);
  EXPECT_LE(image_worker_threads(), 4);
  EXPECT_THROW(RunImageWork([]() -> int { throw InvalidArgument("images[0]: corrupt"); }),
               ServerError);
  // Nested use (from a pool thread) runs inline instead of waiting for itself.
  EXPECT_EQ(RunImageWork([] { return RunImageWork([] { return 7; }); }), 7);
}

// Many handler threads preprocessing images at once: ATen's intra-op (OpenMP) teams belong to the
// few pool threads, not to every caller, so the process holds at most callers + pool x intra-op
// threads more while the callers live.
TEST(ImageWorkers, ConcurrentCallersDoNotEachGetIntraOpThreads) {
  if (at::get_num_threads() < 2) GTEST_SKIP() << "one intra-op thread: no team to bound";
  const VlmConfig cfg = VlmConfig::Preset("nanovlm-tiny");
  v1::Image image;
  image.set_encoded(Encode(Gradient(480, 640)));
  Limits limits;
  limits.max_image_bytes = 1 << 24;
  limits.max_image_pixels = 1 << 24;
  limits.max_images_per_request = 4;
  constexpr int kCallers = 24;
  RunImageWork([] { return 0; });  // the pool exists before the baseline
  const int64_t baseline = ThreadsOfThisProcess();
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  bool release = false;
  std::vector<std::thread> callers;
  for (int i = 0; i < kCallers; ++i) {
    callers.emplace_back([&] {
      const ImageTiles t = ImageToTiles(image, cfg, limits, "images[0]");
      EXPECT_GT(t.tiles.size(0), 0);
      std::unique_lock<std::mutex> lock(mu);
      ++done;
      cv.notify_all();
      cv.wait(lock, [&] { return release; });  // alive while the threads are counted
    });
  }
  int64_t during = 0;
  {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [&] { return done == kCallers; });
    during = ThreadsOfThisProcess();
    release = true;
  }
  cv.notify_all();
  for (auto& t : callers) t.join();
  const int64_t bound = kCallers + int64_t{image_worker_threads()} * at::get_num_threads();
  EXPECT_LE(during - baseline, bound)
      << "threads " << baseline << " -> " << during << " with " << kCallers << " callers, "
      << image_worker_threads() << " image workers, " << at::get_num_threads() << " intra-op";
}

}  // namespace
}  // namespace vlmgraph::server

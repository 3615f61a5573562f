// Image preprocessing (image/image_processor.h) as the server uses it: nanoVLM's resize rule,
// tiling order, the global tile, RGB conversion and refusal of bad or oversized images; the
// image workers that run it (server/core/image_workers.h).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <mutex>
#include <thread>
#include <vector>

#include "image/data_url.h"
#include "image/image_processor.h"
#include "server/core/image_workers.h"
#include "server/core/status.h"
#include "server/grpc/convert.h"
#include "tests/image_fixtures.h"

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

// image/data_url.h: base64 data URLs decode (padding optional), and each refusal says what to send.
TEST(ServerImage, DataUrlsDecodeAndRefuseWithWhatToSend) {
  EXPECT_EQ(DecodeImageDataUrl("data:image/png;base64,aGVsbG8=", 100, "lim"), "hello");
  EXPECT_EQ(DecodeImageDataUrl("DATA:image/PNG;BASE64,aGVsbG8", 100, "lim"), "hello");
  auto refusal = [](const std::string& url, int64_t max_bytes) {
    try {
      DecodeImageDataUrl(url, max_bytes, "the.limit");
    } catch (const ImageError& e) {
      return std::string(e.what());
    }
    return std::string("(decoded)");
  };
  EXPECT_NE(refusal("https://example.com/cat.png", 100).find("fetches nothing"), std::string::npos);
  EXPECT_NE(refusal("cat.png", 100).find("must be a data URL"), std::string::npos);
  EXPECT_NE(refusal("data:image/png;base64", 100).find("no ','"), std::string::npos);
  EXPECT_NE(refusal("data:text/plain;base64,aGk=", 100).find("media type must be image/"),
            std::string::npos);
  EXPECT_NE(refusal("data:image/png,aGk=", 100).find("base64-encoded"), std::string::npos);
  EXPECT_NE(refusal("data:image/png;base64,@@@@", 100).find("not valid base64"), std::string::npos);
  EXPECT_NE(refusal("data:image/png;base64,", 100).find("empty"), std::string::npos);
  const std::string big = refusal("data:image/png;base64,aGVsbG8gd29ybGQ=", 4);
  EXPECT_NE(big.find("at most 4 are allowed (the.limit)"), std::string::npos) << big;
}

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
  // A (3, 1, 1) or (3, H, 1) permute is already contiguous; the image must still own its memory,
  // not view a decoder buffer freed on return (that was a use-after-free under ASan).
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

using testing::PngHeader;

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
    EXPECT_NE(msg.find("truncated"), std::string::npos) << n << ": " << msg;
    EXPECT_GT(msg.size(), std::string("corrupt jpeg image: ").size() + 5) << n << ": " << msg;
    EXPECT_EQ(msg.find("png"), std::string::npos) << n << ": " << msg;  // not the PNG probe's
  }
}

// --- Decoding against Pillow: tests/fixtures/images/ (make_images.py) ---------------------------

std::string ReadFixture(const std::string& name) {
  const std::string path = std::string(VLMGRAPH_FIXTURES_DIR) + "/images/" + name;
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// The fixture's expected pixels, NAME.rgb: (H, W, 3) uint8 row-major -> (3, H, W).
at::Tensor ExpectedPixels(const std::string& name, int64_t h, int64_t w) {
  std::string raw = ReadFixture(name.substr(0, name.rfind('.')) + ".rgb");
  EXPECT_EQ(static_cast<int64_t>(raw.size()), h * w * 3) << name;
  raw.resize(static_cast<size_t>(h * w * 3));
  return at::from_blob(raw.data(), {h, w, 3}, at::kByte).permute({2, 0, 1}).clone();
}

struct PillowCase {
  const char* file;
  int64_t height;
  int64_t width;
};

// Every pixel equals Pillow's Image.open(file).convert("RGB") -- upstream nanoVLM's decoding --
// exactly: libjpeg-turbo's default decoding (ISLOW IDCT, fancy upsampling) gives the same pixels
// in Debian's 2.1 and the 3.x in Pillow's wheels.
TEST(ServerImage, DecodesLikePillow) {
  const ImageLimits limits;
  for (const PillowCase& c : {
           PillowCase{"rgb_32x24_420.jpg", 24, 32},  // baseline, 4:2:0
           PillowCase{"rgb_32x24_progressive.jpg", 24, 32},
           PillowCase{"cmyk_8x6.jpg", 6, 8},            // Adobe inverted CMYK
           PillowCase{"rgb16_5x4.png", 4, 5},           // 16 bits: the high byte
           PillowCase{"palette_trns_6x5.png", 5, 6},    // tRNS ignored
           PillowCase{"grey_alpha_5x3.png", 3, 5},      // grey replicated, alpha dropped
           PillowCase{"rgb_interlaced_9x7.png", 7, 9},  // Adam7
       }) {
    const at::Tensor img = DecodeImage(ReadFixture(c.file), limits);
    ASSERT_EQ(img.sizes(), (std::vector<int64_t>{3, c.height, c.width})) << c.file;
    const at::Tensor want = ExpectedPixels(c.file, c.height, c.width);
    const int64_t differ = img.ne(want).sum().item<int64_t>();
    EXPECT_EQ(differ, 0) << c.file << ": " << differ << " of " << img.numel()
                         << " values differ from Pillow's; max abs diff "
                         << (img.to(at::kInt) - want.to(at::kInt)).abs().max().item<int>();
  }
}

// Pillow clips 16-bit grey to 255 (its I;16 -> RGB conversion); DecodeImage keeps the high byte,
// as Pillow does for every other 16-bit PNG and as upstream 8-bit data would be.
TEST(ServerImage, SixteenBitGreyKeepsTheHighByte) {
  const at::Tensor img = DecodeImage(ReadFixture("grey16_4x3.png"), ImageLimits{});
  EXPECT_TRUE(at::equal(img, ExpectedPixels("grey16_4x3.png", 3, 4)));
}

TEST(ServerImage, EveryCutOfAJpegOrPngIsTruncated) {
  const ImageLimits limits;
  for (const char* file : {"rgb_32x24_420.jpg", "rgb_32x24_progressive.jpg",
                           "rgb_interlaced_9x7.png", "palette_trns_6x5.png"}) {
    const std::string bytes = ReadFixture(file);
    for (size_t n = 8; n < bytes.size(); ++n) {  // 8: the PNG signature, JPEG's SOI and more
      const std::string msg = ErrorOf(bytes.substr(0, n), limits);
      ASSERT_NE(msg.find("corrupt"), std::string::npos) << file << " cut at " << n << ": " << msg;
      ASSERT_NE(msg.find("truncated"), std::string::npos) << file << " cut at " << n << ": " << msg;
    }
  }
}

// Corrupt data that libjpeg only warns about (here: extraneous bytes before EOI) is accepted as
// Pillow accepts it, with Pillow's pixels.
TEST(ServerImage, JpegWarningsAreIgnoredLikePillow) {
  std::string bytes = ReadFixture("rgb_32x24_420.jpg");
  ASSERT_EQ(bytes.substr(bytes.size() - 2), "\xff\xd9");
  bytes.insert(bytes.size() - 2, "\x12\x34");  // extraneous bytes before EOI (a warning)
  const at::Tensor img = DecodeImage(bytes, ImageLimits{});
  EXPECT_TRUE(at::equal(img, ExpectedPixels("rgb_32x24_420.jpg", 24, 32)));
}

// A scan whose Huffman tables no DHT segment defines (as in Motion-JPEG) is decoded with the
// standard tables of ITU T.81 Annex K, which Pillow's encoder writes: the same pixels.
TEST(ServerImage, JpegWithoutHuffmanTablesUsesTheStandardOnes) {
  const std::string bytes = ReadFixture("rgb_32x24_420.jpg");
  std::string no_dht = bytes.substr(0, 2);
  for (size_t i = 2; i + 4 <= bytes.size();) {
    ASSERT_EQ(bytes[i], '\xff') << i;
    const auto marker = static_cast<unsigned char>(bytes[i + 1]);
    if (marker == 0xda) {  // the scan and everything after it
      no_dht += bytes.substr(i);
      break;
    }
    const size_t length = (size_t{static_cast<unsigned char>(bytes[i + 2])} << 8) |
                          static_cast<unsigned char>(bytes[i + 3]);
    if (marker != 0xc4) no_dht += bytes.substr(i, 2 + length);
    i += 2 + length;
  }
  ASSERT_LT(no_dht.size(), bytes.size());
  EXPECT_TRUE(
      at::equal(DecodeImage(no_dht, ImageLimits{}), ExpectedPixels("rgb_32x24_420.jpg", 24, 32)));
}

TEST(ServerImage, RefusesAJpegOfTooManyScans) {
  // The progressive fixture's last scan, repeated: 300 more scans before EOI.
  const std::string bytes = ReadFixture("rgb_32x24_progressive.jpg");
  const size_t last_scan = bytes.rfind("\xff\xda");
  ASSERT_NE(last_scan, std::string::npos);
  const std::string scan = bytes.substr(last_scan, bytes.size() - 2 - last_scan);
  std::string many = bytes.substr(0, bytes.size() - 2);
  for (int i = 0; i < 300; ++i) many += scan;
  many += "\xff\xd9";
  const std::string msg = ErrorOf(many, ImageLimits{});
  EXPECT_NE(msg.find("more than 256 scans"), std::string::npos) << msg;
  // Ten repeats are within the limit (a repeated scan is a warning).
  std::string few = bytes.substr(0, bytes.size() - 2);
  for (int i = 0; i < 10; ++i) few += scan;
  EXPECT_EQ(ErrorOf(few + "\xff\xd9", ImageLimits{}), "");
}

TEST(ServerImage, CorruptImagesNameTheDecodersReason) {
  const ImageLimits limits;
  std::string png = ReadFixture("rgb_interlaced_9x7.png");
  const size_t idat = png.find("IDAT");
  ASSERT_NE(idat, std::string::npos);
  const size_t idat_length = (size_t{static_cast<unsigned char>(png[idat - 2])} << 8) |
                             static_cast<unsigned char>(png[idat - 1]);
  png[idat + 4 + idat_length] ^= 0x55;  // the chunk's CRC no longer matches its data
  std::string msg = ErrorOf(png, limits);
  EXPECT_EQ(msg, "corrupt png image: IDAT: CRC error") << msg;
  std::string jpeg = ReadFixture("rgb_32x24_420.jpg");
  const size_t sof = jpeg.find("\xff\xc0");
  ASSERT_NE(sof, std::string::npos);
  jpeg[sof + 4] = 12;  // sample precision 12
  msg = ErrorOf(jpeg, limits);
  EXPECT_EQ(msg.rfind("unsupported jpeg image: ", 0), 0u) << msg;
  EXPECT_NE(msg.find("precision 12"), std::string::npos) << msg;
}

TEST(ServerImage, DetectsFormatFromMagicBytes) {
  EXPECT_EQ(DetectImageFormat(Encode(Gradient(4, 4))), "png");
  EXPECT_EQ(DetectImageFormat(Encode(Gradient(4, 4), true)), "jpeg");
  EXPECT_EQ(DetectImageFormat("BM\x36\x00"), "");
}

}  // namespace
}  // namespace vlmgraph

// --- Image workers (server/core/image_workers.h) -------------------------------------------------

namespace vlmgraph::server {
namespace {

int64_t ThreadsOfThisProcess() {
  int64_t n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

TEST(ServerImage, SizeAndTileCountComeFromTheHeaderAlone) {
  // The issue's image: 6324 x 6324 RGBA16 (under the default 40,000,000-pixel limit), here with
  // garbage data: the size is read, while decoding it fails.
  const std::string png = testing::PngWithGarbageData(6324, 6324);
  const ImageLimits limits{1 << 20, 40000000};
  const ImageSize size = ReadImageSize(png, limits);
  EXPECT_EQ(size.width, 6324);
  EXPECT_EQ(size.height, 6324);
  EXPECT_NE(ErrorOf(png, limits).find("corrupt png image"), std::string::npos);
  const ImageSize jpeg = ReadImageSize(JpegHeader(300, 200), limits);
  EXPECT_EQ(std::make_pair(jpeg.width, jpeg.height), std::make_pair(int64_t{300}, int64_t{200}));
  // The header checks are DecodeImage's own, with its messages.
  auto header_error = [&](const std::string& bytes) -> std::string {
    try {
      ReadImageSize(bytes, limits);
    } catch (const ImageError& e) {
      return e.what();
    }
    return "no error";
  };
  for (const std::string& bad : {std::string(), std::string("GIF89a...."), PngHeader(20000, 20000)})
    EXPECT_EQ(header_error(bad), ErrorOf(bad, limits));

  // The tile count is the tiler's: ImageTileCount equals what TileImage makes, at every size.
  const VlmConfig cfg = Tiny();  // 64-pixel tiles, at most 256 pixels a side
  EXPECT_EQ(ImageTileCount(6324, 6324, cfg), 17);
  EXPECT_EQ(MaxTilesPerImage(cfg), 17);
  for (const auto& [h, w] : {HW(1, 1), HW(64, 64), HW(65, 64), HW(30, 45), HW(200, 90), HW(90, 200),
                             HW(256, 256), HW(300, 1000), HW(6324, 6324)}) {
    const ImageTiles t = TileImage(at::zeros({3, h, w}, at::kByte), cfg);
    EXPECT_EQ(ImageTileCount(h, w, cfg), t.tiles.size(0)) << h << "x" << w;
    EXPECT_EQ(TileGrid(h, w, cfg), std::make_pair(t.grid_rows, t.grid_cols)) << h << "x" << w;
  }
}

// A thin image is widened by the resize's horizontal pass (PIL's order): 1 x 400000 pixels pass
// through 400000 x out_w floats (2.4 GB for 512-pixel tiles). Its pixels count against the pixel
// limit, so such an image is refused, from its header before decoding, or from its tensor shape
// before the resize allocates anything; an image that fits still tiles.
TEST(ServerImage, AThinImageIsRefusedBeforeItsResizeAllocates) {
  const VlmConfig cfg = Tiny();  // 64-pixel tiles: the horizontal pass is height x 64
  const ImageLimits limits{32 << 20, 1000000};
  EXPECT_EQ(ResizeWorkingPixels(400000, 1, cfg), int64_t{400000} * 64);
  EXPECT_EQ(ResizeWorkingPixels(300, 451, cfg), 300 * 451);
  EXPECT_EQ(ResizeWorkingPixels(1, 400000, cfg), 400000);  // wide: the input is the largest
  const std::string png = Encode(at::zeros({400000, 1, 3}, at::kByte));
  ASSERT_LT(png.size(), 2u << 20);
  EXPECT_NO_THROW(ReadImageSize(png, limits));  // 400000 pixels: under the input's own limit
  std::string message;
  try {
    PreprocessEncodedImage(png, cfg, limits);
  } catch (const ImageError& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("1x400000 pixels: resizing it to 64x256 passes through 64x400000 = "
                         "25600000 pixels, over limits.max_image_pixels (1000000)"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("at most 15625 pixels of height"), std::string::npos) << message;
  // A [3, H, W] tensor (what a gRPC client may send) and the header-only check say the same.
  EXPECT_THROW(TileImage(at::zeros({3, 400000, 1}), cfg, limits), ImageError);
  EXPECT_THROW(CheckResizeFits(400000, 1, cfg, limits), ImageError);
  EXPECT_THROW(CheckResizeFits(15626, 1, cfg, limits), ImageError);
  EXPECT_NO_THROW(CheckResizeFits(15625, 1, cfg, limits));
  EXPECT_EQ(TileImage(at::zeros({3, 15625, 1}, at::kByte), cfg, limits).tiles.size(0), 5);
  EXPECT_EQ(PreprocessEncodedImage(Encode(Gradient(300, 451)), cfg, limits).tiles.size(0), 13);
}

TEST(ServerImage, TooManyTilesSayHowManyEachImageMakes) {
  const VlmConfig cfg = Tiny();
  EXPECT_NO_THROW(CheckTileCount({17}, 17, cfg));
  EXPECT_NO_THROW(CheckTileCount({}, 17, cfg));
  auto message = [](const std::vector<int64_t>& tiles, const VlmConfig& c) -> std::string {
    try {
      CheckTileCount(tiles, 17, c);
    } catch (const ImageError& e) {
      return e.what();
    }
    return "accepted";
  };
  // The tiny model resizes every image to its longest side (resize_to_max_side_len): only fewer
  // images help.
  ASSERT_TRUE(cfg.resize_to_max_side_len);
  EXPECT_EQ(message({17, 17, 1}, cfg),
            "the 3 images make 35 image tiles (17 + 17 + 1); at most 17 are allowed per request: "
            "send fewer images");
  VlmConfig keeps_small = cfg;
  keeps_small.resize_to_max_side_len = false;
  EXPECT_EQ(message({17, 1}, keeps_small),
            "the 2 images make 18 image tiles (17 + 1); at most 17 are allowed per request: send "
            "fewer images, or smaller ones (an image of at most 64x64 pixels makes 1 tile)");
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

// The sharded checkpoint reader (metrale/sharded_checkpoint.h) on checkpoints each case writes
// into its own temporary folder: safetensors shards built byte by byte here (8-byte header
// length, JSON header, data) with fresh random data every run, and a Hugging Face
// "model.safetensors.index.json" over them.
//
// A rank must read its slice's bytes and no more (bytes_read() counts them); every malformed
// checkpoint must be an Error whose message names the files and the tensor at fault, and leaves
// nothing open.
#include "metrale/sharded_checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/expect_error.h"
#include "metrale/checkpoint_layers.h"
#include "metrale/error.h"
#include "metrale/modelopt.h"
#include "metrale/moe_checkpoint.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"
#include "metrale/safetensors.h"
#include "support/random.h"

namespace metrale {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using testing::expect_error;
using ::testing::HasSubstr;
using testing::random_size;
using testing::rng;

// ---- writing checkpoints ----

// One tensor to write: its header entry and its bytes.
struct Tensor {
  std::string name;
  std::string dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> data;
};

std::size_t width_of(const std::string& dtype) {
  if (dtype == "BF16" || dtype == "F16") return 2;
  if (dtype == "F32" || dtype == "I32") return 4;
  if (dtype == "F64") return 8;
  return 1;  // U8, I8, F8_E4M3
}

std::int64_t elements_of(const std::vector<std::int64_t>& shape) {
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;
  return n;
}

std::vector<std::byte> random_bytes(std::size_t n) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<std::byte> out(n);
  for (auto& b : out) b = static_cast<std::byte>(byte(rng()));
  return out;
}

// A tensor of random bytes.
Tensor random_tensor(std::string name, std::string dtype, std::vector<std::int64_t> shape) {
  const auto n = static_cast<std::size_t>(elements_of(shape)) * width_of(dtype);
  return Tensor{std::move(name), std::move(dtype), std::move(shape), random_bytes(n)};
}

Tensor f32_scalar(std::string name, float v, std::vector<std::int64_t> shape = {}) {
  const std::uint32_t u = num::f32_bits(v);
  std::vector<std::byte> b(4);
  for (std::size_t i = 0; i < 4; ++i) b[i] = static_cast<std::byte>(u >> (8 * i));
  return Tensor{std::move(name), "F32", std::move(shape), std::move(b)};
}

void write_bytes(const fs::path& path, std::string_view bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// A valid safetensors file of `tensors`, laid out in the order given.
void write_safetensors(const fs::path& path, const std::vector<Tensor>& tensors) {
  std::string header = "{";
  std::string data;
  for (const Tensor& t : tensors) {
    std::string shape;
    for (const std::int64_t d : t.shape) shape += fmt::format("{}{}", shape.empty() ? "" : ",", d);
    header += fmt::format("{}\"{}\":{{\"dtype\":\"{}\",\"shape\":[{}],\"data_offsets\":[{},{}]}}",
                          header.size() > 1 ? "," : "", t.name, t.dtype, shape, data.size(),
                          data.size() + t.data.size());
    data.append(reinterpret_cast<const char*>(t.data.data()), t.data.size());
  }
  header += "}";
  std::string file(8, '\0');
  for (std::size_t i = 0; i < 8; ++i) file[i] = static_cast<char>(header.size() >> (8 * i) & 0xFF);
  write_bytes(path, file + header + data);
}

// A checkpoint in a fresh folder, removed when the case ends.
class ShardedCheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    static int count = 0;
    dir_ =
        fs::path(::testing::TempDir()) / fmt::format("metrale-sharded-{}-{}", ::getpid(), count++);
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string path(std::string_view name) const { return (dir_ / name).string(); }
  std::string index() const { return path("model.safetensors.index.json"); }

  // Writes a shard and remembers where the index should put its tensors.
  void shard(const std::string& file, const std::vector<Tensor>& tensors) {
    write_safetensors(dir_ / file, tensors);
    for (const Tensor& t : tensors) {
      map_[t.name] = file;
      tensors_[t.name] = t;
    }
  }
  // The index as Hugging Face writes it, from every shard() so far plus `extra`.
  void write_index(const std::map<std::string, std::string>& extra = {},
                   const std::vector<std::string>& drop = {}) {
    std::map<std::string, std::string> m = map_;
    for (const auto& [k, v] : extra) m[k] = v;
    for (const auto& k : drop) m.erase(k);
    std::string body;
    for (const auto& [k, v] : m) {
      body += fmt::format("{}\n    \"{}\": \"{}\"", body.empty() ? "" : ",", k, v);
    }
    write_raw_index(fmt::format(
        "{{\n  \"metadata\": {{\"total_size\": 0}},\n  \"weight_map\": {{{}\n  }}\n}}", body));
  }
  void write_raw_index(std::string_view text) const { write_bytes(index(), text); }

  // Whether any descriptor of this process refers to a file of the folder.
  bool anything_open() const {
    const std::string real = fs::canonical(dir_).string() + "/";
    for (const auto& fd : fs::directory_iterator("/proc/self/fd")) {
      std::error_code ec;
      if (fs::read_symlink(fd.path(), ec).string().starts_with(real)) return true;
    }
    return false;
  }

  // open() must fail with kIo, naming every one of `words`, and leave nothing open.
  void expect_open_fails(const std::vector<std::string>& words) const {
    const Error e = expect_error([&] { ShardedCheckpoint::open(index()); });
    EXPECT_EQ(e.code(), ErrorCode::kIo) << e.what();
    EXPECT_THAT(e.what(), ::testing::StartsWith("[safetensors] "));
    for (const std::string& w : words) EXPECT_THAT(e.what(), HasSubstr(w));
    EXPECT_FALSE(anything_open());
  }

  fs::path dir_;
  std::map<std::string, std::string> map_;  // tensor -> shard file name
  std::map<std::string, Tensor> tensors_;   // what was written
};

// A [rows, cols] slice of `full`, row-major with `width` bytes per element.
std::vector<std::byte> slice_of(const std::vector<std::byte>& full, std::int64_t rows,
                                std::int64_t cols, std::size_t width, int axis, std::int64_t b,
                                std::int64_t e) {
  std::vector<std::byte> out;
  for (std::int64_t r = 0; r < rows; ++r) {
    for (std::int64_t c = 0; c < cols; ++c) {
      if ((axis == 0 ? r : c) < b || (axis == 0 ? r : c) >= e) continue;
      const auto at = static_cast<std::size_t>(r * cols + c) * width;
      out.insert(out.end(), full.begin() + static_cast<std::ptrdiff_t>(at),
                 full.begin() + static_cast<std::ptrdiff_t>(at + width));
    }
  }
  return out;
}

// ---- reading ----

TEST_F(ShardedCheckpointTest, OpensTwoShardsAndReadsEveryTensorBack) {
  const auto rows = static_cast<std::int64_t>(random_size(1, 20));
  shard("model-00001-of-00002.safetensors",
        {random_tensor("model.layers.0.mlp.down_proj.weight", "BF16", {rows, 24}),
         random_tensor("model.norm.weight", "F32", {rows}), f32_scalar("scalar", 0.5f)});
  shard("model-00002-of-00002.safetensors",
        {random_tensor("lm_head.weight", "U8", {8, 12}), random_tensor("cube", "I8", {3, 4, 5})});
  write_index();
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(index());
  EXPECT_EQ(ckpt.index_path(), index());
  EXPECT_THAT(ckpt.names(),
              ElementsAre("cube", "lm_head.weight", "model.layers.0.mlp.down_proj.weight",
                          "model.norm.weight", "scalar"));
  EXPECT_TRUE(ckpt.contains("cube"));
  EXPECT_FALSE(ckpt.contains("model.norm"));
  EXPECT_EQ(ckpt.file_of("scalar"), path("model-00001-of-00002.safetensors"));
  EXPECT_EQ(ckpt.file_of("cube"), path("model-00002-of-00002.safetensors"));
  const SafetensorsTensorInfo& down = ckpt.info("model.layers.0.mlp.down_proj.weight");
  EXPECT_EQ(down.dtype, "BF16");
  EXPECT_THAT(down.shape, ElementsAre(rows, 24));
  EXPECT_EQ(down.bytes, static_cast<std::uint64_t>(rows * 24 * 2));
  EXPECT_TRUE(ckpt.info("scalar").shape.empty());
  EXPECT_EQ(ckpt.bytes_read(), 0u);  // open() read headers only

  std::uint64_t total = 0;
  for (const auto& [name, t] : tensors_) {
    EXPECT_EQ(ckpt.read(name), t.data) << name;
    total += t.data.size();
  }
  EXPECT_EQ(ckpt.bytes_read(), total);

  const Error missing = expect_error([&] { (void)ckpt.read("nope"); });
  EXPECT_EQ(missing.code(), ErrorCode::kNotFound);
  EXPECT_THAT(missing.what(), HasSubstr("tensor 'nope'"));
  EXPECT_EQ(expect_error([&] { (void)ckpt.file_of("nope"); }).code(), ErrorCode::kNotFound);
  EXPECT_EQ(expect_error([&] { (void)ckpt.info("nope"); }).code(), ErrorCode::kNotFound);
}

TEST_F(ShardedCheckpointTest, HeaderAloneAgreesWithTheMappedReader) {
  shard("a.safetensors", {random_tensor("x", "BF16", {5, 7}), random_tensor("y", "U8", {3})});
  const SafetensorsFile mapped = SafetensorsFile::open(path("a.safetensors"));
  const int fd = ::open(path("a.safetensors").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(fd, 0);
  const SafetensorsHeader h = read_safetensors_header(fd, path("a.safetensors"));
  ::close(fd);
  ASSERT_EQ(h.tensors.size(), 2u);
  for (const auto& [name, info] : h.tensors) {
    EXPECT_EQ(info.dtype, mapped.info(name).dtype);
    EXPECT_EQ(info.shape, mapped.info(name).shape);
    EXPECT_EQ(info.offset, mapped.info(name).offset);
    EXPECT_EQ(info.bytes, mapped.info(name).bytes);
  }
  EXPECT_EQ(h.data_start + h.data_bytes, fs::file_size(path("a.safetensors")));
  EXPECT_EQ(h.data_bytes, 5u * 7 * 2 + 3);

  // A bad header: the same words from both readers.
  write_bytes(dir_ / "bad.safetensors", std::string("\x02\0\0\0\0\0\0\0[]", 10));
  const Error by_map = expect_error([&] { SafetensorsFile::open(path("bad.safetensors")); });
  const int bad = ::open(path("bad.safetensors").c_str(), O_RDONLY | O_CLOEXEC);
  ASSERT_GE(bad, 0);
  const Error alone = expect_error([&] { read_safetensors_header(bad, path("bad.safetensors")); });
  ::close(bad);
  EXPECT_EQ(alone.code(), ErrorCode::kIo);
  EXPECT_EQ(std::string(alone.what()), by_map.what());
  EXPECT_THAT(alone.what(), HasSubstr("header is a JSON array, not an object"));
}

TEST_F(ShardedCheckpointTest, SlicesAreTheSliceOfTheWholeTensor) {
  const auto rows = static_cast<std::int64_t>(random_size(1, 40));
  const auto cols = static_cast<std::int64_t>(random_size(1, 40));
  shard("a.safetensors", {random_tensor("m", "BF16", {rows, cols})});
  shard("b.safetensors", {random_tensor("cube", "I8", {3, 5, 7})});
  write_index();
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(index());
  const std::vector<std::byte>& full = tensors_["m"].data;
  for (int trial = 0; trial < 50; ++trial) {
    const int axis = trial % 2;
    const auto extent = static_cast<std::size_t>(axis == 0 ? rows : cols);
    auto b = static_cast<std::int64_t>(random_size(0, extent));
    auto e = static_cast<std::int64_t>(random_size(0, extent));
    if (b > e) std::swap(b, e);
    const std::uint64_t before = ckpt.bytes_read();
    const auto got = ckpt.read_slice("m", TensorSlice{axis, b, e});
    const auto want = slice_of(full, rows, cols, 2, axis, b, e);
    ASSERT_EQ(got, want) << "axis " << axis << " [" << b << ", " << e << ") of [" << rows << ", "
                         << cols << "]";
    EXPECT_EQ(ckpt.bytes_read() - before, want.size());
  }
  // A 3-D tensor, cut along its middle axis: [3, 5, 7] -> [3, 2, 7].
  const auto cube = ckpt.read_slice("cube", TensorSlice{1, 1, 3});
  const auto& c = tensors_["cube"].data;
  std::vector<std::byte> want;
  for (std::size_t i = 0; i < 3; ++i) {
    want.insert(want.end(), c.begin() + static_cast<std::ptrdiff_t>(i * 35 + 7),
                c.begin() + static_cast<std::ptrdiff_t>(i * 35 + 21));
  }
  EXPECT_EQ(cube, want);
  EXPECT_EQ(ckpt.read_slice("cube", TensorSlice{2, 0, 7}), c);
}

TEST_F(ShardedCheckpointTest, EachOfFourRanksReadsAQuarter) {
  shard("a.safetensors", {random_tensor("w", "F32", {64, 32})});
  write_index();
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(index());
  const std::vector<std::byte>& full = tensors_["w"].data;
  for (const int axis : {0, 1}) {
    std::vector<std::vector<std::byte>> parts;
    for (int r = 0; r < 4; ++r) {
      const TensorSlice s = shard_slice(axis, axis == 0 ? 64 : 32, 1, r, 4);
      EXPECT_EQ(s.end - s.begin, axis == 0 ? 16 : 8);
      const std::uint64_t before = ckpt.bytes_read();
      parts.push_back(ckpt.read_slice("w", s));
      EXPECT_EQ(ckpt.bytes_read() - before, full.size() / 4) << "axis " << axis << " rank " << r;
    }
    // Back together: rank after rank (axis 0), or row by row (axis 1).
    std::vector<std::byte> joined;
    for (int row = 0; row < (axis == 0 ? 1 : 64); ++row) {
      for (const auto& p : parts) {
        const std::size_t run = axis == 0 ? p.size() : 8 * 4;
        joined.insert(joined.end(), p.begin() + static_cast<std::ptrdiff_t>(row * run),
                      p.begin() + static_cast<std::ptrdiff_t>((row + 1) * run));
      }
    }
    EXPECT_EQ(joined, full) << "axis " << axis;
  }
}

// ---- NVFP4 layers ----

const std::string kLayer = "model.layers.0.mlp.down_proj";

// Finite, non-negative E4M3 block scales: any byte but the NaNs (0x7F, 0xFF) and the negatives.
Tensor random_scales(std::string name, std::int64_t n, std::int64_t groups) {
  std::uniform_int_distribution<int> byte(0, 0x7E);
  std::vector<std::byte> b(static_cast<std::size_t>(n * groups));
  for (auto& x : b) x = static_cast<std::byte>(byte(rng()));
  return Tensor{std::move(name), "F8_E4M3", {n, groups}, std::move(b)};
}

TEST_F(ShardedCheckpointTest, Nvfp4SlicesJoinBackToTheWholeLayer) {
  const auto n = static_cast<std::int64_t>(4 * random_size(1, 6));
  const auto k = static_cast<std::int64_t>(64 * random_size(1, 3));
  const float scale2 = std::uniform_real_distribution<float>(0.001f, 2.0f)(rng());
  const Tensor codes = random_tensor(kLayer + ".weight", "U8", {n, k / 2});
  const Tensor scales = random_scales(kLayer + ".weight_scale", n, k / 16);
  const Tensor s2 = f32_scalar(kLayer + ".weight_scale_2", scale2, {1});
  const Tensor input = f32_scalar(kLayer + ".input_scale", 0.25f);
  // The codes in one shard, their scales in the other, as large checkpoints put them.
  shard("model-00001-of-00002.safetensors", {codes, random_tensor("other", "BF16", {2, 2})});
  shard("model-00002-of-00002.safetensors", {s2, scales, input});
  write_index();
  write_safetensors(dir_ / "single.safetensors", {codes, scales, s2, input});
  const Nvfp4Linear ref =
      load_nvfp4_linear(SafetensorsFile::open(path("single.safetensors")), kLayer);
  ASSERT_EQ(ref.w.n, n);
  ASSERT_EQ(ref.w.k, k);

  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(index());
  for (const int size : {1, 2, 4}) {
    for (const int axis : {0, 1}) {
      SCOPED_TRACE(fmt::format("size {}, axis {}, N = {}, K = {}", size, axis, n, k));
      std::vector<Nvfp4LinearShard> parts;
      for (int r = 0; r < size; ++r) {
        const std::uint64_t before = ckpt.bytes_read();
        parts.push_back(load_nvfp4_linear_shard(ckpt, kLayer, axis, r, size));
        const Nvfp4LinearShard& p = parts.back();
        // Its share of codes and scales, and the two 4-byte scalars.
        EXPECT_EQ(
            ckpt.bytes_read() - before,
            static_cast<std::uint64_t>(n * k / 2 + n * k / 16) / static_cast<unsigned>(size) + 8);
        EXPECT_EQ(p.full_n, n);
        EXPECT_EQ(p.full_k, k);
        EXPECT_EQ(p.slice.axis, axis);
        EXPECT_EQ(p.slice.begin, r * (axis == 0 ? n : k) / size);
        EXPECT_EQ(p.slice.end, (r + 1) * (axis == 0 ? n : k) / size);
        EXPECT_EQ(p.w.n, axis == 0 ? n / size : n);
        EXPECT_EQ(p.w.k, axis == 0 ? k : k / size);
        EXPECT_EQ(p.w.format, WeightFormat::kNvfp4);
        EXPECT_EQ(p.w.layout, WeightLayout::kRowMajor);
        EXPECT_EQ(p.w.codes.size(), static_cast<std::size_t>(p.w.n * p.w.k / 2));
        EXPECT_EQ(p.w.scales.size(), static_cast<std::size_t>(p.w.n * p.w.k / 16));
        EXPECT_EQ(p.w.tensor_scale, ref.w.tensor_scale);
        EXPECT_EQ(p.input_scale, ref.input_scale);
      }
      std::vector<std::uint8_t> joined_codes, joined_scales;
      for (std::int64_t row = 0; row < (axis == 0 ? 1 : n); ++row) {
        for (const auto& p : parts) {
          const auto code_run =
              static_cast<std::ptrdiff_t>(axis == 0 ? p.w.codes.size() : p.w.k / 2);
          const auto scale_run =
              static_cast<std::ptrdiff_t>(axis == 0 ? p.w.scales.size() : p.w.k / 16);
          joined_codes.insert(joined_codes.end(), p.w.codes.begin() + row * code_run,
                              p.w.codes.begin() + (row + 1) * code_run);
          joined_scales.insert(joined_scales.end(), p.w.scales.begin() + row * scale_run,
                               p.w.scales.begin() + (row + 1) * scale_run);
        }
      }
      EXPECT_EQ(joined_codes, ref.w.codes);
      EXPECT_EQ(joined_scales, ref.w.scales);
      // And the weights themselves, through the slice's own accessors.
      const Nvfp4LinearShard& last = parts.back();
      const std::int64_t r0 = axis == 0 ? last.slice.begin : 0;
      const std::int64_t c0 = axis == 0 ? 0 : last.slice.begin;
      EXPECT_EQ(last.w.weight(last.w.n - 1, last.w.k - 1),
                ref.w.weight(r0 + last.w.n - 1, c0 + last.w.k - 1));
    }
  }
}

TEST_F(ShardedCheckpointTest, Nvfp4ShapesThatDisagreeAcrossShardsAreMismatched) {
  // N: the weights say 64 rows, their scales 32.
  shard("a.safetensors", {random_tensor(kLayer + ".weight", "U8", {64, 16})});
  shard("b.safetensors", {random_scales(kLayer + ".weight_scale", 32, 2),
                          f32_scalar(kLayer + ".weight_scale_2", 1)});
  write_index();
  {
    const ShardedCheckpoint ckpt = ShardedCheckpoint::open(index());
    const Error e = expect_error([&] { load_nvfp4_linear_shard(ckpt, kLayer, 0, 0, 2); });
    EXPECT_EQ(e.code(), ErrorCode::kIo);
    for (const std::string& w :
         {std::string("mismatched shapes"), kLayer + ".weight'", kLayer + ".weight_scale'",
          path("a.safetensors"), path("b.safetensors"), std::string("[64, 16]"),
          std::string("[32, 2]"), std::string("need block scales of shape [64, 2]")}) {
      EXPECT_THAT(e.what(), HasSubstr(w));
    }
  }
  // K: K/2 = 16 says K = 32, the scales' K/16 = 4 says 64.
  shard("b.safetensors", {random_scales(kLayer + ".weight_scale", 64, 4),
                          f32_scalar(kLayer + ".weight_scale_2", 1)});
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(index());
  const Error e = expect_error([&] { load_nvfp4_linear_shard(ckpt, kLayer, 1, 0, 2); });
  EXPECT_EQ(e.code(), ErrorCode::kIo);
  EXPECT_THAT(e.what(), HasSubstr("mismatched shapes"));
  EXPECT_THAT(e.what(), HasSubstr("[64, 4] in " + path("b.safetensors")));
  EXPECT_THAT(e.what(), HasSubstr("[64, 16] in " + path("a.safetensors") + " (N = 64, K = 32)"));
}

TEST_F(ShardedCheckpointTest, Nvfp4SplitsThatDoNotDivideAreInvalid) {
  shard("a.safetensors", {random_tensor(kLayer + ".weight", "U8", {24, 16}),
                          random_scales(kLayer + ".weight_scale", 24, 2),
                          f32_scalar(kLayer + ".weight_scale_2", 1)});
  write_index();
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(index());
  const Error n = expect_error([&] { load_nvfp4_linear_shard(ckpt, kLayer, 0, 0, 5); });
  EXPECT_EQ(n.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(n.what(), HasSubstr("cannot split N = 24 over 5 ranks"));
  EXPECT_THAT(n.what(), HasSubstr(kLayer + ".weight'"));
  // K = 32 splits in two 16-column groups, not in four.
  EXPECT_NO_THROW(load_nvfp4_linear_shard(ckpt, kLayer, 1, 1, 2));
  const Error k = expect_error([&] { load_nvfp4_linear_shard(ckpt, kLayer, 1, 0, 4); });
  EXPECT_EQ(k.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(k.what(), HasSubstr("cannot split K = 32 over 4 ranks at multiples of 16"));
  EXPECT_THAT(k.what(), HasSubstr("multiple of 64"));
  const Error axis = expect_error([&] { load_nvfp4_linear_shard(ckpt, kLayer, 2, 0, 2); });
  EXPECT_EQ(axis.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(axis.what(), HasSubstr("load_nvfp4_linear_shard: axis 2"));
  const Error rank = expect_error([&] { load_nvfp4_linear_shard(ckpt, kLayer, 0, 2, 2); });
  EXPECT_EQ(rank.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(rank.what(), HasSubstr("rank 2 of size 2"));
  const Error missing = expect_error([&] { load_nvfp4_linear_shard(ckpt, "nope", 0, 0, 1); });
  EXPECT_EQ(missing.code(), ErrorCode::kNotFound);
  EXPECT_THAT(missing.what(), HasSubstr("tensor 'nope.weight'"));
  const Error unnamed = expect_error([&] { load_nvfp4_linear_shard(ckpt, "", 0, 0, 1); });
  EXPECT_EQ(unnamed.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(unnamed.what(), HasSubstr("load_nvfp4_linear_shard: the layer name is empty"));
}

TEST_F(ShardedCheckpointTest, Nvfp4NanBlockScaleIsNamedByItsPlaceInTheWholeTensor) {
  Tensor scales = random_scales(kLayer + ".weight_scale", 4, 4);  // K = 64
  scales.data[2 * 4 + 3] = std::byte{0xFF};                       // [2, 3]: rank 1 of 2, axis 1
  shard("a.safetensors", {random_tensor(kLayer + ".weight", "U8", {4, 32}), scales,
                          f32_scalar(kLayer + ".weight_scale_2", 1)});
  write_index();
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(index());
  EXPECT_NO_THROW(load_nvfp4_linear_shard(ckpt, kLayer, 1, 0, 2));  // its half has no NaN
  const Error e = expect_error([&] { load_nvfp4_linear_shard(ckpt, kLayer, 1, 1, 2); });
  EXPECT_EQ(e.code(), ErrorCode::kIo);
  EXPECT_THAT(e.what(), HasSubstr("block scale [2, 3] is NaN (0xFF)"));
  EXPECT_THAT(e.what(),
              HasSubstr(path("a.safetensors") + ": tensor '" + kLayer + ".weight_scale'"));
}

TEST_F(ShardedCheckpointTest, ShardSliceSaysWhyItCannotSplit) {
  EXPECT_EQ(shard_slice(1, 96, 16, 2, 3).begin, 64);
  EXPECT_EQ(shard_slice(1, 96, 16, 2, 3).end, 96);
  const Error e = expect_error([] { shard_slice(1, 80, 16, 0, 3); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[shard_slice] extent 80 does not split over 3 ranks at "
                                  "multiples of 16: it must be a multiple of 16 x 3"));
  EXPECT_THAT(expect_error([] { shard_slice(0, 8, 1, 4, 4); }).what(), HasSubstr("rank 4"));
  EXPECT_THAT(expect_error([] { shard_slice(0, 8, 1, 0, 0); }).what(), HasSubstr("size 0"));
  EXPECT_THAT(expect_error([] { shard_slice(0, 8, 0, 0, 1); }).what(), HasSubstr("granule 0"));
}

// ---- bad slices ----

TEST_F(ShardedCheckpointTest, BadSlicesAreInvalidArguments) {
  shard("a.safetensors", {random_tensor("m", "BF16", {8, 6})});
  write_index();
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(index());
  const auto fails = [&](const TensorSlice& s, const std::string& what) {
    const Error e = expect_error([&] { (void)ckpt.read_slice("m", s); });
    EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument) << e.what();
    EXPECT_THAT(e.what(), HasSubstr(path("a.safetensors") + ": tensor 'm': read_slice: " + what));
  };
  fails({2, 0, 1}, "axis 2 is not a dimension of shape [8, 6]");
  fails({-1, 0, 1}, "axis -1");
  fails({0, 3, 9}, "end 9 is past the extent 8 of axis 0");
  fails({1, 0, 7}, "end 7 is past the extent 6 of axis 1");
  fails({0, 5, 4}, "begin 5 is after end 4");
  fails({1, -1, 4}, "begin -1 is negative");
  EXPECT_EQ(ckpt.bytes_read(), 0u);
  EXPECT_TRUE(ckpt.read_slice("m", {0, 3, 3}).empty());
}

TEST_F(ShardedCheckpointTest, SubByteSlicesMustFallOnWholeBytes) {
  const Tensor f4{"f4", "F4", {4, 6}, random_bytes(12)};
  shard("a.safetensors", {f4});
  write_index();
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(index());
  // Rows of 6 nibbles are 3 bytes: rows [1, 3) are bytes [3, 9).
  EXPECT_EQ(ckpt.read_slice("f4", {0, 1, 3}),
            std::vector<std::byte>(f4.data.begin() + 3, f4.data.begin() + 9));
  // Columns [2, 4) of each row are its second byte.
  EXPECT_EQ(ckpt.read_slice("f4", {1, 2, 4}),
            (std::vector<std::byte>{f4.data[1], f4.data[4], f4.data[7], f4.data[10]}));
  const Error e = expect_error([&] { (void)ckpt.read_slice("f4", {1, 1, 2}); });
  EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
  EXPECT_THAT(e.what(), HasSubstr("[1, 2) along axis 1 of F4 [4, 6] does not start and end on "
                                  "whole bytes"));
}

// ---- malformed indexes ----

TEST_F(ShardedCheckpointTest, IndexThatCannotBeReadIsAnIoError) {
  expect_open_fails({index(), "cannot open: No such file or directory"});
  write_raw_index("{\"weight_map\": {\"x\": ");
  expect_open_fails({index(), "index is not valid JSON"});
  write_raw_index("[1, 2]");
  expect_open_fails({index(), "index is a JSON array, not an object"});
  write_raw_index("{\"metadata\": {}}");
  expect_open_fails({index(), "index has no \"weight_map\""});
  write_raw_index("{\"weight_map\": [\"a.safetensors\"]}");
  expect_open_fails({index(), "\"weight_map\" is a JSON array, not an object"});
  write_raw_index("{\"weight_map\": {}}");
  expect_open_fails({index(), "\"weight_map\" is empty"});
  write_raw_index("{\"weight_map\": {\"x.weight\": 3}}");
  expect_open_fails({index(), "tensor 'x.weight'", "is a JSON number, not a shard file name"});
  write_raw_index("{\"weight_map\": {\"x\": \"a.safetensors\", \"x\": \"b.safetensors\"}}");
  expect_open_fails({index(), "tensor 'x': appears twice in \"weight_map\""});
  // A second weight_map would drop the first's tensors (the parser keeps the last).
  write_raw_index(
      "{\"weight_map\": {\"x\": \"a.safetensors\"}, \"weight_map\": {\"y\": \"a.safetensors\"}}");
  expect_open_fails({index(), "key 'weight_map' appears twice in the index"});
  // A key twice in the metadata is no tensor's: the index reads.
  shard("a.safetensors", {random_tensor("x", "U8", {4})});
  write_raw_index(
      "{\"metadata\": {\"total_size\": 4, \"total_size\": 4}, \"weight_map\": {\"x\": "
      "\"a.safetensors\"}}");
  EXPECT_EQ(ShardedCheckpoint::open(index()).names(), std::vector<std::string>{"x"});
}

// A name without a dot belongs to the module "" (module_of), so gpt-oss's packed projection at
// the top level, its blocks and scales in two shards, is gathered as one module and found as a
// single file finds it (its blocks were gathered alone and refused for missing scales).
TEST_F(ShardedCheckpointTest, NamesWithoutADotAreOneModule) {
  shard("a.safetensors", {random_tensor("gate_up_proj_blocks", "U8", {2, 32, 2, 16}),
                          random_tensor("m.experts.down_proj_blocks", "U8", {2, 32, 2, 16})});
  shard("b.safetensors", {random_tensor("gate_up_proj_scales", "U8", {2, 32, 2}),
                          random_tensor("m.experts.down_proj_scales", "U8", {2, 32, 2}),
                          random_tensor("m.experts.x.y", "U8", {4})});
  write_index();
  const ShardedCheckpoint ckpt = ShardedCheckpoint::open(index());
  EXPECT_EQ(module_of("gate_up_proj_blocks"), "");
  EXPECT_EQ(module_of("m.experts.down_proj_blocks"), "m.experts");
  EXPECT_THAT(tensor_prefixes(ckpt), ElementsAre("", "m.experts", "m.experts.x"));
  EXPECT_THAT(
      ckpt.names_with_prefix("m.experts."),
      ElementsAre("m.experts.down_proj_blocks", "m.experts.down_proj_scales", "m.experts.x.y"));
  for (const char* module : {"", "m.experts"}) {
    SCOPED_TRACE(module);
    const SafetensorsFile f = gather_layer(ckpt, module);
    EXPECT_EQ(f.names().size(), 2u);  // not m.experts.x.y, another module's
    const PackedExpertsScan scan = scan_packed_experts(f);
    EXPECT_TRUE(scan.rejected.empty());
    ASSERT_EQ(scan.found.size(), 1u);
  }
  EXPECT_EQ(scan_packed_experts(gather_layer(ckpt, "")).found[0].projection, "gate_up_proj");
}

// A FIFO as the index or a shard is refused at once (opening one waited for a writer forever).
TEST_F(ShardedCheckpointTest, AFifoIsNotAFileAndDoesNotHang) {
  ASSERT_EQ(::mkfifo(index().c_str(), 0600), 0);
  expect_open_fails({index(), "not a regular file"});
  std::filesystem::remove(index());
  ASSERT_EQ(::mkfifo(path("a.safetensors").c_str(), 0600), 0);
  write_index({{"x", "a.safetensors"}});
  expect_open_fails({path("a.safetensors"), "not a regular file"});
  const Error e =
      testing::expect_error([&] { (void)SafetensorsFile::open(path("a.safetensors")); });
  EXPECT_THAT(e.what(), HasSubstr("not a regular file"));
}

TEST_F(ShardedCheckpointTest, ShardPathsMustStayInTheIndexFolder) {
  shard("a.safetensors", {random_tensor("x", "U8", {4})});
  const std::string outside = (dir_.parent_path() / "a.safetensors").string();
  write_index({{"x", outside}});
  expect_open_fails({index(), "tensor 'x'", "is an absolute path"});
  write_index({{"x", "../a.safetensors"}});
  expect_open_fails({index(), "tensor 'x'", "'../a.safetensors' has a '..' component"});
  // Even one that would come back in: no '..' at all is the simple rule.
  write_index({{"x", "sub/../a.safetensors"}});
  expect_open_fails({index(), "tensor 'x'", "has a '..' component"});
  write_index({{"x", ""}});
  expect_open_fails({index(), "tensor 'x'", "the shard file name is empty"});
  // "./" is still the index's folder, and the same file as "a.safetensors".
  write_index({{"x", "./a.safetensors"}});
  EXPECT_EQ(ShardedCheckpoint::open(index()).file_of("x"), path("a.safetensors"));
}

// ---- shards that disagree with the index ----

TEST_F(ShardedCheckpointTest, MissingOrInvalidShardNamesTheShardAndATensor) {
  shard("a.safetensors", {random_tensor("x", "U8", {4})});
  write_index({{"y", "missing.safetensors"}, {"z", "missing.safetensors"}});
  expect_open_fails(
      {path("missing.safetensors"), "cannot open", "tensor 'y' and 1 other ", index()});
  write_bytes(dir_ / "missing.safetensors", std::string("\xE8\x03\0\0\0\0\0\0{\"y\":", 13));
  expect_open_fails({path("missing.safetensors"), "header length 1000 runs past the end",
                     "tensor 'y' and 1 other "});
  write_bytes(dir_ / "missing.safetensors", std::string("\x02\0\0\0\0\0\0\0[]", 10));
  write_index({{"y", "missing.safetensors"}});
  expect_open_fails({path("missing.safetensors"), "not an object", "maps tensor 'y' to"});
}

TEST_F(ShardedCheckpointTest, TensorTheIndexPutsInAShardThatLacksIt) {
  shard("a.safetensors", {random_tensor("x", "U8", {4})});
  shard("b.safetensors", {random_tensor("y", "U8", {4}), random_tensor("y2", "U8", {4})});
  write_index({{"ghost", "a.safetensors"}});
  expect_open_fails({"tensor 'ghost'", index(), "maps it to " + path("a.safetensors"),
                     "whose header does not have it"});
  // In another shard than the index says: that one is named too.
  write_index({{"y", "a.safetensors"}});
  expect_open_fails(
      {"tensor 'y'", index(), path("a.safetensors"), "(it is in " + path("b.safetensors")});
}

TEST_F(ShardedCheckpointTest, TensorInTwoShardsNamesBoth) {
  shard("a.safetensors", {random_tensor("x", "U8", {4}), random_tensor("w", "U8", {2})});
  shard("b.safetensors", {random_tensor("y", "U8", {4}), random_tensor("w", "U8", {2})});
  write_index({{"w", "a.safetensors"}});
  expect_open_fails({"tensor 'w'", path("a.safetensors"), path("b.safetensors"),
                     "a tensor must be in one shard only"});
}

TEST_F(ShardedCheckpointTest, TensorTheIndexDoesNotListIsAnError) {
  shard("a.safetensors", {random_tensor("x", "U8", {4}), random_tensor("unlisted", "U8", {2})});
  write_index({}, {"unlisted"});
  expect_open_fails({path("a.safetensors"), "tensor 'unlisted'", "not in index " + index(),
                     "the index must list every tensor"});
}

}  // namespace
}  // namespace metrale

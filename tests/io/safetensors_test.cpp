// The safetensors reader (metrale/safetensors.h) and the NVFP4 layer loader (metrale/modelopt.h),
// on files written at test time by tests/io/make_safetensors.py: valid ones by the reference
// Python package `safetensors` (a ModelOpt-style NVFP4 model, a BF16 and an F32 layer, one tensor
// of every dtype, metadata), malformed ones built byte by byte. ctest's fixture
// safetensors.make_files writes them and hands the folder over in METRALE_SAFETENSORS_DIR; a run
// without it (./core_tests) runs the script itself into a temporary folder.
//
// Every failure must be an Error with the right code whose message names the file and, where
// there is one, the tensor; no failure leaves the file mapped or open.
#include "metrale/safetensors.h"

#include <fmt/format.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "core/expect_error.h"
#include "io/generated_files.h"
#include "metrale/error.h"
#include "metrale/fp8_checkpoint.h"
#include "metrale/modelopt.h"
#include "metrale/numerics.h"
#include "metrale/quant.h"

namespace metrale {
namespace {

namespace fs = std::filesystem;
using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::StartsWith;

// ---- the files ----

using testing::files;
using testing::path_of;
using testing::read_bin;

std::vector<std::uint8_t> as_u8(std::span<const std::byte> s) {
  std::vector<std::uint8_t> out(s.size());
  for (std::size_t i = 0; i < s.size(); ++i) out[i] = std::to_integer<std::uint8_t>(s[i]);
  return out;
}

std::vector<float> read_f32(std::string_view name) {
  const auto b = read_bin(name);
  std::vector<float> out(b.size() / 4);
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = num::bits_f32(std::uint32_t{b[4 * i]} | std::uint32_t{b[4 * i + 1]} << 8 |
                           std::uint32_t{b[4 * i + 2]} << 16 | std::uint32_t{b[4 * i + 3]} << 24);
  }
  return out;
}

// Whether /proc/self/maps or /proc/self/fd still refers to `path`.
bool mapped_or_open(const std::string& path) {
  const std::string real = fs::canonical(path).string();
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.ends_with(" " + real)) return true;
  }
  for (const auto& fd : fs::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (fs::read_symlink(fd.path(), ec).string() == real) return true;
  }
  return false;
}

const std::string kDown = "model.layers.0.mlp.down_proj";
const std::string kUp = "model.layers.0.mlp.up_proj";
const std::string kOProj = "model.layers.0.self_attn.o_proj";
const std::string kQProj = "model.layers.0.self_attn.q_proj";

// ---- reading valid files ----

TEST(SafetensorsFile, ReadsTheHeaderTheReferenceWriterWrote) {
  const auto f = SafetensorsFile::open(path_of("model.safetensors"));
  EXPECT_EQ(f.path(), path_of("model.safetensors"));
  EXPECT_THAT(f.names(),
              ElementsAre(kDown + ".input_scale", kDown + ".weight", kDown + ".weight_scale",
                          kDown + ".weight_scale_2", kUp + ".weight", kUp + ".weight_scale",
                          kUp + ".weight_scale_2", kOProj + ".weight", kQProj + ".weight",
                          "model.norm.weight"));
  const auto& w = f.info(kDown + ".weight");
  EXPECT_EQ(w.dtype, "U8");
  EXPECT_THAT(w.shape, ElementsAre(8, 32));
  EXPECT_EQ(w.bytes, 256u);
  EXPECT_EQ(w.elements(), 256);
  const auto& s = f.info(kDown + ".weight_scale");
  EXPECT_EQ(s.dtype, "F8_E4M3");
  EXPECT_THAT(s.shape, ElementsAre(8, 4));
  EXPECT_EQ(s.bytes, 32u);
  const auto& s2 = f.info(kDown + ".weight_scale_2");
  EXPECT_EQ(s2.dtype, "F32");
  EXPECT_TRUE(s2.shape.empty());
  EXPECT_EQ(s2.bytes, 4u);
  EXPECT_EQ(s2.elements(), 1);
  EXPECT_THAT(f.info(kUp + ".weight_scale_2").shape, ElementsAre(1));
  const auto& o = f.info(kOProj + ".weight");
  EXPECT_EQ(o.dtype, "BF16");
  EXPECT_THAT(o.shape, ElementsAre(6, 48));
  EXPECT_EQ(o.bytes, 6u * 48 * 2);
  EXPECT_TRUE(f.contains("model.norm.weight"));
  EXPECT_FALSE(f.contains("model.norm"));
  EXPECT_EQ(f.metadata(), (std::map<std::string, std::string, std::less<>>{
                              {"format", "pt"}, {"producer", "make_safetensors.py"}}));
}

TEST(SafetensorsFile, BytesAreTheBytesPythonWrote) {
  const auto f = SafetensorsFile::open(path_of("model.safetensors"));
  EXPECT_EQ(as_u8(f.bytes(kDown + ".weight")), read_bin("down_proj.codes.bin"));
  EXPECT_EQ(as_u8(f.bytes(kDown + ".weight_scale")), read_bin("down_proj.scales.bin"));
  EXPECT_EQ(as_u8(f.bytes(kOProj + ".weight")), read_bin("o_proj.bf16.bin"));
  EXPECT_EQ(as_u8(f.bytes(kQProj + ".weight")), read_bin("q_proj.f32.bin"));
  const auto s2 = as_u8(f.bytes(kDown + ".weight_scale_2"));
  ASSERT_EQ(s2.size(), 4u);
  EXPECT_EQ(num::bits_f32(std::uint32_t{s2[0]} | std::uint32_t{s2[1]} << 8 |
                          std::uint32_t{s2[2]} << 16 | std::uint32_t{s2[3]} << 24),
            0.0123f);
}

TEST(SafetensorsFile, KnowsEveryDtypeOfTheReferenceWriter) {
  const auto f = SafetensorsFile::open(path_of("all_dtypes.safetensors"));
  // Tensor name (torch's dtype name) -> the dtype the format records.
  const std::map<std::string, std::string> want{{"bool", "BOOL"},
                                                {"uint8", "U8"},
                                                {"int8", "I8"},
                                                {"float8_e4m3fn", "F8_E4M3"},
                                                {"float8_e5m2", "F8_E5M2"},
                                                {"float8_e8m0fnu", "F8_E8M0"},
                                                {"float8_e4m3fnuz", "F8_E4M3FNUZ"},
                                                {"float8_e5m2fnuz", "F8_E5M2FNUZ"},
                                                {"float4_e2m1fn_x2", "F4"},
                                                {"int16", "I16"},
                                                {"uint16", "U16"},
                                                {"float16", "F16"},
                                                {"bfloat16", "BF16"},
                                                {"int32", "I32"},
                                                {"uint32", "U32"},
                                                {"float32", "F32"},
                                                {"int64", "I64"},
                                                {"uint64", "U64"},
                                                {"float64", "F64"},
                                                {"complex64", "C64"}};
  // Every safetensors release writes these.
  for (const char* core : {"uint8", "float8_e4m3fn", "bfloat16", "float16", "float32"}) {
    EXPECT_TRUE(f.contains(core)) << core;
  }
  const std::vector<std::uint8_t> iota{0, 1, 2, 3, 4, 5, 6, 7};
  for (const std::string& name : f.names()) {
    if (name == "scalar" || name == "zero_size") continue;
    SCOPED_TRACE(name);
    ASSERT_TRUE(want.contains(name));
    const auto& i = f.info(name);
    EXPECT_EQ(i.dtype, want.at(name));
    EXPECT_EQ(i.bytes, 8u);
    EXPECT_EQ(as_u8(f.bytes(name)), iota);
  }
  if (f.contains("float4_e2m1fn_x2")) {
    EXPECT_THAT(f.info("float4_e2m1fn_x2").shape, ElementsAre(16));  // two F4 values a byte
  }
  const auto& scalar = f.info("scalar");
  EXPECT_TRUE(scalar.shape.empty());
  EXPECT_EQ(scalar.bytes, 4u);
  const auto& zero = f.info("zero_size");
  EXPECT_THAT(zero.shape, ElementsAre(0, 4));
  EXPECT_EQ(zero.elements(), 0);
  EXPECT_EQ(zero.bytes, 0u);
  EXPECT_TRUE(f.bytes("zero_size").empty());
}

TEST(SafetensorsFile, FileWithMetadataAndNoTensors) {
  const auto f = SafetensorsFile::open(path_of("empty.safetensors"));
  EXPECT_TRUE(f.names().empty());
  EXPECT_EQ(f.metadata().at("note"), "no tensors");
}

TEST(SafetensorsFile, MissingTensorIsNotFoundAndNamed) {
  const std::string path = path_of("model.safetensors");
  const auto f = SafetensorsFile::open(path);
  for (int i = 0; i < 2; ++i) {
    const Error e = testing::expect_error([&] {
      if (i == 0) (void)f.info("model.nothing.weight");
      if (i == 1) (void)f.bytes("model.nothing.weight");
    });
    EXPECT_EQ(e.code(), ErrorCode::kNotFound);
    EXPECT_THAT(e.what(), StartsWith("[safetensors] " + path + ": "));
    EXPECT_THAT(e.what(), HasSubstr("tensor 'model.nothing.weight': not in the file"));
  }
}

TEST(SafetensorsFile, UnreadablePathsAreIoErrors) {
  const std::string missing = path_of("no_such_file.safetensors");
  Error e = testing::expect_error([&] { (void)SafetensorsFile::open(missing); });
  EXPECT_EQ(e.code(), ErrorCode::kIo);
  EXPECT_THAT(e.what(), HasSubstr(missing + ": cannot open: No such file or directory"));
  const std::string dir = files().dir().string();
  e = testing::expect_error([&] { (void)SafetensorsFile::open(dir); });
  EXPECT_EQ(e.code(), ErrorCode::kIo);
  EXPECT_THAT(e.what(), HasSubstr(dir + ": not a regular file"));
}

TEST(SafetensorsFile, MovesKeepTheMapAlive) {
  auto a = SafetensorsFile::open(path_of("model.safetensors"));
  const auto want = read_bin("down_proj.codes.bin");
  SafetensorsFile b = std::move(a);
  EXPECT_EQ(as_u8(b.bytes(kDown + ".weight")), want);
  auto c = SafetensorsFile::open(path_of("empty.safetensors"));
  c = std::move(b);
  EXPECT_EQ(as_u8(c.bytes(kDown + ".weight")), want);
  EXPECT_TRUE(c.contains(kDown + ".weight"));
  EXPECT_FALSE(mapped_or_open(path_of("empty.safetensors")));  // replaced, so unmapped
}

TEST(SafetensorsFile, NothingStaysMappedOrOpen) {
  const std::string good = path_of("model.safetensors");
  {
    const auto f = SafetensorsFile::open(good);
    EXPECT_TRUE(mapped_or_open(good));  // the check sees a live map
  }
  EXPECT_FALSE(mapped_or_open(good));
  for (const char* name :
       {"truncated.safetensors", "header_past_end.safetensors", "invalid_json.safetensors",
        "overlap.safetensors", "non_utf8_name.safetensors", "size_mismatch.safetensors",
        "trailing.safetensors"}) {
    const std::string path = path_of(name);
    (void)testing::expect_error([&] { (void)SafetensorsFile::open(path); });
    EXPECT_FALSE(mapped_or_open(path)) << name;
  }
}

// ---- in memory (from_bytes) ----

std::vector<std::byte> file_bytes(std::string_view name) {
  const auto b = read_bin(name);
  std::vector<std::byte> out(b.size());
  for (std::size_t i = 0; i < b.size(); ++i) out[i] = std::byte{b[i]};
  return out;
}

TEST(SafetensorsFromBytes, ReadsWhatOpenReadsFromItsOwnCopy) {
  const auto mapped = SafetensorsFile::open(path_of("model.safetensors"));
  std::vector<std::byte> bytes = file_bytes("model.safetensors");
  const auto f = SafetensorsFile::from_bytes("in-memory model", bytes);
  std::fill(bytes.begin(), bytes.end(), std::byte{0xFF});  // the caller's buffer may change
  bytes = {};                                              // or go
  EXPECT_EQ(f.path(), "in-memory model");
  EXPECT_EQ(f.names(), mapped.names());
  EXPECT_EQ(f.metadata(), mapped.metadata());
  for (const std::string& name : f.names()) {
    EXPECT_EQ(as_u8(f.bytes(name)), as_u8(mapped.bytes(name))) << name;
  }
  EXPECT_EQ(linear_layers(f), linear_layers(mapped));
  EXPECT_EQ(load_nvfp4_linear(f, kDown).w.codes, read_bin("down_proj.codes.bin"));
}

TEST(SafetensorsFromBytes, MovesKeepTheCopyAlive) {
  auto a = SafetensorsFile::from_bytes("a", file_bytes("model.safetensors"));
  SafetensorsFile b = std::move(a);
  auto c = SafetensorsFile::from_bytes("c", file_bytes("empty.safetensors"));
  c = std::move(b);
  EXPECT_EQ(as_u8(c.bytes(kDown + ".weight")), read_bin("down_proj.codes.bin"));
  EXPECT_EQ(c.path(), "a");
}

TEST(SafetensorsFromBytes, MalformedBytesFailAsTheFileDoes) {
  for (const char* name :
       {"tiny.safetensors", "truncated.safetensors", "header_past_end.safetensors",
        "invalid_json.safetensors", "overlap.safetensors", "trailing.safetensors"}) {
    const std::string path = path_of(name);
    const Error from_file = testing::expect_error([&] { (void)SafetensorsFile::open(path); });
    const Error from_memory =
        testing::expect_error([&] { (void)SafetensorsFile::from_bytes(path, file_bytes(name)); });
    EXPECT_EQ(from_memory.code(), ErrorCode::kIo) << name;
    EXPECT_STREQ(from_memory.what(), from_file.what()) << name;
  }
  const Error e = testing::expect_error([] { (void)SafetensorsFile::from_bytes("none", {}); });
  EXPECT_THAT(e.what(), StartsWith("[safetensors] none: the file is 0 bytes, too short"));
}

// A tensor named ".weight" (the fuzzer's find): loadable by its header, but no layer's. Neither
// lister names the empty layer, and both loaders refuse it as an argument.
TEST(SafetensorsFromBytes, AWeightNamedOnlyDotWeightIsNoLayer) {
  for (const char* dtype : {"BF16", "F8_E4M3"}) {
    SCOPED_TRACE(dtype);
    const std::size_t bytes = dtype[0] == 'B' ? 64 : 32;
    std::string header = fmt::format(
        R"({{".weight":{{"dtype":"{}","shape":[2,16],"data_offsets":[0,{}]}}}})", dtype, bytes);
    header.resize((header.size() + 7) / 8 * 8, ' ');
    std::vector<std::byte> file(8 + header.size() + bytes, std::byte{0});
    for (int i = 0; i < 8; ++i) file[i] = std::byte(header.size() >> (8 * i) & 0xFF);
    std::memcpy(file.data() + 8, header.data(), header.size());
    const auto f = SafetensorsFile::from_bytes("dot-weight", file);
    EXPECT_TRUE(linear_layers(f).empty());
    EXPECT_TRUE(fp8_linear_layers(f).empty());
    for (const Error& e : {testing::expect_error([&] { (void)load_nvfp4_linear(f, ""); }),
                           testing::expect_error([&] { (void)load_fp8_linear(f, ""); })}) {
      EXPECT_EQ(e.code(), ErrorCode::kInvalidArgument);
      EXPECT_THAT(e.what(), StartsWith("[safetensors] dot-weight: load_"));
      EXPECT_THAT(e.what(), HasSubstr("_linear: the layer name is empty"));
    }
  }
}

// A header that is an array is refused as one, also when an object in it repeats a key (the
// duplicate scan watches the root object's members, and an array has none).
TEST(SafetensorsFromBytes, AnArrayHeaderIsNoObjectWhateverItHolds) {
  std::string header = R"([{"a": 0, "a": 0}])";
  header.resize((header.size() + 7) / 8 * 8, ' ');
  std::vector<std::byte> file(8 + header.size());
  for (int i = 0; i < 8; ++i) file[i] = std::byte(header.size() >> (8 * i) & 0xFF);
  std::memcpy(file.data() + 8, header.data(), header.size());
  const Error e = testing::expect_error([&] { (void)SafetensorsFile::from_bytes("array", file); });
  EXPECT_THAT(e.what(), HasSubstr("header is a JSON array, not an object"));
}

// ---- malformed files ----

struct Malformed {
  const char* file;      // in the generated folder
  const char* tensor;    // the tensor the message names, or "" for a file-level fault
  const char* fragment;  // the rest of the message, in part
};

void PrintTo(const Malformed& m, std::ostream* os) {
  *os << m.file;
}

class SafetensorsMalformed : public ::testing::TestWithParam<Malformed> {};

TEST_P(SafetensorsMalformed, IsAnIoErrorNamingFileAndTensor) {
  const Malformed& m = GetParam();
  const std::string path = path_of(m.file);
  const Error e = testing::expect_error([&] { (void)SafetensorsFile::open(path); });
  EXPECT_EQ(e.code(), ErrorCode::kIo);
  EXPECT_THAT(e.what(), StartsWith("[safetensors] " + path + ": "));
  if (*m.tensor) {
    EXPECT_THAT(e.what(), HasSubstr(fmt::format("tensor '{}': ", m.tensor)));
  } else {
    EXPECT_THAT(e.what(), ::testing::Not(HasSubstr("tensor '")));
  }
  EXPECT_THAT(e.what(), HasSubstr(m.fragment));
}

const Malformed kMalformed[] = {
    {"truncated.safetensors", "trunc.weight", "data_offsets [0, 64] run past the data section"},
    {"tiny.safetensors", "", "the file is 5 bytes, too short for the 8-byte header length"},
    {"header_past_end.safetensors", "", "runs past the end of the file"},
    {"header_absurd.safetensors", "", "header length 1099511627776 is over the limit"},
    {"invalid_json.safetensors", "", "header is not valid JSON"},
    {"empty_header.safetensors", "", "header is not valid JSON"},
    {"not_object.safetensors", "", "header is a JSON array, not an object"},
    {"entry_not_object.safetensors", "bad.entry", "entry is a JSON number, not an object"},
    {"unknown_dtype.safetensors", "odd.dtype", "unknown dtype 'Q4'"},
    {"dtype_not_string.safetensors", "num.dtype", "dtype is a JSON number, not a string"},
    {"no_offsets.safetensors", "no.offsets", "entry has no data_offsets"},
    {"no_shape.safetensors", "no.shape", "entry has no shape"},
    {"negative_shape.safetensors", "neg.shape", "shape [-2] is not a list of non-negative"},
    {"float_shape.safetensors", "float.shape", "shape [2.5] is not a list of non-negative"},
    {"shape_not_list.safetensors", "flat.shape", "shape is a JSON number, not a list"},
    {"huge_shape.safetensors", "huge.shape", "has too many elements"},
    {"size_mismatch.safetensors", "size.mismatch",
     "dtype F32 shape [4] is 16 bytes, but data_offsets [0, 12] hold 12"},
    {"f4_odd.safetensors", "odd.f4", "3 elements of F4 do not fill whole bytes"},
    {"reversed_offsets.safetensors", "rev.offsets", "data_offsets [8, 0] end before they begin"},
    {"bad_offsets.safetensors", "bad.offsets", "is not a list of two non-negative integers"},
    {"overlap.safetensors", "second.weight",
     "data_offsets [8, 24] overlap tensor 'first.weight' [0, 16]"},
    {"out_of_range.safetensors", "far.weight",
     "data_offsets [0, 1000] run past the data section (16 bytes)"},
    {"gap.safetensors", "after.gap", "leave bytes [8, 16) of the data section to no tensor"},
    {"trailing.safetensors", "short.weight",
     "the last tensor ends at byte 8 of the 16-byte data section"},
    {"non_utf8_name.safetensors", "bad\\xFF.weight", "name is not valid UTF-8"},
    {"non_utf8_dtype.safetensors", "ok.name", "string 'U\\xC3(8' in its entry is not valid UTF-8"},
    {"duplicate.safetensors", "dup.weight", "appears twice in the header"},
    {"duplicate_key.safetensors", "twice.dtype", "key 'dtype' appears twice in its entry"},
    {"metadata_not_string.safetensors", "", "__metadata__ 'layers' is a JSON number, not a string"},
    {"metadata_not_object.safetensors", "", "__metadata__ is a JSON string, not an object"},
};

std::string case_name(const ::testing::TestParamInfo<Malformed>& info) {
  const std::string s = info.param.file;
  return s.substr(0, s.find('.'));
}

INSTANTIATE_TEST_SUITE_P(Files, SafetensorsMalformed, ::testing::ValuesIn(kMalformed), case_name);

// ---- NVFP4 layers ----

TEST(SafetensorsNvfp4, LoadsAModelOptLayerAsWritten) {
  const auto f = SafetensorsFile::open(path_of("model.safetensors"));
  const Nvfp4Linear l = load_nvfp4_linear(f, kDown);
  EXPECT_EQ(l.source_dtype, "U8");
  EXPECT_EQ(l.w.format, WeightFormat::kNvfp4);
  EXPECT_EQ(l.w.layout, WeightLayout::kRowMajor);
  EXPECT_EQ(l.w.n, 8);
  EXPECT_EQ(l.w.k, 64);
  EXPECT_EQ(l.w.codes, read_bin("down_proj.codes.bin"));
  EXPECT_EQ(l.w.scales, read_bin("down_proj.scales.bin"));
  EXPECT_EQ(l.w.tensor_scale, 0.0123f);
  ASSERT_TRUE(l.input_scale.has_value());
  EXPECT_EQ(*l.input_scale, 0.75f);
  // Python's dequantization (ModelOpt's nibble order, E4M3 and E2M1 decoded there).
  const std::vector<float> want = read_f32("down_proj.dequant.bin");
  const std::vector<float> got = dequantize(l.w);
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_EQ(got[i], want[i]) << "element " << i;
}

TEST(SafetensorsNvfp4, TensorScaleOfShapeOneAndNoInputScale) {
  const auto f = SafetensorsFile::open(path_of("model.safetensors"));
  const Nvfp4Linear l = load_nvfp4_linear(f, kUp);
  EXPECT_EQ(l.w.n, 4);
  EXPECT_EQ(l.w.k, 32);
  EXPECT_EQ(l.w.tensor_scale, 2.5f);
  EXPECT_FALSE(l.input_scale.has_value());
  EXPECT_EQ(l.w.codes.size(), 4u * 16);
  EXPECT_EQ(l.w.scales.size(), 4u * 2);
}

void expect_same(const HostQuantWeights& got, const HostQuantWeights& want) {
  EXPECT_EQ(got.format, want.format);
  EXPECT_EQ(got.layout, want.layout);
  EXPECT_EQ(got.n, want.n);
  EXPECT_EQ(got.k, want.k);
  EXPECT_EQ(got.codes, want.codes);
  EXPECT_EQ(got.scales, want.scales);
  EXPECT_EQ(got.tensor_scale, want.tensor_scale);
}

TEST(SafetensorsNvfp4, QuantizesABf16LayerOnLoad) {
  const auto f = SafetensorsFile::open(path_of("model.safetensors"));
  const Nvfp4Linear l = load_nvfp4_linear(f, kOProj);
  EXPECT_EQ(l.source_dtype, "BF16");
  EXPECT_FALSE(l.input_scale.has_value());
  const auto bits = read_bin("o_proj.bf16.bin");
  std::vector<float> w(bits.size() / 2);
  for (std::size_t i = 0; i < w.size(); ++i) {
    w[i] = num::bf16_to_f32(static_cast<std::uint16_t>(bits[2 * i] | bits[2 * i + 1] << 8));
  }
  expect_same(l.w, quantize_nvfp4(w, 6, 48));
}

TEST(SafetensorsNvfp4, QuantizesAnF32LayerOnLoad) {
  const auto f = SafetensorsFile::open(path_of("model.safetensors"));
  const Nvfp4Linear l = load_nvfp4_linear(f, kQProj);
  EXPECT_EQ(l.source_dtype, "F32");
  expect_same(l.w, quantize_nvfp4(read_f32("q_proj.f32.bin"), 4, 32));
}

TEST(SafetensorsNvfp4, ListsTheLoadableLayers) {
  const auto model = SafetensorsFile::open(path_of("model.safetensors"));
  EXPECT_THAT(linear_layers(model), ElementsAre(kDown, kUp, kOProj, kQProj));  // not the norm
  // Of the bad layers, those whose header is fine (their data is not).
  const auto bad = SafetensorsFile::open(path_of("bad_layers.safetensors"));
  EXPECT_THAT(linear_layers(bad), ElementsAre("inf_weight", "nan_scale", "neg_scale2"));
  EXPECT_TRUE(linear_layers(SafetensorsFile::open(path_of("empty.safetensors"))).empty());
}

// The source from the header alone is the one a load gives, and reads nothing: a layer whose
// values a load refuses (an inf weight, a NaN block scale) still has its source.
TEST(SafetensorsNvfp4, TheSourceComesFromTheHeaderAlone) {
  const auto model = SafetensorsFile::open(path_of("model.safetensors"));
  for (const std::string& layer : linear_layers(model)) {
    EXPECT_EQ(linear_layer_source(model, layer), load_nvfp4_linear(model, layer).source) << layer;
  }
  const auto bad = SafetensorsFile::open(path_of("bad_layers.safetensors"));
  EXPECT_THAT(linear_layer_source(bad, "inf_weight"), HasSubstr("quantized to NVFP4 on load"));
  EXPECT_EQ(linear_layer_source(bad, "nan_scale"), "ModelOpt NVFP4");
  EXPECT_THROW((void)load_nvfp4_linear(bad, "inf_weight"), Error);
  EXPECT_THROW((void)load_nvfp4_linear(bad, "nan_scale"), Error);
  EXPECT_EQ(testing::expect_error([&] { (void)linear_layer_source(model, "nope"); }).code(),
            ErrorCode::kNotFound);
}

struct BadLayer {
  const char* layer;
  ErrorCode code;
  const char* tensor;
  const char* fragment;
};

void PrintTo(const BadLayer& b, std::ostream* os) {
  *os << b.layer;
}

class SafetensorsBadLayer : public ::testing::TestWithParam<BadLayer> {};

TEST_P(SafetensorsBadLayer, FailsNamingFileAndTensor) {
  const BadLayer& b = GetParam();
  const std::string path = path_of("bad_layers.safetensors");
  const auto f = SafetensorsFile::open(path);
  const Error e = testing::expect_error([&] { (void)load_nvfp4_linear(f, b.layer); });
  EXPECT_EQ(e.code(), b.code) << e.what();
  EXPECT_THAT(e.what(), StartsWith(fmt::format("[safetensors] {}: tensor '{}': ", path, b.tensor)));
  EXPECT_THAT(e.what(), HasSubstr(b.fragment));
}

const BadLayer kBadLayers[] = {
    {"scale_dtype", ErrorCode::kIo, "scale_dtype.weight_scale",
     "dtype is F32, but NVFP4 block scales must be F8_E4M3"},
    {"scale_shape", ErrorCode::kIo, "scale_shape.weight_scale",
     "shape is [4, 2], but weights U8 [4, 8] (N = 4, K = 16) need [4, 1]"},
    {"scale2_shape", ErrorCode::kIo, "scale2_shape.weight_scale_2",
     "shape is [2], but the NVFP4 tensor scale must be a scalar"},
    {"scale2_dtype", ErrorCode::kIo, "scale2_dtype.weight_scale_2",
     "dtype is BF16, but the NVFP4 tensor scale must be F32"},
    {"odd_k", ErrorCode::kIo, "odd_k.weight", "K = 2 x 4 is not a multiple of 16"},
    {"rank3", ErrorCode::kIo, "rank3.weight",
     "shape is [2, 4, 8], but NVFP4 codes (U8) must be a non-empty [N, K/2]"},
    {"no_scale", ErrorCode::kNotFound, "no_scale.weight_scale",
     "not in the file, but NVFP4 weights 'no_scale.weight' (U8) need it"},
    {"no_scale2", ErrorCode::kNotFound, "no_scale2.weight_scale_2", "not in the file"},
    {"f16", ErrorCode::kIo, "f16.weight", "dtype F16 cannot be loaded as NVFP4"},
    {"bf16_odd_k", ErrorCode::kIo, "bf16_odd_k.weight",
     "shape is [4, 24], but BF16 weights must be [N, K] with K a positive multiple of 16"},
    {"bf16_with_scale", ErrorCode::kIo, "bf16_with_scale.weight_scale",
     "is present, but weights 'bf16_with_scale.weight' are BF16, not NVFP4 codes"},
    {"input_dtype", ErrorCode::kIo, "input_dtype.input_scale",
     "dtype is BF16, but the input scale must be F32"},
    {"input_shape", ErrorCode::kIo, "input_shape.input_scale",
     "shape is [1, 1], but the input scale must be a scalar"},
    {"nan_scale", ErrorCode::kIo, "nan_scale.weight_scale", "block scale [1, 0] is NaN (0x7F)"},
    {"neg_scale2", ErrorCode::kIo, "neg_scale2.weight_scale_2",
     "value -1 is not a finite non-negative scale"},
    {"inf_weight", ErrorCode::kIo, "inf_weight.weight", "weight [1, 3] = inf is not finite"},
    {"missing", ErrorCode::kNotFound, "missing.weight", "not in the file"},
};

std::string layer_name(const ::testing::TestParamInfo<BadLayer>& info) {
  return info.param.layer;
}

INSTANTIATE_TEST_SUITE_P(Layers, SafetensorsBadLayer, ::testing::ValuesIn(kBadLayers), layer_name);

// Each bad layer whose header is wrong is a rejected candidate, with the tensor and the reason
// load_nvfp4_linear gives for it; those whose header is fine are listed as loadable.
TEST(SafetensorsNvfp4, ScanNamesEachRejectedTensorAndWhy) {
  const auto f = SafetensorsFile::open(path_of("bad_layers.safetensors"));
  const LinearLayerScan scan = scan_linear_layers(f);
  EXPECT_THAT(scan.layers, ElementsAre("inf_weight", "nan_scale", "neg_scale2"));
  std::map<std::string, const RejectedLayer*> rejected;
  for (const RejectedLayer& r : scan.rejected) rejected[r.layer] = &r;
  std::size_t expected = 0;
  for (const BadLayer& b : kBadLayers) {
    const std::string layer = b.layer;
    if (layer == "missing" || std::count(scan.layers.begin(), scan.layers.end(), layer) != 0) {
      continue;  // no "missing.weight" to scan; the others are loadable by their header
    }
    ++expected;
    ASSERT_TRUE(rejected.contains(layer)) << layer;
    EXPECT_EQ(rejected[layer]->tensor, b.tensor) << layer;
    EXPECT_EQ(rejected[layer]->code, b.code) << layer;
    EXPECT_THAT(rejected[layer]->why, HasSubstr(b.fragment)) << layer;
  }
  EXPECT_EQ(scan.rejected.size(), expected);
  EXPECT_EQ(expected, 13u);
  // Sorted by layer.
  for (std::size_t i = 1; i < scan.rejected.size(); ++i) {
    EXPECT_LT(scan.rejected[i - 1].layer, scan.rejected[i].layer);
  }
}

TEST(SafetensorsNvfp4, RequireLinearLayersGivesTheLoadableLayers) {
  const auto model = SafetensorsFile::open(path_of("model.safetensors"));
  EXPECT_THAT(require_linear_layers(model), ElementsAre(kDown, kUp, kOProj, kQProj));
}

// A file none of whose layers loads is malformed input (kIo), and the error says, for each
// candidate, which tensor was rejected and why.
TEST(SafetensorsNvfp4, NoLoadableLayerNamesEachRejectedTensorAndWhy) {
  const std::string path = path_of("no_loadable_layers.safetensors");
  const auto f = SafetensorsFile::open(path);
  const Error e = testing::expect_error([&] { (void)require_linear_layers(f); });
  EXPECT_EQ(e.code(), ErrorCode::kIo) << e.what();
  const std::string what = e.what();
  EXPECT_THAT(what, StartsWith(fmt::format("[safetensors] {}: holds no linear layer metrale can "
                                           "load; each of its 5 candidate(s) was rejected:",
                                           path)));
  EXPECT_THAT(what, HasSubstr("\n  tensor 'f16.weight': dtype F16 cannot be loaded as NVFP4"));
  EXPECT_THAT(what, HasSubstr("\n  tensor 'norm.weight': shape is [64], but BF16 weights must be "
                              "[N, K] with K a positive multiple of 16"));
  EXPECT_THAT(what, HasSubstr("\n  tensor 'odd_k.weight': shape is [4, 4]: K = 2 x 4 is not a "
                              "multiple of 16"));
  EXPECT_THAT(what, HasSubstr("\n  tensor 'scale2_dtype.weight_scale_2': dtype is BF16, but the "
                              "NVFP4 tensor scale must be F32"));
  EXPECT_THAT(what, HasSubstr("\n  tensor 'scale_shape.weight_scale': shape is [4, 2], but "
                              "weights U8 [4, 8] (N = 4, K = 16) need [4, 1]"));
}

TEST(SafetensorsNvfp4, NoCandidateAtAllSaysSo) {
  const std::string path = path_of("empty.safetensors");
  const auto f = SafetensorsFile::open(path);
  const Error e = testing::expect_error([&] { (void)require_linear_layers(f); });
  EXPECT_EQ(e.code(), ErrorCode::kIo) << e.what();
  EXPECT_THAT(e.what(), StartsWith(fmt::format("[safetensors] {}: holds no linear layer metrale "
                                               "can load: no tensor is named '<layer>.weight'",
                                               path)));
}

}  // namespace
}  // namespace metrale

// Fuzz target: the safetensors reader (include/metrale/safetensors.h) and the ModelOpt loader
// (metrale/modelopt.h) on a whole file's bytes, through SafetensorsFile::from_bytes (the
// validation open() runs on a mapped file), then linear_layers and load_nvfp4_linear over every
// layer the header names, and fp8_linear_layers and load_fp8_linear over every FP8 layer.
//
// Invariants (any break is __builtin_trap(), so libFuzzer keeps the input):
//  - every failure is a metrale::Error of the documented kind whose message names the file:
//    "[safetensors] fuzz.safetensors: ..." (kIo for a malformed file, kNotFound for a missing
//    tensor); no other exception type escapes;
//  - an accepted file is what the format says: the header length fits, each tensor's byte size
//    is its shape times its dtype width, the tensors tile the data section exactly, and
//    bytes(name) views exactly those bytes of the input (also after the file is moved);
//  - linear_layers lists exactly the layers load_nvfp4_linear accepts by their header: loading
//    a listed layer fails only for a value (kIo: NaN block scale, non-finite weight or scale),
//    and loading any other "<layer>.weight" fails; a loaded layer has the sizes its shape says;
//  - fp8_linear_layers lists every F8_E4M3 "<layer>.weight"; an FP8 layer loads as a view of
//    the file's bytes with finite, non-negative scales and no NaN code, or fails with kIo.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "metrale/e4m3_block.h"
#include "metrale/error.h"
#include "metrale/fp8_checkpoint.h"
#include "metrale/modelopt.h"
#include "metrale/quant.h"
#include "metrale/safetensors.h"

namespace {

using metrale::Error;
using metrale::ErrorCode;
using metrale::SafetensorsFile;

using u128 = unsigned __int128;

constexpr std::string_view kName = "fuzz.safetensors";
constexpr u128 kSaturated = u128{1} << 64;

void require(bool ok) {
  if (!ok) __builtin_trap();
}

// Every error of the reader names the API and the file first.
void require_named(const Error& e) {
  require(std::string_view(e.what()).starts_with("[safetensors] fuzz.safetensors: "));
}

// Element width in bits, from the format's dtype list (0: not a dtype).
unsigned bits_of(std::string_view dtype) {
  static constexpr std::pair<std::string_view, unsigned> kBits[] = {
      {"BOOL", 8},    {"U8", 8},          {"I8", 8},          {"F8_E5M2", 8}, {"F8_E4M3", 8},
      {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8}, {"I16", 16},    {"U16", 16},
      {"F16", 16},    {"BF16", 16},       {"I32", 32},        {"U32", 32},    {"F32", 32},
      {"I64", 64},    {"U64", 64},        {"F64", 64},        {"C64", 64},    {"F4", 4},
      {"F6_E2M3", 6}, {"F6_E3M2", 6},
  };
  for (const auto& [name, bits] : kBits) {
    if (name == dtype) return bits;
  }
  return 0;
}

// What the header promises about each tensor, checked against the input bytes.
void check_file(const SafetensorsFile& f, std::span<const std::byte> input) {
  require(f.path() == kName);
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = header_len << 8 | std::to_integer<unsigned>(input[i]);
  require(header_len <= input.size() - 8);
  const std::span<const std::byte> data = input.subspan(8 + header_len);

  const std::vector<std::string> names = f.names();
  require(std::is_sorted(names.begin(), names.end()));
  require(std::adjacent_find(names.begin(), names.end()) == names.end());
  std::vector<std::pair<std::uint64_t, std::uint64_t>> ranges;
  for (const std::string& name : names) {
    require(name != "__metadata__" && f.contains(name));
    const metrale::SafetensorsTensorInfo& info = f.info(name);
    const unsigned bits = bits_of(info.dtype);
    require(bits != 0);
    u128 elements = 1;
    for (const std::int64_t d : info.shape) {
      require(d >= 0);
      elements *= static_cast<std::uint64_t>(d);
      elements = std::min(elements, kSaturated);  // the reader refuses these anyway
    }
    const std::int64_t counted = info.elements();
    require(counted >= 0 && static_cast<u128>(counted) == elements);
    require(elements * bits % 8 == 0 && elements * bits / 8 == info.bytes);
    const std::span<const std::byte> view = f.bytes(name);
    require(view.size() == info.bytes && info.offset + info.bytes <= data.size());
    require(std::equal(view.begin(), view.end(), data.begin() + info.offset));
    ranges.emplace_back(info.offset, info.bytes);
  }
  // The tensors tile the data section.
  std::sort(ranges.begin(), ranges.end());
  std::uint64_t covered = 0;
  for (const auto& [offset, bytes] : ranges) {
    require(offset == covered);
    covered += bytes;
  }
  require(covered == data.size());

  try {
    (void)f.info("\x01 not a tensor");
    require(false);
  } catch (const Error& e) {
    require(e.code() == ErrorCode::kNotFound);
    require_named(e);
  }
}

void check_layers(const SafetensorsFile& f) {
  const std::vector<std::string> layers = metrale::linear_layers(f);
  require(std::is_sorted(layers.begin(), layers.end()));
  for (const std::string& name : f.names()) {
    if (!name.ends_with(".weight")) continue;
    const std::string layer = name.substr(0, name.size() - 7);
    const bool listed = std::binary_search(layers.begin(), layers.end(), layer);
    try {
      const metrale::Nvfp4Linear l = metrale::load_nvfp4_linear(f, layer);
      require(listed);
      const metrale::HostQuantWeights& w = l.w;
      require(w.format == metrale::WeightFormat::kNvfp4 && w.n > 0 && w.k > 0 && w.k % 16 == 0);
      require(w.codes.size() ==
              static_cast<std::uint64_t>(w.n) * static_cast<std::uint64_t>(w.k) / 2);
      require(w.scales.size() ==
              static_cast<std::uint64_t>(w.n) * static_cast<std::uint64_t>(w.k) / 16);
      require(std::isfinite(w.tensor_scale) && w.tensor_scale >= 0.0f);
      require(!l.input_scale || std::isfinite(*l.input_scale));
      require(l.source_dtype == f.info(name).dtype);
    } catch (const Error& e) {
      require_named(e);
      // A listed layer passed every header check: only its values can be wrong.
      require(!listed || e.code() == ErrorCode::kIo);
      // ".weight" names no layer: refused as an argument, and never listed.
      require(layer.empty() ? e.code() == ErrorCode::kInvalidArgument
                            : e.code() == ErrorCode::kIo || e.code() == ErrorCode::kNotFound);
    }
  }
}

// fp8_linear_layers lists every F8_E4M3 "<layer>.weight"; load_fp8_linear of a listed layer
// either fails with a named kIo or views the file's bytes with the sizes its shape says, every
// scale finite and >= 0 and no code NaN.
void check_fp8_layers(const SafetensorsFile& f) {
  const std::vector<std::string> layers = metrale::fp8_linear_layers(f);
  require(std::is_sorted(layers.begin(), layers.end()));
  for (const std::string& name : f.names()) {
    if (!name.ends_with(".weight") || f.info(name).dtype != "F8_E4M3") continue;
    if (name.size() == 7) {  // ".weight": no layer's, so neither listed nor loaded
      require(layers.empty() || !layers.front().empty());
      try {
        (void)metrale::load_fp8_linear(f, "");
        require(false);
      } catch (const Error& e) {
        require(e.code() == ErrorCode::kInvalidArgument);
        require_named(e);
      }
      continue;
    }
    require(std::binary_search(layers.begin(), layers.end(), name.substr(0, name.size() - 7)));
  }
  for (const std::string& layer : layers) {
    try {
      const metrale::E4m3BlockWeightsView w = metrale::load_fp8_linear(f, layer);
      require(w.n > 0 && w.k > 0);
      require(w.codes.data() ==
              reinterpret_cast<const std::uint8_t*>(f.bytes(layer + ".weight").data()));
      require(w.codes.size() == static_cast<std::uint64_t>(w.n) * static_cast<std::uint64_t>(w.k));
      require(w.scales.size() ==
              static_cast<std::uint64_t>(metrale::e4m3_blocks(w.n) * metrale::e4m3_blocks(w.k)));
      for (const float s : w.scales) require(std::isfinite(s) && s >= 0.0f);
      for (const std::uint8_t c : w.codes) require((c & 0x7F) != 0x7F);
    } catch (const Error& e) {
      require(e.code() == ErrorCode::kIo);
      require_named(e);
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> input(reinterpret_cast<const std::byte*>(data), size);
  try {
    std::optional<SafetensorsFile> f;
    try {
      f.emplace(SafetensorsFile::from_bytes(std::string(kName), input));
    } catch (const Error& e) {
      require(e.code() == ErrorCode::kIo);
      require_named(e);
      return 0;
    }
    SafetensorsFile moved = std::move(*f);  // views must survive the move of the owner
    f.reset();
    check_file(moved, input);
    check_layers(moved);
    check_fp8_layers(moved);
  } catch (...) {
    __builtin_trap();  // a non-Error exception, or an Error where none is allowed
  }
  return 0;
}

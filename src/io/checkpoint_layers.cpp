#include "metrale/checkpoint_layers.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <utility>

#include "metrale/error.h"

namespace metrale {
namespace {

// Bytes per element of a safetensors dtype, for ordering (1 for anything narrower or unknown).
int element_bytes(std::string_view dtype) {
  if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
  if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
  if (dtype == "BF16" || dtype == "F16" || dtype == "I16" || dtype == "U16") return 2;
  return 1;
}

}  // namespace

std::vector<std::string> tensor_prefixes(const ShardedCheckpoint& ckpt) {
  std::vector<std::string> out;
  for (const std::string& name : ckpt.names()) {
    const std::size_t dot = name.rfind('.');
    out.push_back(dot == std::string::npos ? name : name.substr(0, dot));
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

SafetensorsFile gather_layer(const ShardedCheckpoint& ckpt, std::string_view prefix) {
  std::vector<std::string> names;
  for (const std::string& name : ckpt.names()) {
    const std::size_t dot = name.rfind('.');
    const std::string_view p =
        dot == std::string::npos ? std::string_view(name) : std::string_view(name).substr(0, dot);
    if (p == prefix) names.push_back(name);
  }
  if (names.empty()) {
    throw Error(ErrorCode::kNotFound, "safetensors",
                fmt::format("{}: no tensor is named '{}.<name>'", ckpt.index_path(), prefix));
  }
  // Widest elements first, from an 8-aligned data section: every tensor starts aligned to its
  // element, and the tensors fill the section without a gap (the reader refuses holes).
  std::stable_sort(names.begin(), names.end(), [&](const std::string& a, const std::string& b) {
    return element_bytes(ckpt.info(a).dtype) > element_bytes(ckpt.info(b).dtype);
  });
  nlohmann::json header = nlohmann::json::object();
  std::vector<std::byte> data;
  for (const std::string& name : names) {
    const SafetensorsTensorInfo& info = ckpt.info(name);
    const std::vector<std::byte> bytes = ckpt.read(name);
    header[name] = {{"dtype", info.dtype},
                    {"shape", info.shape},
                    {"data_offsets", {data.size(), data.size() + bytes.size()}}};
    data.insert(data.end(), bytes.begin(), bytes.end());
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::vector<std::byte> file(8 + text.size() + data.size());
  const auto length = static_cast<std::uint64_t>(text.size());
  for (int i = 0; i < 8; ++i)
    file[static_cast<std::size_t>(i)] = std::byte((length >> (8 * i)) & 0xFF);
  std::memcpy(file.data() + 8, text.data(), text.size());
  if (!data.empty()) std::memcpy(file.data() + 8 + text.size(), data.data(), data.size());
  return SafetensorsFile::from_bytes(ckpt.index_path(), file);
}

std::string resolve_checkpoint_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (!fs::is_directory(path, ec)) return path;
  for (const char* name : {"model.safetensors.index.json", "model.safetensors"}) {
    const fs::path candidate = fs::path(path) / name;
    if (fs::exists(candidate, ec)) return candidate.string();
  }
  throw Error(ErrorCode::kNotFound, "safetensors",
              fmt::format("{}: the folder holds neither model.safetensors.index.json nor "
                          "model.safetensors",
                          path));
}

bool is_checkpoint_index(std::string_view path) {
  return path.ends_with(".index.json");
}

}  // namespace metrale

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

std::string_view module_of(std::string_view name) noexcept {
  const std::size_t dot = name.rfind('.');
  return dot == std::string_view::npos ? std::string_view() : name.substr(0, dot);
}

std::vector<std::string> tensor_prefixes(const ShardedCheckpoint& ckpt) {
  std::vector<std::string> out;
  for (const std::string& name : ckpt.names()) out.emplace_back(module_of(name));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

SafetensorsFile gather_layer(const ShardedCheckpoint& ckpt, std::string_view prefix) {
  // Once per module when a checkpoint is scanned: a pass over every name each time was
  // quadratic (11.5 ms a call at 74,496 tensors, 214 s for the scan; a review's measure).
  std::vector<std::string> names =
      prefix.empty() ? ckpt.names() : ckpt.names_with_prefix(fmt::format("{}.", prefix));
  std::erase_if(names, [&](const std::string& name) { return module_of(name) != prefix; });
  if (names.empty()) {
    throw Error(ErrorCode::kNotFound, "safetensors",
                fmt::format("{}: no tensor is named '{}.<name>'", ckpt.index_path(), prefix));
  }
  std::vector<OwnedTensor> tensors;
  for (const std::string& name : names) {
    const SafetensorsTensorInfo& info = ckpt.info(name);
    tensors.push_back(OwnedTensor{name, info.dtype, info.shape, ckpt.read(name)});
  }
  return in_memory_safetensors(ckpt.index_path(), std::move(tensors));
}

SafetensorsFile in_memory_safetensors(std::string name, std::vector<OwnedTensor> tensors) {
  // Widest elements first, from an 8-aligned data section: every tensor starts aligned to its
  // element, and the tensors fill the section without a gap (the reader refuses holes).
  std::stable_sort(tensors.begin(), tensors.end(), [](const OwnedTensor& a, const OwnedTensor& b) {
    return element_bytes(a.dtype) > element_bytes(b.dtype);
  });
  nlohmann::json header = nlohmann::json::object();
  std::size_t size = 0;
  for (const OwnedTensor& t : tensors) {
    header[t.name] = {
        {"dtype", t.dtype}, {"shape", t.shape}, {"data_offsets", {size, size + t.bytes.size()}}};
    size += t.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');
  std::vector<std::byte> file(8 + text.size() + size);
  const auto length = static_cast<std::uint64_t>(text.size());
  for (std::size_t i = 0; i < 8; ++i) file[i] = std::byte((length >> (8 * i)) & 0xFF);
  std::memcpy(file.data() + 8, text.data(), text.size());
  std::size_t at = 8 + text.size();
  for (const OwnedTensor& t : tensors) {
    if (!t.bytes.empty()) std::memcpy(file.data() + at, t.bytes.data(), t.bytes.size());
    at += t.bytes.size();
  }
  return SafetensorsFile::from_bytes(std::move(name), file);
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

// A sharded checkpoint's layers for the single-file loaders (metrale/modelopt.h,
// metrale/fp8_checkpoint.h): each layer's tensors, whichever shards hold them, read into one
// in-memory safetensors view, so that a layer whose scale lies in another shard than its weight
// loads as it would from one file, and a model folder is read layer by layer, never more than
// one layer's bytes at a time beyond what the caller keeps.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/safetensors.h"
#include "metrale/sharded_checkpoint.h"

namespace metrale {

// One tensor of an in-memory safetensors file: its name, dtype, shape and little-endian bytes.
struct OwnedTensor {
  std::string name, dtype;
  std::vector<std::int64_t> shape;
  std::vector<std::byte> bytes;
};

// An in-memory safetensors file named `name` (for messages) holding `tensors`, validated as
// SafetensorsFile::from_bytes validates any file. Throws Error(kIo) as it does.
SafetensorsFile in_memory_safetensors(std::string name, std::vector<OwnedTensor> tensors);

// The module a tensor name belongs to: the name up to its last '.' ("a.b.weight" -> "a.b"), or
// "" for a name without one (gpt-oss's packed "gate_up_proj_blocks" and "_scales" at the top
// level are one module's, as in a single file).
std::string_view module_of(std::string_view name) noexcept;

// The modules of a checkpoint's tensor names (module_of), sorted, each once.
std::vector<std::string> tensor_prefixes(const ShardedCheckpoint& ckpt);

// Every tensor of module `prefix` (module_of is prefix), read from its shard into one in-memory
// safetensors file named after the index (messages then name the index and the tensor). Finds
// them among the names under "<prefix>." (no pass over every name but for prefix ""). Throws as
// ShardedCheckpoint::read; Error(kNotFound) when no tensor has the prefix.
SafetensorsFile gather_layer(const ShardedCheckpoint& ckpt, std::string_view prefix);

// The safetensors file `path` names, or the checkpoint a folder holds: "<dir>" is
// "<dir>/model.safetensors.index.json" where that exists, else "<dir>/model.safetensors". Returns
// the path unchanged for anything else; Error(kNotFound) naming the folder when it holds neither.
std::string resolve_checkpoint_path(const std::string& path);

// Whether `path` is a sharded checkpoint's index (its name ends in ".index.json").
bool is_checkpoint_index(std::string_view path);

}  // namespace metrale

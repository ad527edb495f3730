// Hugging Face sharded safetensors checkpoints: "model.safetensors.index.json" maps every tensor
// name to the shard file that holds it ({"weight_map": {"<tensor>": "<shard>", ...}}, shard names
// relative to the index's folder). ShardedCheckpoint checks the index and every shard's header
// up front, then reads tensors, or one tensor-parallel rank's slice of one, with pread of the
// bytes it needs: a rank of 4 reads a quarter of a weight, never a whole shard. Nothing is
// mapped, so what a rank reads is what it asked for (no readahead of its neighbours' rows) and
// bytes_read() can count it.
//
// Every failure is an Error worded as the single-file reader's are (metrale/safetensors.h):
// "[safetensors] <file>: tensor '<name>': ...", naming the index or shard file and the tensor.
// kIo for a malformed or inconsistent checkpoint, kNotFound for a missing tensor,
// kInvalidArgument for a slice or split the caller got wrong.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/quant.h"
#include "metrale/safetensors.h"

namespace metrale {

// One tensor-parallel slice: indices [begin, end) of a tensor along `axis` (0: the outer
// dimension; 1: the next, the inner one of a 2-D tensor), every other dimension whole.
struct TensorSlice {
  int axis = 0;
  std::int64_t begin = 0;
  std::int64_t end = 0;
};

// An opened sharded checkpoint: the index and each shard's header, validated, and one read-only
// descriptor per shard (kept so that reads see the files that were validated). Move-only; a
// moved-from checkpoint may only be assigned to or destroyed. Its const calls may run from
// several threads at once (pread, an atomic byte count).
class ShardedCheckpoint {
 public:
  // Opens `index_path` and the header of every shard it names, and checks that they agree: each
  // tensor in exactly one shard header, the one the index names, and every header tensor in the
  // index. Throws Error(kIo) naming the index or shard file and the tensor; nothing stays open
  // when it throws.
  static ShardedCheckpoint open(const std::string& index_path);

  ShardedCheckpoint(ShardedCheckpoint&& other) noexcept;
  ShardedCheckpoint& operator=(ShardedCheckpoint&& other) noexcept;
  ShardedCheckpoint(const ShardedCheckpoint&) = delete;
  ShardedCheckpoint& operator=(const ShardedCheckpoint&) = delete;
  ~ShardedCheckpoint();

  // The path it was opened with.
  const std::string& index_path() const noexcept;
  // Tensor names, sorted.
  std::vector<std::string> names() const;
  // The tensor names that start with `prefix`, sorted (a range of the sorted names).
  std::vector<std::string> names_with_prefix(std::string_view prefix) const;
  // Whether the checkpoint holds tensor `name`.
  bool contains(std::string_view name) const noexcept;
  // The path of the shard holding `name`: the index's folder joined with the index's entry;
  // Error(kNotFound).
  const std::string& file_of(std::string_view name) const;
  // The shard header's entry of `name` (offset relative to that shard's data section);
  // Error(kNotFound).
  const SafetensorsTensorInfo& info(std::string_view name) const;
  // The whole tensor's bytes (little-endian, row-major), read from its shard; Error(kNotFound),
  // Error(kIo) when the shard can no longer be read.
  std::vector<std::byte> read(std::string_view name) const;
  // Only the bytes of `slice` of tensor `name`, read from disk as one pread per contiguous run:
  // row-major, of the tensor's shape with dimension slice.axis cut to end - begin.
  // Error(kInvalidArgument) for an axis outside the tensor's rank, a range outside
  // [0, extent] or ending before it begins, or a cut that splits a byte of a sub-byte dtype;
  // Error(kNotFound), Error(kIo) as read().
  std::vector<std::byte> read_slice(std::string_view name, const TensorSlice& slice) const;
  // Data bytes read so far by read and read_slice (headers not counted): what shows that a rank
  // read only its share.
  std::uint64_t bytes_read() const noexcept;

 private:
  struct Impl;  // descriptors and tables, so the header needs no POSIX types
  explicit ShardedCheckpoint(std::unique_ptr<Impl> impl) noexcept;
  std::unique_ptr<Impl> impl_;
};

// Rank `rank`'s share of `extent` indices split over `size` ranks at multiples of `granule`:
// indices [rank·extent/size, (rank+1)·extent/size) along `axis`, equal for every rank.
// Error(kInvalidArgument) for size < 1, a rank outside [0, size), granule < 1, a negative extent
// or axis, or an extent that is not a multiple of granule × size (the message says which).
TensorSlice shard_slice(int axis, std::int64_t extent, std::int64_t granule, int rank, int size);

// One rank's slice of a linear layer's NVFP4 weights W[N, K].
struct Nvfp4LinearShard {
  HostQuantWeights w;                   // the slice, row-major: [N/size, K] or [N, K/size]
  std::optional<float> input_scale;     // "<layer>.input_scale", the whole layer's
  TensorSlice slice;                    // the weight indices held: rows (axis 0) or columns of W
  std::int64_t full_n = 0, full_k = 0;  // the whole layer's N and K
};

// Rank `rank` of `size`'s slice of NVFP4 layer `layer` (tensors named as load_nvfp4_linear in
// metrale/modelopt.h reads them; they may lie in different shards): axis 0 splits N (a
// column-parallel layer), axis 1 splits K at multiples of 16, the NVFP4 scale group (a
// row-parallel layer). Reads only the slice's codes and block scales; the tensor scale and the
// input scale are the whole layer's. Error(kNotFound) for a missing tensor; Error(kIo) for a
// dtype, a shape, weights and scales whose shapes disagree ("mismatched shapes", naming both
// tensors, their files and shapes), a NaN block scale or a bad tensor scale;
// Error(kInvalidArgument) for an empty layer name, an axis other than 0 or 1, a bad rank or size,
// or a split that does not divide N (K into multiples of 16).
Nvfp4LinearShard load_nvfp4_linear_shard(const ShardedCheckpoint& ckpt, std::string_view layer,
                                         int axis, int rank, int size);

}  // namespace metrale

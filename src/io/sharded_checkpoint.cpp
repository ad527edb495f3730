#include "metrale/sharded_checkpoint.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "io/json_keys.h"
#include "io/messages.h"
#include "metrale/error.h"
#include "metrale/numerics.h"

namespace metrale {

namespace {

using io::fail_file;
using io::fail_tensor;
using io::printable;
using io::shape_str;
using json = nlohmann::json;
namespace fs = std::filesystem;

// An index of a model with ~100k tensors is a few MiB; a bigger file is not an index (a shard
// passed by mistake), and reading it whole would be slow before failing.
constexpr std::uint64_t kMaxIndexBytes = std::uint64_t{100} << 20;
constexpr std::string_view kWeightMap = "weight_map";

// A file descriptor closed when it goes, so that no error path leaks one.
class UniqueFd {
 public:
  explicit UniqueFd(int fd) noexcept : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const noexcept { return fd_; }

 private:
  void reset() noexcept {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  int fd_;
};

UniqueFd open_read_only(const std::string& path) {
  // O_NONBLOCK: opening a FIFO would wait for a writer (forever); the caller's S_ISREG check
  // refuses it. Reads of a regular file ignore the flag.
  UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (fd.get() < 0) {
    fail_file(ErrorCode::kIo, path, fmt::format("cannot open: {}", std::strerror(errno)));
  }
  return fd;
}

// Reads up to n bytes at `offset` into out, past short reads; returns how many it read (fewer
// than n at the end of the file). On a read error returns what it read so far and sets `err`.
std::uint64_t pread_all(int fd, std::byte* out, std::uint64_t n, std::uint64_t offset, int& err) {
  err = 0;
  std::uint64_t done = 0;
  while (done < n) {
    const ::ssize_t got = ::pread(fd, out + done, static_cast<std::size_t>(n - done),
                                  static_cast<::off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0) {
      err = errno;
      break;
    }
    if (got == 0) break;
    done += static_cast<std::uint64_t>(got);
  }
  return done;
}

std::string read_index(const std::string& path) {
  const UniqueFd fd = open_read_only(path);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    fail_file(ErrorCode::kIo, path, fmt::format("cannot stat: {}", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) fail_file(ErrorCode::kIo, path, "not a regular file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > kMaxIndexBytes) {
    fail_file(ErrorCode::kIo, path,
              fmt::format("the index is {} bytes, over the limit of {} (100 MiB): is it an index?",
                          size, kMaxIndexBytes));
  }
  std::string text(static_cast<std::size_t>(size), '\0');
  int err = 0;
  const std::uint64_t got =
      pread_all(fd.get(), reinterpret_cast<std::byte*>(text.data()), size, 0, err);
  if (err != 0) fail_file(ErrorCode::kIo, path, fmt::format("cannot read: {}", std::strerror(err)));
  text.resize(static_cast<std::size_t>(got));  // a file that shrank meanwhile is read as it is
  return text;
}

// Why a shard name from the index may not be used, or nothing: it must name a file inside the
// index's folder (no absolute path, no '..'), so an index alone cannot point a reader at files
// elsewhere. A symbolic link in the folder is followed: Hugging Face's cache is made of them.
std::optional<std::string> bad_shard_name(const std::string& name) {
  if (name.empty()) return "the shard file name is empty";
  if (name.find('\0') != std::string::npos) {
    return fmt::format("shard file name '{}' holds a NUL byte", printable(name));
  }
  const fs::path p(name);
  if (p.is_absolute() || p.has_root_name() || p.has_root_directory()) {
    return fmt::format(
        "shard file '{}' is an absolute path; it must be relative to the index's "
        "folder",
        printable(name));
  }
  for (const fs::path& part : p) {
    if (part == "..") {
      return fmt::format(
          "shard file '{}' has a '..' component: it must name a file inside the "
          "index's folder",
          printable(name));
    }
  }
  return std::nullopt;
}

// "tensor 'x'" or "tensor 'x' and 3 others", for messages about a shard.
std::string tensors_of_shard(const std::vector<std::string>& names) {
  if (names.size() == 1) return fmt::format("tensor '{}'", printable(names.front()));
  return fmt::format("tensor '{}' and {} other{}", printable(names.front()), names.size() - 1,
                     names.size() == 2 ? "" : "s");
}

}  // namespace

struct ShardedCheckpoint::Impl {
  struct Shard {
    std::string path;
    UniqueFd fd;
    std::uint64_t data_start = 0;  // file offset of the data section
  };
  struct Entry {
    std::size_t shard = 0;
    SafetensorsTensorInfo info;
  };

  std::string index_path;
  std::vector<Shard> shards;
  std::map<std::string, Entry, std::less<>> tensors;
  mutable std::atomic<std::uint64_t> bytes_read{0};

  const Entry& entry(std::string_view name) const {
    const auto it = tensors.find(name);
    if (it == tensors.end()) {
      fail_tensor(ErrorCode::kNotFound, index_path, name, "not in the checkpoint");
    }
    return it->second;
  }

  // Bytes [begin, begin + n) of tensor `name`'s data into out.
  void read_range(std::string_view name, const Entry& e, std::uint64_t begin, std::uint64_t n,
                  std::byte* out) const {
    const Shard& s = shards[e.shard];
    const std::uint64_t at = s.data_start + e.info.offset + begin;
    int err = 0;
    const std::uint64_t got = pread_all(s.fd.get(), out, n, at, err);
    bytes_read.fetch_add(got, std::memory_order_relaxed);
    if (err != 0) {
      fail_tensor(ErrorCode::kIo, s.path, name,
                  fmt::format("cannot read bytes [{}, {}) of the file: {}", at, at + n,
                              std::strerror(err)));
    }
    if (got < n) {
      fail_tensor(ErrorCode::kIo, s.path, name,
                  fmt::format("the file ends at byte {}, inside the tensor's data [{}, {}) (did "
                              "it shrink after the checkpoint was opened?)",
                              at + got, s.data_start + e.info.offset,
                              s.data_start + e.info.offset + e.info.bytes));
    }
  }
};

ShardedCheckpoint::ShardedCheckpoint(std::unique_ptr<Impl> impl) noexcept
    : impl_(std::move(impl)) {}
ShardedCheckpoint::ShardedCheckpoint(ShardedCheckpoint&& other) noexcept = default;
ShardedCheckpoint& ShardedCheckpoint::operator=(ShardedCheckpoint&& other) noexcept = default;
ShardedCheckpoint::~ShardedCheckpoint() = default;

ShardedCheckpoint ShardedCheckpoint::open(const std::string& index_path) {
  auto impl = std::make_unique<Impl>();  // owns every descriptor: a throw below closes them
  impl->index_path = index_path;
  const std::string& index = impl->index_path;
  const std::string text = read_index(index);

  json root;
  try {
    root = json::parse(text);
  } catch (const json::exception& e) {
    fail_file(ErrorCode::kIo, index, fmt::format("index is not valid JSON: {}", e.what()));
  }
  // The parser keeps the last of two equal keys: a key twice in the index (a second weight_map
  // dropped the first's tensors), or a tensor mapped twice, is ambiguous (io/json_keys.h).
  const auto dup = io::first_duplicate_key(
      text, [](int depth, std::string_view parent) { return depth == 1 || parent == kWeightMap; });
  if (dup && dup->depth == 1) {
    fail_file(ErrorCode::kIo, index,
              fmt::format("key '{}' appears twice in the index", printable(dup->key)));
  }
  const std::string duplicate = dup ? dup->key : std::string();
  if (!root.is_object()) {
    fail_file(ErrorCode::kIo, index,
              fmt::format("index is a JSON {}, not an object", root.type_name()));
  }
  const auto weight_map = root.find(kWeightMap);
  if (weight_map == root.end()) fail_file(ErrorCode::kIo, index, "index has no \"weight_map\"");
  if (!weight_map->is_object()) {
    fail_file(ErrorCode::kIo, index,
              fmt::format("\"weight_map\" is a JSON {}, not an object", weight_map->type_name()));
  }
  if (weight_map->empty()) fail_file(ErrorCode::kIo, index, "\"weight_map\" is empty");
  if (!duplicate.empty()) {
    fail_tensor(ErrorCode::kIo, index, duplicate, "appears twice in \"weight_map\"");
  }

  // Each tensor's shard, by the normalized path, so that "./a" and "a" are one file.
  const fs::path folder = fs::path(index).parent_path();
  std::map<std::string, std::vector<std::string>> by_shard;  // path -> tensors, sorted
  std::map<std::string, std::string, std::less<>> shard_of;  // tensor -> path
  for (const auto& [name, value] : weight_map->items()) {
    if (!value.is_string()) {
      fail_tensor(ErrorCode::kIo, index, name,
                  fmt::format("\"weight_map\" value is a JSON {}, not a shard file name",
                              value.type_name()));
    }
    const auto rel = value.get<std::string>();
    if (const auto why = bad_shard_name(rel)) fail_tensor(ErrorCode::kIo, index, name, *why);
    std::string path = (folder / rel).lexically_normal().string();
    by_shard[path].push_back(name);
    shard_of.emplace(name, std::move(path));
  }

  // Every shard's header, each failure naming the shard and a tensor the index puts there.
  std::vector<SafetensorsHeader> headers;
  std::map<std::string, std::size_t, std::less<>> shard_index;  // path -> shards[i]
  for (const auto& [path, names] : by_shard) {
    try {
      UniqueFd fd = open_read_only(path);
      headers.push_back(read_safetensors_header(fd.get(), path));
      shard_index.emplace(path, impl->shards.size());
      impl->shards.push_back(Impl::Shard{path, std::move(fd), headers.back().data_start});
    } catch (const Error& e) {
      throw Error(ErrorCode::kIo, io::kSafetensorsApi,
                  fmt::format("{} (index {} maps {} to this shard)", e.message(), index,
                              tensors_of_shard(names)));
    }
  }

  // A tensor in two headers is ambiguous whatever the index says.
  std::map<std::string_view, std::size_t> found;  // tensor -> the first shard whose header has it
  for (std::size_t s = 0; s < headers.size(); ++s) {
    for (const auto& entry : headers[s].tensors) {
      const std::string& name = entry.first;
      const auto [it, fresh] = found.emplace(name, s);
      if (!fresh) {
        fail_tensor(ErrorCode::kIo, impl->shards[s].path, name,
                    fmt::format("is also in the header of {}: a tensor must be in one shard only "
                                "(index {})",
                                impl->shards[it->second].path, index));
      }
    }
  }
  // Each tensor where the index says it is.
  for (const auto& [name, path] : shard_of) {
    const std::size_t s = shard_index.at(path);
    if (headers[s].tensors.contains(name)) continue;
    const auto elsewhere = found.find(name);
    fail_tensor(
        ErrorCode::kIo, index, name,
        fmt::format("the index maps it to {}, whose header does not have it{}", path,
                    elsewhere == found.end()
                        ? std::string()
                        : fmt::format(" (it is in {})", impl->shards[elsewhere->second].path)));
  }
  // And the index complete, so that names() is every tensor of the checkpoint.
  for (std::size_t s = 0; s < headers.size(); ++s) {
    for (auto& [name, info] : headers[s].tensors) {
      if (!shard_of.contains(name)) {
        fail_tensor(ErrorCode::kIo, impl->shards[s].path, name,
                    fmt::format("is in this shard's header but not in index {}: the index must "
                                "list every tensor",
                                index));
      }
      impl->tensors.emplace(name, Impl::Entry{s, std::move(info)});
    }
  }
  return ShardedCheckpoint(std::move(impl));
}

const std::string& ShardedCheckpoint::index_path() const noexcept {
  return impl_->index_path;
}

std::vector<std::string> ShardedCheckpoint::names() const {
  std::vector<std::string> out;
  out.reserve(impl_->tensors.size());
  for (const auto& t : impl_->tensors) out.push_back(t.first);
  return out;
}

std::vector<std::string> ShardedCheckpoint::names_with_prefix(std::string_view prefix) const {
  std::vector<std::string> out;
  for (auto it = impl_->tensors.lower_bound(prefix);
       it != impl_->tensors.end() && it->first.starts_with(prefix); ++it) {
    out.push_back(it->first);
  }
  return out;
}

bool ShardedCheckpoint::contains(std::string_view name) const noexcept {
  return impl_->tensors.find(name) != impl_->tensors.end();
}

const std::string& ShardedCheckpoint::file_of(std::string_view name) const {
  return impl_->shards[impl_->entry(name).shard].path;
}

const SafetensorsTensorInfo& ShardedCheckpoint::info(std::string_view name) const {
  return impl_->entry(name).info;
}

std::vector<std::byte> ShardedCheckpoint::read(std::string_view name) const {
  const Impl::Entry& e = impl_->entry(name);
  std::vector<std::byte> out(static_cast<std::size_t>(e.info.bytes));
  impl_->read_range(name, e, 0, e.info.bytes, out.data());
  return out;
}

std::vector<std::byte> ShardedCheckpoint::read_slice(std::string_view name,
                                                     const TensorSlice& slice) const {
  const Impl::Entry& e = impl_->entry(name);
  const SafetensorsTensorInfo& info = e.info;
  const auto bad = [&](std::string_view what) {
    fail_tensor(ErrorCode::kInvalidArgument, impl_->shards[e.shard].path, name,
                fmt::format("read_slice: {}", what));
  };
  const auto rank = static_cast<int>(info.shape.size());
  if (slice.axis < 0 || slice.axis >= rank) {
    bad(fmt::format("axis {} is not a dimension of shape {}", slice.axis, shape_str(info.shape)));
  }
  const auto axis = static_cast<std::size_t>(slice.axis);
  const std::int64_t extent = info.shape[axis];
  if (slice.begin < 0) bad(fmt::format("begin {} is negative", slice.begin));
  if (slice.end > extent) {
    bad(fmt::format("end {} is past the extent {} of axis {} (shape {})", slice.end, extent,
                    slice.axis, shape_str(info.shape)));
  }
  if (slice.begin > slice.end) {
    bad(fmt::format("begin {} is after end {}", slice.begin, slice.end));
  }
  const std::int64_t elements = info.elements();
  if (elements == 0 || slice.begin == slice.end) return {};

  // Bits per element from the header (open() checked bytes = elements x bits / 8), and per index
  // along the axis: the dimensions inside it travel whole.
  const auto n = static_cast<std::uint64_t>(elements);
  const std::uint64_t bits = info.bytes % n == 0 ? info.bytes / n * 8 : info.bytes * 8 / n;
  std::uint64_t outer = 1, inner = 1;
  for (std::size_t d = 0; d < axis; ++d) outer *= static_cast<std::uint64_t>(info.shape[d]);
  for (std::size_t d = axis + 1; d < info.shape.size(); ++d) {
    inner *= static_cast<std::uint64_t>(info.shape[d]);
  }
  const std::uint64_t index_bits = inner * bits;
  const auto begin = static_cast<std::uint64_t>(slice.begin);
  const auto end = static_cast<std::uint64_t>(slice.end);
  if (begin * index_bits % 8 != 0 || end * index_bits % 8 != 0 ||
      static_cast<std::uint64_t>(extent) * index_bits % 8 != 0) {
    bad(fmt::format("[{}, {}) along axis {} of {} {} does not start and end on whole bytes",
                    slice.begin, slice.end, slice.axis, info.dtype, shape_str(info.shape)));
  }
  const std::uint64_t stride = static_cast<std::uint64_t>(extent) * index_bits / 8;
  const std::uint64_t run = (end - begin) * index_bits / 8;
  const std::uint64_t first = begin * index_bits / 8;
  std::vector<std::byte> out(static_cast<std::size_t>(outer * run));
  if (run == stride) {  // the whole axis: one contiguous range
    impl_->read_range(name, e, 0, out.size(), out.data());
  } else {
    for (std::uint64_t o = 0; o < outer; ++o) {
      impl_->read_range(name, e, o * stride + first, run, out.data() + o * run);
    }
  }
  return out;
}

std::uint64_t ShardedCheckpoint::bytes_read() const noexcept {
  return impl_->bytes_read.load(std::memory_order_relaxed);
}

TensorSlice shard_slice(int axis, std::int64_t extent, std::int64_t granule, int rank, int size) {
  constexpr std::string_view kApi = "shard_slice";
  if (size < 1) throw Error(ErrorCode::kInvalidArgument, kApi, fmt::format("size {} < 1", size));
  if (rank < 0 || rank >= size) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("rank {} is outside [0, {})", rank, size));
  }
  if (granule < 1) {
    throw Error(ErrorCode::kInvalidArgument, kApi, fmt::format("granule {} < 1", granule));
  }
  if (axis < 0) throw Error(ErrorCode::kInvalidArgument, kApi, fmt::format("axis {} < 0", axis));
  if (extent < 0) {
    throw Error(ErrorCode::kInvalidArgument, kApi, fmt::format("extent {} < 0", extent));
  }
  if (granule > std::numeric_limits<std::int64_t>::max() / size || extent % (granule * size) != 0) {
    throw Error(ErrorCode::kInvalidArgument, kApi,
                fmt::format("extent {} does not split over {} ranks at multiples of {}: it must "
                            "be a multiple of {} x {}",
                            extent, size, granule, granule, size));
  }
  const std::int64_t share = extent / size;
  return TensorSlice{axis, rank * share, (rank + 1) * share};
}

namespace {

// A scalar F32 tensor's value, checked as load_nvfp4_linear checks it.
float read_scalar_scale(const ShardedCheckpoint& ckpt, const std::string& name,
                        std::string_view role) {
  const SafetensorsTensorInfo& i = ckpt.info(name);
  const std::string& path = ckpt.file_of(name);
  if (i.dtype != "F32") {
    fail_tensor(ErrorCode::kIo, path, name,
                fmt::format("dtype is {}, but the {} must be F32", i.dtype, role));
  }
  if (!(i.shape.empty() || (i.shape.size() == 1 && i.shape[0] == 1))) {
    fail_tensor(ErrorCode::kIo, path, name,
                fmt::format("shape is {}, but the {} must be a scalar ([] or [1])",
                            shape_str(i.shape), role));
  }
  const std::vector<std::byte> b = ckpt.read(name);
  std::uint32_t u = 0;
  for (int k = 3; k >= 0; --k)
    u = u << 8 | std::to_integer<std::uint32_t>(b[static_cast<std::size_t>(k)]);
  const float v = num::bits_f32(u);
  if (!std::isfinite(v) || v < 0.0f) {
    fail_tensor(ErrorCode::kIo, path, name,
                fmt::format("value {} is not a finite non-negative scale", v));
  }
  return v;
}

std::vector<std::uint8_t> as_u8(const std::vector<std::byte>& b) {
  std::vector<std::uint8_t> out(b.size());
  std::memcpy(out.data(), b.data(), b.size());
  return out;
}

}  // namespace

Nvfp4LinearShard load_nvfp4_linear_shard(const ShardedCheckpoint& ckpt, std::string_view layer,
                                         int axis, int rank, int size) {
  const std::string weight = fmt::format("{}.weight", layer);
  const std::string scale = fmt::format("{}.weight_scale", layer);
  const std::string scale2 = fmt::format("{}.weight_scale_2", layer);
  const std::string input = fmt::format("{}.input_scale", layer);
  const std::string& index = ckpt.index_path();
  io::require_name(index, "load_nvfp4_linear_shard", layer);
  if (axis != 0 && axis != 1) {
    fail_tensor(ErrorCode::kInvalidArgument, index, weight,
                fmt::format("load_nvfp4_linear_shard: axis {} is neither 0 (split N) nor 1 "
                            "(split K)",
                            axis));
  }
  if (size < 1 || rank < 0 || rank >= size) {
    fail_tensor(
        ErrorCode::kInvalidArgument, index, weight,
        fmt::format("load_nvfp4_linear_shard: rank {} of size {} is not a rank", rank, size));
  }
  if (!ckpt.contains(weight))
    fail_tensor(ErrorCode::kNotFound, index, weight, "not in the checkpoint");
  const SafetensorsTensorInfo& w = ckpt.info(weight);
  const std::string& wfile = ckpt.file_of(weight);
  if (w.dtype != "U8") {
    // Quantizing a slice of BF16/F32 weights would give each rank its own tensor scale.
    fail_tensor(
        ErrorCode::kIo, wfile, weight,
        fmt::format("dtype is {}, but a sharded load reads NVFP4 codes (U8) only", w.dtype));
  }
  if (w.shape.size() != 2 || w.shape[0] == 0 || w.shape[1] == 0) {
    fail_tensor(ErrorCode::kIo, wfile, weight,
                fmt::format("shape is {}, but NVFP4 codes (U8) must be a non-empty [N, K/2]",
                            shape_str(w.shape)));
  }
  const std::int64_t n = w.shape[0];
  if (w.shape[1] > std::numeric_limits<std::int64_t>::max() / 2 || w.shape[1] * 2 % 16 != 0) {
    fail_tensor(ErrorCode::kIo, wfile, weight,
                fmt::format("shape is {}: K = 2 x {} is not a multiple of 16, the NVFP4 block size",
                            shape_str(w.shape), w.shape[1]));
  }
  const std::int64_t k = w.shape[1] * 2;
  for (const std::string* name : {&scale, &scale2}) {
    if (!ckpt.contains(*name)) {
      fail_tensor(ErrorCode::kNotFound, index, *name,
                  fmt::format("not in the checkpoint, but NVFP4 weights '{}' (U8) need it",
                              printable(weight)));
    }
  }
  const SafetensorsTensorInfo& s = ckpt.info(scale);
  const std::string& sfile = ckpt.file_of(scale);
  if (s.dtype != "F8_E4M3") {
    fail_tensor(ErrorCode::kIo, sfile, scale,
                fmt::format("dtype is {}, but NVFP4 block scales must be F8_E4M3", s.dtype));
  }
  const std::vector<std::int64_t> want{n, k / 16};
  if (s.shape != want) {
    fail_tensor(ErrorCode::kIo, sfile, scale,
                fmt::format("mismatched shapes: it is F8_E4M3 {} in {}, but weights '{}' U8 {} in "
                            "{} (N = {}, K = {}) need block scales of shape {}",
                            shape_str(s.shape), sfile, printable(weight), shape_str(w.shape), wfile,
                            n, k, shape_str(want)));
  }
  const float tensor_scale = read_scalar_scale(ckpt, scale2, "NVFP4 tensor scale");
  std::optional<float> input_scale;
  if (ckpt.contains(input)) input_scale = read_scalar_scale(ckpt, input, "input scale");

  const std::int64_t extent = axis == 0 ? n : k;
  const std::int64_t granule = axis == 0 ? 1 : 16;
  if (extent % (granule * size) != 0) {
    fail_tensor(ErrorCode::kInvalidArgument, wfile, weight,
                axis == 0 ? fmt::format("cannot split N = {} over {} ranks: N must be a multiple "
                                        "of {}",
                                        n, size, size)
                          : fmt::format("cannot split K = {} over {} ranks at multiples of 16 (the "
                                        "NVFP4 scale group): K must be a multiple of {}",
                                        k, size, 16 * size));
  }
  Nvfp4LinearShard out;
  out.slice = shard_slice(axis, extent, granule, rank, size);
  out.full_n = n;
  out.full_k = k;
  out.input_scale = input_scale;
  const std::int64_t b = out.slice.begin, e = out.slice.end;
  HostQuantWeights& q = out.w;
  q.format = WeightFormat::kNvfp4;
  q.layout = WeightLayout::kRowMajor;
  q.n = axis == 0 ? e - b : n;
  q.k = axis == 0 ? k : e - b;
  q.tensor_scale = tensor_scale;
  const TensorSlice codes = axis == 0 ? TensorSlice{0, b, e} : TensorSlice{1, b / 2, e / 2};
  const TensorSlice scales = axis == 0 ? TensorSlice{0, b, e} : TensorSlice{1, b / 16, e / 16};
  q.scales = as_u8(ckpt.read_slice(scale, scales));
  const std::int64_t groups = q.k / 16;
  for (std::size_t i = 0; i < q.scales.size(); ++i) {
    if ((q.scales[i] & 0x7Fu) == 0x7Fu) {
      const auto idx = static_cast<std::int64_t>(i);
      // Named by its place in the whole tensor, which is what a reader of the file sees.
      const std::int64_t row = idx / groups + (axis == 0 ? b : 0);
      const std::int64_t col = idx % groups + (axis == 0 ? 0 : b / 16);
      fail_tensor(ErrorCode::kIo, sfile, scale,
                  fmt::format("block scale [{}, {}] is NaN (0x{:02X})", row, col, q.scales[i]));
    }
  }
  q.codes = as_u8(ckpt.read_slice(weight, codes));
  return out;
}

}  // namespace metrale

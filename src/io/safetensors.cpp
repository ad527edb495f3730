#include "metrale/safetensors.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "io/json_keys.h"
#include "io/messages.h"
#include "metrale/error.h"

namespace metrale {

namespace {

using io::fail_file;
using io::fail_tensor;
using io::printable;
using io::shape_str;
using io::valid_utf8;
using json = nlohmann::json;

constexpr std::uint64_t kMaxHeaderBytes = std::uint64_t{100} << 20;  // 100 MiB
constexpr std::string_view kMetadataKey = "__metadata__";

using TensorTable = std::map<std::string, SafetensorsTensorInfo, std::less<>>;
using MetadataTable = std::map<std::string, std::string, std::less<>>;

// ---- dtypes ----

struct Dtype {
  std::string_view name;
  unsigned bits;
};

// Every dtype of the reference implementation (safetensors 0.8), with its width in bits.
constexpr Dtype kDtypes[] = {
    {"BOOL", 8},    {"F4", 4},      {"F6_E2M3", 6}, {"F6_E3M2", 6},     {"U8", 8},
    {"I8", 8},      {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8},
    {"F8_E8M0", 8}, {"I16", 16},    {"U16", 16},    {"F16", 16},        {"BF16", 16},
    {"I32", 32},    {"U32", 32},    {"F32", 32},    {"C64", 64},        {"F64", 64},
    {"I64", 64},    {"U64", 64},
};

unsigned dtype_bits(std::string_view name) {
  for (const Dtype& d : kDtypes) {
    if (d.name == name) return d.bits;
  }
  return 0;
}

std::string_view json_type(const json& j) {
  return j.type_name();
}

// A non-negative JSON integer that fits `max`, or nothing.
std::optional<std::uint64_t> json_uint(const json& j, std::uint64_t max) {
  if (j.is_number_unsigned()) {
    const auto v = j.get<std::uint64_t>();
    if (v <= max) return v;
  }
  return std::nullopt;
}

// ---- the header ----

// The first string of the header that is not UTF-8, reported with what it names. JSON must be
// UTF-8, and the JSON parser would say only that some byte is wrong; this scan says which tensor.
void check_header_utf8(std::string_view path, std::string_view header) {
  int depth = 0;
  std::string_view top_key;  // the tensor whose entry the scan is in
  for (std::size_t i = 0; i < header.size(); ++i) {
    const char c = header[i];
    if (c == '{' || c == '[') {
      ++depth;
    } else if (c == '}' || c == ']') {
      --depth;
    } else if (c == '"') {
      std::size_t j = i + 1;
      while (j < header.size() && header[j] != '"') j += header[j] == '\\' ? 2 : 1;
      const std::string_view s = header.substr(i + 1, std::min(j, header.size()) - i - 1);
      std::size_t after = j + 1;
      while (after < header.size() && std::strchr(" \t\r\n", header[after]) != nullptr) ++after;
      const bool is_key = after < header.size() && header[after] == ':';
      if (!valid_utf8(s)) {
        if (depth == 1 && is_key) fail_tensor(ErrorCode::kIo, path, s, "name is not valid UTF-8");
        if (depth > 1 && !top_key.empty()) {
          fail_tensor(ErrorCode::kIo, path, top_key,
                      fmt::format("string '{}' in its entry is not valid UTF-8", printable(s)));
        }
        fail_file(ErrorCode::kIo, path,
                  fmt::format("header string '{}' is not valid UTF-8", printable(s)));
      }
      if (depth == 1 && is_key) top_key = s;
      i = j;
    }
  }
}

// Reads bytes [offset, offset + n) of the file open on `fd` into `out`, or throws Error(kIo).
void pread_fully(int fd, std::string_view path, void* out, std::uint64_t n, std::uint64_t offset) {
  auto* p = static_cast<unsigned char*>(out);
  for (std::uint64_t done = 0; done < n;) {
    const ::ssize_t got = ::pread(fd, p + done, static_cast<std::size_t>(n - done),
                                  static_cast<::off_t>(offset + done));
    if (got < 0 && errno == EINTR) continue;
    if (got < 0)
      fail_file(ErrorCode::kIo, path, fmt::format("cannot read: {}", std::strerror(errno)));
    if (got == 0) {
      fail_file(ErrorCode::kIo, path,
                fmt::format("the file ends at byte {}, before the header's end at byte {} (did "
                            "it shrink while being read?)",
                            offset + done, offset + n));
    }
    done += static_cast<std::uint64_t>(got);
  }
}

// Every file has at least the 8-byte header length.
void check_file_size(std::string_view path, std::uint64_t size) {
  if (size < 8) {
    fail_file(ErrorCode::kIo, path,
              fmt::format("the file is {} bytes, too short for the 8-byte header length", size));
  }
}

// The header length a file of `size` bytes (at least 8) declares in its first 8 bytes, checked to
// lie within the file and under the limit.
std::uint64_t header_length(std::string_view path, const unsigned char* base, std::uint64_t size);
// Validates the JSON header of a file whose data section is `data_size` bytes and fills the
// tables: every rule of SafetensorsFile::open after the header length's.
void parse_header(std::string_view path, std::string_view header, std::uint64_t data_size,
                  TensorTable& tensors, MetadataTable& metadata);

}  // namespace

std::int64_t SafetensorsTensorInfo::elements() const {
  // open() checked that the product fits; a zero dimension may follow huge ones, though.
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) return 0;
  std::int64_t n = 1;
  for (const std::int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::SafetensorsFile(SafetensorsFile&& other) noexcept
    : path_(std::move(other.path_)),
      map_(std::exchange(other.map_, nullptr)),
      map_size_(std::exchange(other.map_size_, 0)),
      owned_(std::move(other.owned_)),
      data_(std::exchange(other.data_, nullptr)),
      tensors_(std::move(other.tensors_)),
      metadata_(std::move(other.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_size_ = std::exchange(other.map_size_, 0);
    owned_ = std::move(other.owned_);
    data_ = std::exchange(other.data_, nullptr);
    tensors_ = std::move(other.tensors_);
    metadata_ = std::move(other.metadata_);
  }
  return *this;
}

SafetensorsFile::~SafetensorsFile() {
  release();
}

void SafetensorsFile::release() noexcept {
  if (map_ != nullptr) ::munmap(map_, map_size_);
  map_ = nullptr;
  map_size_ = 0;
  std::vector<std::byte>().swap(owned_);
  data_ = nullptr;
  tensors_.clear();
  metadata_.clear();
}

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  SafetensorsFile f;  // owns the map from here: any throw below unmaps it
  f.path_ = path;
  {
    // O_NONBLOCK: a FIFO would wait for a writer; the S_ISREG check below refuses it.
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) {
      fail_file(ErrorCode::kIo, path, fmt::format("cannot open: {}", std::strerror(errno)));
    }
    struct FdCloser {
      int fd;
      ~FdCloser() { ::close(fd); }
    } closer{fd};
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      fail_file(ErrorCode::kIo, path, fmt::format("cannot stat: {}", std::strerror(errno)));
    }
    if (!S_ISREG(st.st_mode)) fail_file(ErrorCode::kIo, path, "not a regular file");
    const auto size = static_cast<std::uint64_t>(st.st_size);
    check_file_size(path, size);  // before mmap, which refuses an empty file
    void* p = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      fail_file(ErrorCode::kIo, path, fmt::format("cannot map: {}", std::strerror(errno)));
    }
    f.map_ = p;
    f.map_size_ = size;
  }
  f.parse(static_cast<const unsigned char*>(f.map_), f.map_size_);
  return f;
}

SafetensorsFile SafetensorsFile::from_bytes(std::string name, std::span<const std::byte> bytes) {
  SafetensorsFile f;
  f.path_ = std::move(name);
  check_file_size(f.path_, bytes.size());
  f.owned_.assign(bytes.begin(), bytes.end());
  f.parse(reinterpret_cast<const unsigned char*>(f.owned_.data()), f.owned_.size());
  return f;
}

void SafetensorsFile::parse(const unsigned char* base, std::uint64_t size) {
  const std::uint64_t header_len = header_length(path_, base, size);
  const std::string_view header(reinterpret_cast<const char*>(base + 8), header_len);
  data_ = reinterpret_cast<const std::byte*>(base) + 8 + header_len;
  parse_header(path_, header, size - 8 - header_len, tensors_, metadata_);
}

namespace {

std::uint64_t header_length(std::string_view path, const unsigned char* base, std::uint64_t size) {
  std::uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | base[i];
  const std::uint64_t after_len = size - 8;
  if (header_len > kMaxHeaderBytes) {
    fail_file(ErrorCode::kIo, path,
              fmt::format("header length {} is over the limit of {} bytes (100 MiB)", header_len,
                          kMaxHeaderBytes));
  }
  if (header_len > after_len) {
    fail_file(
        ErrorCode::kIo, path,
        fmt::format("header length {} runs past the end of the file ({} bytes)", header_len, size));
  }
  return header_len;
}

void parse_header(std::string_view path, std::string_view header, std::uint64_t data_size,
                  TensorTable& tensors, MetadataTable& metadata) {
  check_header_utf8(path, header);

  json root;
  try {
    root = json::parse(header);
  } catch (const json::exception& e) {
    fail_file(ErrorCode::kIo, path, fmt::format("header is not valid JSON: {}", e.what()));
  }
  // The parser keeps the last of two equal keys: a tensor named twice, or a key twice in one
  // entry, is ambiguous (json_keys.h says why this is a pass of its own).
  if (const auto dup =
          io::first_duplicate_key(header, [](int, std::string_view) { return true; })) {
    if (dup->depth == 1) fail_tensor(ErrorCode::kIo, path, dup->key, "appears twice in the header");
    if (dup->parent == kMetadataKey) {
      fail_file(ErrorCode::kIo, path,
                fmt::format("__metadata__ key '{}' appears twice", printable(dup->key)));
    }
    fail_tensor(ErrorCode::kIo, path, dup->parent,
                fmt::format("key '{}' appears twice in its entry", printable(dup->key)));
  }
  if (!root.is_object()) {
    fail_file(ErrorCode::kIo, path,
              fmt::format("header is a JSON {}, not an object", json_type(root)));
  }

  constexpr auto kMaxDim = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
  for (const auto& [name, entry] : root.items()) {
    if (name == kMetadataKey) {
      if (!entry.is_object()) {
        fail_file(
            ErrorCode::kIo, path,
            fmt::format("__metadata__ is a JSON {}, not an object of strings", json_type(entry)));
      }
      for (const auto& [key, value] : entry.items()) {
        if (!value.is_string()) {
          fail_file(ErrorCode::kIo, path,
                    fmt::format("__metadata__ '{}' is a JSON {}, not a string", printable(key),
                                json_type(value)));
        }
        metadata.emplace(key, value.get<std::string>());
      }
      continue;
    }
    const auto bad = [&](std::string_view what) { fail_tensor(ErrorCode::kIo, path, name, what); };
    if (!entry.is_object()) bad(fmt::format("entry is a JSON {}, not an object", json_type(entry)));

    SafetensorsTensorInfo info;
    const auto dtype = entry.find("dtype");
    if (dtype == entry.end()) bad("entry has no dtype");
    if (!dtype->is_string())
      bad(fmt::format("dtype is a JSON {}, not a string", json_type(*dtype)));
    info.dtype = dtype->get<std::string>();
    const unsigned bits = dtype_bits(info.dtype);
    if (bits == 0) bad(fmt::format("unknown dtype '{}'", printable(info.dtype)));

    const auto shape = entry.find("shape");
    if (shape == entry.end()) bad("entry has no shape");
    if (!shape->is_array()) bad(fmt::format("shape is a JSON {}, not a list", json_type(*shape)));
    std::uint64_t elements = 1;
    bool overflow = false;
    for (const json& d : *shape) {
      const auto dim = json_uint(d, kMaxDim);
      if (!dim) bad(fmt::format("shape {} is not a list of non-negative integers", shape->dump()));
      info.shape.push_back(static_cast<std::int64_t>(*dim));
      if (*dim != 0 && elements > std::numeric_limits<std::uint64_t>::max() / *dim) {
        overflow = true;
      }
      elements *= *dim;
    }
    if (overflow || elements > std::numeric_limits<std::uint64_t>::max() / bits) {
      bad(fmt::format("shape {} has too many elements", shape->dump()));
    }
    if (elements * bits % 8 != 0) {
      bad(fmt::format("{} elements of {} do not fill whole bytes", elements, info.dtype));
    }
    const std::uint64_t nbytes = elements * bits / 8;

    const auto offsets = entry.find("data_offsets");
    if (offsets == entry.end()) bad("entry has no data_offsets");
    const std::uint64_t max = std::numeric_limits<std::uint64_t>::max();
    if (!offsets->is_array() || offsets->size() != 2 || !json_uint((*offsets)[0], max) ||
        !json_uint((*offsets)[1], max)) {
      bad(fmt::format("data_offsets {} is not a list of two non-negative integers",
                      offsets->dump()));
    }
    const auto begin = (*offsets)[0].get<std::uint64_t>();
    const auto end = (*offsets)[1].get<std::uint64_t>();
    if (end < begin) bad(fmt::format("data_offsets [{}, {}] end before they begin", begin, end));
    if (end - begin != nbytes) {
      bad(fmt::format("dtype {} shape {} is {} bytes, but data_offsets [{}, {}] hold {}",
                      info.dtype, shape_str(info.shape), nbytes, begin, end, end - begin));
    }
    if (end > data_size) {
      bad(fmt::format("data_offsets [{}, {}] run past the data section ({} bytes)", begin, end,
                      data_size));
    }
    info.offset = begin;
    info.bytes = nbytes;
    tensors.emplace(name, std::move(info));
  }

  // The tensors must tile the data section: sorted by offset, each starts where the one before
  // ends, and the last ends at the end of the file (the reference reader's rule).
  std::vector<const std::pair<const std::string, SafetensorsTensorInfo>*> order;
  order.reserve(tensors.size());
  for (const auto& t : tensors) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return std::pair(a->second.offset, a->second.bytes) <
           std::pair(b->second.offset, b->second.bytes);
  });
  std::uint64_t covered = 0;
  const std::pair<const std::string, SafetensorsTensorInfo>* last = nullptr;
  for (const auto* t : order) {
    const SafetensorsTensorInfo& info = t->second;
    if (info.offset < covered) {
      fail_tensor(ErrorCode::kIo, path, t->first,
                  fmt::format("data_offsets [{}, {}] overlap tensor '{}' [{}, {}]", info.offset,
                              info.offset + info.bytes, printable(last->first), last->second.offset,
                              last->second.offset + last->second.bytes));
    }
    if (info.offset > covered) {
      fail_tensor(ErrorCode::kIo, path, t->first,
                  fmt::format("data_offsets [{}, {}] leave bytes [{}, {}) of the data section "
                              "to no tensor",
                              info.offset, info.offset + info.bytes, covered, info.offset));
    }
    covered = info.offset + info.bytes;
    last = t;
  }
  if (covered != data_size) {
    if (last == nullptr) {
      fail_file(
          ErrorCode::kIo, path,
          fmt::format("the header has no tensors, but the data section is {} bytes", data_size));
    }
    fail_tensor(ErrorCode::kIo, path, last->first,
                fmt::format("the last tensor ends at byte {} of the {}-byte data section: the "
                            "bytes after it belong to no tensor",
                            covered, data_size));
  }
}

}  // namespace

std::vector<std::string> SafetensorsFile::names() const {
  std::vector<std::string> out;
  out.reserve(tensors_.size());
  for (const auto& t : tensors_) out.push_back(t.first);
  return out;
}

bool SafetensorsFile::contains(std::string_view name) const noexcept {
  return tensors_.find(name) != tensors_.end();
}

const SafetensorsTensorInfo& SafetensorsFile::info(std::string_view name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) fail_tensor(ErrorCode::kNotFound, path_, name, "not in the file");
  return it->second;
}

std::span<const std::byte> SafetensorsFile::bytes(std::string_view name) const {
  const SafetensorsTensorInfo& i = info(name);
  return {data_ + i.offset, static_cast<std::size_t>(i.bytes)};
}

SafetensorsHeader read_safetensors_header(int fd, const std::string& path) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    fail_file(ErrorCode::kIo, path, fmt::format("cannot stat: {}", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) fail_file(ErrorCode::kIo, path, "not a regular file");
  const auto size = static_cast<std::uint64_t>(st.st_size);
  check_file_size(path, size);
  unsigned char length[8];
  pread_fully(fd, path, length, sizeof length, 0);
  const std::uint64_t header_len = header_length(path, length, size);
  std::string header(static_cast<std::size_t>(header_len), '\0');
  pread_fully(fd, path, header.data(), header_len, 8);
  SafetensorsHeader out;
  out.data_start = 8 + header_len;
  out.data_bytes = size - out.data_start;
  parse_header(path, header, out.data_bytes, out.tensors, out.metadata);
  return out;
}

}  // namespace metrale

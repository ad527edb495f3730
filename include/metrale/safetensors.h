// Reading safetensors files (https://huggingface.co/docs/safetensors): an 8-byte little-endian
// header length, a JSON header naming each tensor's dtype, shape and byte range, then the data.
// SafetensorsFile maps the file read-only and checks the whole header before it hands anything
// out, so every later access is a bounds-checked view into the map. read_safetensors_header
// checks the header alone, for a reader that fetches byte ranges itself (a sharded checkpoint,
// metrale/sharded_checkpoint.h). Reading linear layers out of such a file, as ModelOpt exports
// them, is metrale/modelopt.h.
//
// Every failure is an Error whose message names the file and, where there is one, the tensor:
// "[safetensors] model.safetensors: tensor 'x.weight': ...". kIo for a file that cannot be read
// or is malformed, kNotFound for a missing tensor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace metrale {

// What the header says of one tensor.
struct SafetensorsTensorInfo {
  std::string dtype;                // as in the format: "U8", "F8_E4M3", "BF16", "F32", ...
  std::vector<std::int64_t> shape;  // [] for a scalar
  std::uint64_t offset = 0;         // first byte, relative to the start of the data section
  std::uint64_t bytes = 0;          // data_offsets[1] - data_offsets[0]

  // Number of elements: the product of the shape (1 for a scalar).
  std::int64_t elements() const;
};

// A safetensors file mapped read-only (or copied, from_bytes). Move-only; the map or copy is
// released when the object goes (views from bytes() die with it).
class SafetensorsFile {
 public:
  // Maps `path` and validates it: the header length (within the file, at most 100 MiB), the JSON
  // (UTF-8, an object), each entry (an object with a known dtype, a shape of non-negative
  // integers and data_offsets whose length is the shape's byte size), the offsets (inside the
  // data section, no overlap, no gap, the data section exactly covered, as the reference reader
  // requires) and "__metadata__" (a map of strings). Unknown keys in an entry are ignored, as the
  // reference reader does. Throws Error(kIo) naming the file and tensor; nothing stays mapped or
  // open when it throws.
  static SafetensorsFile open(const std::string& path);
  // The same reader over a file's content already in memory: copies `bytes` (so they may go
  // once this returns) and validates them exactly as open() does; `name` stands for the path in
  // path() and in messages. Throws Error(kIo).
  static SafetensorsFile from_bytes(std::string name, std::span<const std::byte> bytes);

  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  ~SafetensorsFile();

  // The path it was opened with (from_bytes: its name).
  const std::string& path() const noexcept { return path_; }
  // Tensor names, sorted.
  std::vector<std::string> names() const;
  bool contains(std::string_view name) const noexcept;
  // The header entry of `name`; Error(kNotFound) when there is none.
  const SafetensorsTensorInfo& info(std::string_view name) const;
  // The tensor's bytes, a view into the map (little-endian, row-major); Error(kNotFound).
  std::span<const std::byte> bytes(std::string_view name) const;
  // "__metadata__" (empty when the header has none).
  const std::map<std::string, std::string, std::less<>>& metadata() const noexcept {
    return metadata_;
  }

 private:
  SafetensorsFile() = default;
  void release() noexcept;
  // Validates the whole file at base[0, size) (mapped or owned by *this) and fills the tables.
  void parse(const unsigned char* base, std::uint64_t size);

  std::string path_;
  void* map_ = nullptr;
  std::size_t map_size_ = 0;
  std::vector<std::byte> owned_;     // from_bytes' copy (a vector's buffer survives its moves)
  const std::byte* data_ = nullptr;  // the data section, inside the map or the copy
  std::map<std::string, SafetensorsTensorInfo, std::less<>> tensors_;
  std::map<std::string, std::string, std::less<>> metadata_;
};

// A safetensors file's header alone: what read_safetensors_header found, with no data read.
struct SafetensorsHeader {
  std::map<std::string, SafetensorsTensorInfo, std::less<>> tensors;  // by name
  std::map<std::string, std::string, std::less<>> metadata;           // "__metadata__"
  std::uint64_t data_start = 0;  // file offset of the data section: 8 + the header length
  std::uint64_t data_bytes = 0;  // size of the data section, which the tensors exactly cover
};

// Reads the header of the file open on `fd` (pread: the fd's offset does not move; the caller
// keeps and closes it) and validates it by every rule of SafetensorsFile::open, without mapping
// the file or reading its data section; `path` names the file in messages. Throws Error(kIo).
SafetensorsHeader read_safetensors_header(int fd, const std::string& path);

}  // namespace metrale

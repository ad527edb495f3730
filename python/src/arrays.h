// Arrays that come in through DLPack or the buffer protocol, checked against what a call needs
// before metrale touches them: element type, shape, C-contiguity, device and alignment. Every
// failure is an Error naming the call and the argument ("[gemm] a: dtype float32, expected
// bfloat16"); nothing is read or written by the check.
#pragma once

#include <nanobind/ndarray.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "metrale/handles.h"

namespace metrale::py {

enum class Element { kBf16, kU8, kF32, kI32 };

// What an argument must be. rows/cols -1: any size (but at least 1).
struct ArraySpec {
  Element element = Element::kBf16;
  int ndim = 2;
  std::int64_t rows = -1, cols = -1;
  int device_type = nanobind::device::cpu::value;  // DLPack's device type of the model
  int device_id = 0;
  std::size_t alignment = 16;
};

// A checked argument: where its bytes are and its shape (1-D: rows == 1), and the array itself,
// held for as long as the argument is: an array imported from a DLPack capsule is freed by its
// producer when its last holder goes, so a bare pointer would outlive it. Drop the last copy with
// the GIL held (nanobind releases the producer's object then).
struct ArrayArg {
  DevicePtr ptr;
  std::size_t bytes = 0;
  std::int64_t rows = 0, cols = 0;
  nanobind::ndarray<nanobind::ro> owner;
};

// Checks `a` as argument `name` of `api` against spec. `bf16_bits`: the caller declared that a
// uint16 array holds BF16 bit patterns (NumPy has no bfloat16 of its own). Throws DtypeError for
// the element type, Error(kInvalidArgument) for the rank, shape, strides, device or alignment.
ArrayArg check_array(std::string_view api, std::string_view name,
                     const nanobind::ndarray<nanobind::ro>& a, bool bf16_bits,
                     const ArraySpec& spec);

// obj as an array (DLPack or the buffer protocol, no copy) for argument `name` of `api`; with
// `writable`, one metrale may write. Throws DtypeError when obj is no array, Error
// (kInvalidArgument) when it is read-only but must be written.
nanobind::ndarray<nanobind::ro> as_array(std::string_view api, std::string_view name,
                                         nanobind::handle obj, bool writable);

// "bfloat16", "uint8", "float32", or e.g. "int64" for what DLPack says of an array.
std::string dtype_name(const nanobind::dlpack::dtype& dtype);

}  // namespace metrale::py

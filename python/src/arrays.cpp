#include "arrays.h"

#include <fmt/format.h>

#include <string>

#include "bindings.h"

namespace nb = nanobind;

namespace metrale::py {
namespace {

nb::dlpack::dtype wanted_dtype(Element e) {
  switch (e) {
    case Element::kBf16:
      return {static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat), 16, 1};
    case Element::kU8:
      return nb::dtype<std::uint8_t>();
    case Element::kF32:
      return nb::dtype<float>();
    case Element::kI32:
      return nb::dtype<std::int32_t>();
  }
  return {};
}

std::string device_name(int type, int id) {
  switch (type) {
    case nb::device::cpu::value:
      return "cpu";
    case nb::device::cuda::value:
      return fmt::format("cuda:{}", id);
    case nb::device::cuda_host::value:
      return "cuda_host (pinned host memory)";
    case nb::device::cuda_managed::value:
      return fmt::format("cuda_managed:{}", id);
    default:
      return fmt::format("DLPack device type {}:{}", type, id);
  }
}

std::string shape_text(const nb::ndarray<nb::ro>& a) {
  std::string s = "(";
  for (std::size_t i = 0; i < a.ndim(); ++i) {
    s += fmt::format("{}{}", i ? ", " : "", a.shape(i));
  }
  return s + (a.ndim() == 1 ? ",)" : ")");
}

// Row-major with no gaps: each stride is the product of the sizes after it (a dimension of
// size 1 may have any stride, as NumPy and torch give them).
bool c_contiguous(const nb::ndarray<nb::ro>& a) {
  std::int64_t expected = 1;
  for (std::size_t i = a.ndim(); i-- > 0;) {
    if (a.shape(i) != 1 && a.stride(i) != expected) return false;
    expected *= static_cast<std::int64_t>(a.shape(i));
  }
  return true;
}

}  // namespace

std::string dtype_name(const nb::dlpack::dtype& d) {
  const char* kind = "?";
  switch (static_cast<nb::dlpack::dtype_code>(d.code)) {
    case nb::dlpack::dtype_code::Int:
      kind = "int";
      break;
    case nb::dlpack::dtype_code::UInt:
      kind = "uint";
      break;
    case nb::dlpack::dtype_code::Float:
      kind = "float";
      break;
    case nb::dlpack::dtype_code::Bfloat:
      kind = "bfloat";
      break;
    case nb::dlpack::dtype_code::Complex:
      kind = "complex";
      break;
    case nb::dlpack::dtype_code::Bool:
      return "bool";
    default:  // the 8-, 6- and 4-bit float codes: named by their number
      return fmt::format("dlpack code {} ({} bits)", d.code, d.bits);
  }
  return d.lanes == 1 ? fmt::format("{}{}", kind, d.bits)
                      : fmt::format("{}{}x{}", kind, d.bits, d.lanes);
}

nb::ndarray<nb::ro> as_array(std::string_view api, std::string_view name, nb::handle obj,
                             bool writable) {
  nb::ndarray<> rw;
  if (nb::try_cast(obj, rw)) return nb::ndarray<nb::ro>(rw);
  nb::ndarray<nb::ro> ro;
  if (!nb::try_cast(obj, ro)) {
    throw DtypeError(api, fmt::format("{}: {} is not an array (no DLPack or buffer protocol, or "
                                      "an element type DLPack cannot name)",
                                      name, nb::type_name(obj.type()).c_str()));
  }
  if (writable) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{}: the array is read-only, and metrale writes it", name));
  }
  return ro;
}

ArrayArg check_array(std::string_view api, std::string_view name, const nb::ndarray<nb::ro>& a,
                     bool bf16_bits, const ArraySpec& spec) {
  const nb::dlpack::dtype want = wanted_dtype(spec.element);
  nb::dlpack::dtype have = a.dtype();
  if (bf16_bits && have == nb::dtype<std::uint16_t>()) have = want;
  if (have != want) {
    throw DtypeError(api, fmt::format("{}: dtype {}, expected {}", name, dtype_name(a.dtype()),
                                      dtype_name(want)));
  }
  if (static_cast<int>(a.ndim()) != spec.ndim) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{}: shape {} has {} dimension(s), expected {}", name, shape_text(a),
                            a.ndim(), spec.ndim));
  }
  ArrayArg arg;
  arg.rows = spec.ndim == 2 ? static_cast<std::int64_t>(a.shape(0)) : 1;
  arg.cols = static_cast<std::int64_t>(a.shape(spec.ndim - 1));
  const bool rows_ok = spec.rows < 0 ? arg.rows >= 1 : arg.rows == spec.rows;
  const bool cols_ok = spec.cols < 0 ? arg.cols >= 1 : arg.cols == spec.cols;
  if (!rows_ok || !cols_ok) {
    const auto dim = [](std::int64_t v) { return v < 0 ? std::string("*") : std::to_string(v); };
    const std::string expected = spec.ndim == 2
                                     ? fmt::format("({}, {})", dim(spec.rows), dim(spec.cols))
                                     : fmt::format("({},)", dim(spec.cols));
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{}: shape {}, expected {}{}", name, shape_text(a), expected,
                            spec.rows < 0 && arg.rows < 1 ? " with at least one row" : ""));
  }
  if (!c_contiguous(a)) {
    std::string strides;
    for (std::size_t i = 0; i < a.ndim(); ++i) {
      strides += fmt::format("{}{}", i ? ", " : "", a.stride(i));
    }
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{}: strides ({}) elements are not C-contiguous for shape {} (pass "
                            "a contiguous copy, e.g. numpy.ascontiguousarray)",
                            name, strides, shape_text(a)));
  }
  if (a.device_type() != spec.device_type || a.device_id() != spec.device_id) {
    throw Error(ErrorCode::kInvalidArgument, api,
                fmt::format("{}: lives on {}, the model runs on {}", name,
                            device_name(a.device_type(), a.device_id()),
                            device_name(spec.device_type, spec.device_id)));
  }
  const auto address = reinterpret_cast<std::uintptr_t>(a.data());
  if (address % spec.alignment != 0) {
    throw Error(
        ErrorCode::kInvalidArgument, api,
        fmt::format("{}: address 0x{:x} is not {}-byte aligned", name, address, spec.alignment));
  }
  arg.ptr = DevicePtr{address};
  arg.bytes = a.nbytes();
  arg.owner = a;
  return arg;
}

}  // namespace metrale::py

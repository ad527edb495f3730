// The bad-input catalogue of docs/RELIABILITY.md: every kind of mistake a caller can make with
// the public API, made for real on the CPU backend, with the error it gets. Prints a Markdown
// table. With --check (what ctest runs) it also fails unless every case threw a metrale::Error
// of the expected code whose message starts with "[api]", and the backend's ledger is back to
// the bytes it held before the case: a mistake costs the caller nothing but the error.
#include <fmt/format.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

#include <unistd.h>

#include "metrale/cpu_backend.h"
#include "metrale/error.h"
#include "metrale/fp8_checkpoint.h"
#include "metrale/kernel_args.h"
#include "metrale/model_scope.h"
#include "metrale/modelopt.h"
#include "metrale/op_cache.h"
#include "metrale/ops/elementwise.h"
#include "metrale/ops/gemm.h"
#include "metrale/quant.h"
#include "metrale/runtime.h"
#include "metrale/safetensors.h"

namespace metrale::catalogue {
namespace {

namespace fs = std::filesystem;
using ops::Activations;
using ops::GemmOptions;
using ops::GemmRoute;

struct Case {
  std::string area;
  std::string input;  // the mistake, in words
  ErrorCode expected;
  std::function<void(CpuBackend&)> run;
};

// Fresh random NVFP4 weights [n, k] on backend.
ops::QuantWeights random_weights(CpuBackend& b, std::int64_t n, std::int64_t k,
                                 WeightFormat f = WeightFormat::kNvfp4) {
  std::mt19937 gen(std::random_device{}());
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> w(static_cast<std::size_t>(n * k));
  for (float& x : w) x = d(gen);
  return ops::upload_weights(
      b, f == WeightFormat::kNvfp4 ? quantize_nvfp4(w, n, k) : quantize_mxfp4(w, n, k));
}

// Runs op with weights [64, 128], A [m, 128] and C [m, 64] made for it, freeing them after
// whatever op does.
void with_gemm(CpuBackend& b, std::int64_t m,
               const std::function<void(ops::QuantWeights&, DevicePtr, DevicePtr)>& op) {
  ops::QuantWeights w = random_weights(b, 64, 128);
  const DevicePtr a = b.alloc(static_cast<std::size_t>(std::max<std::int64_t>(m, 1) * 128 * 2));
  const DevicePtr c = b.alloc(static_cast<std::size_t>(std::max<std::int64_t>(m, 1) * 64 * 2));
  try {
    op(w, a, c);
  } catch (...) {
    ops::free_weights(b, w);
    b.free(a);
    b.free(c);
    throw;
  }
  ops::free_weights(b, w);
  b.free(a);
  b.free(c);
}

// The files write_safetensors made, removed when the program ends.
std::vector<fs::path>& written() {
  static std::vector<fs::path> paths;
  return paths;
}

// A safetensors file of header text and data bytes, written under the temp directory (the name
// carries the process id, so parallel runs do not share files).
std::string write_safetensors(const std::string& name, const std::string& header,
                              std::size_t data_bytes, std::uint64_t claimed_header = 0) {
  const fs::path path =
      fs::temp_directory_path() / fmt::format("metrale-catalogue-{}-{}", ::getpid(), name);
  written().push_back(path);
  std::ofstream out(path, std::ios::binary);
  const std::uint64_t len = claimed_header ? claimed_header : header.size();
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((len >> (8 * i)) & 0xFF));
  out << header;
  out << std::string(data_bytes, '\x01');
  return path.string();
}

// A safetensors file with the given data bytes and its header padded with spaces to 8 bytes, as
// the reference writer pads it, so a tensor's alignment is its offset's.
std::string write_padded_safetensors(const std::string& name, std::string header,
                                     const std::string& data) {
  header.append((8 - header.size() % 8) % 8, ' ');
  const fs::path path =
      fs::temp_directory_path() / fmt::format("metrale-catalogue-{}-{}", ::getpid(), name);
  written().push_back(path);
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) out.put(static_cast<char>((header.size() >> (8 * i)) & 0xFF));
  out << header << data;
  return path.string();
}

// An FP8 layer "l" (DeepSeek-V3 layout): "l.weight" of `weight_dtype` and `weight_shape` over
// `codes`, then "l.weight_scale_inv" of `scale_dtype` and `scale_shape` over `scales` (either
// left out when its dtype is empty); load_fp8_linear it.
void load_fp8_file(const std::string& name, const std::string& weight_dtype,
                   const std::string& weight_shape, const std::string& codes,
                   const std::string& scale_dtype, const std::string& scale_shape,
                   const std::string& scales) {
  std::string header = "{";
  if (!weight_dtype.empty()) {
    header += fmt::format(R"("l.weight":{{"dtype":"{}","shape":{},"data_offsets":[0,{}]}})",
                          weight_dtype, weight_shape, codes.size());
  }
  if (!scale_dtype.empty()) {
    if (header.size() > 1) header += ",";
    header +=
        fmt::format(R"("l.weight_scale_inv":{{"dtype":"{}","shape":{},"data_offsets":[{},{}]}})",
                    scale_dtype, scale_shape, codes.size(), codes.size() + scales.size());
  }
  header += "}";
  const SafetensorsFile f =
      SafetensorsFile::open(write_padded_safetensors(name, header, codes + scales));
  (void)load_fp8_linear(f, "l");
}

// FP32 values as little-endian bytes.
std::string f32_bytes(std::initializer_list<float> values) {
  std::string out;
  for (const float v : values) {
    std::uint32_t u;
    std::memcpy(&u, &v, 4);
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((u >> (8 * i)) & 0xFF));
  }
  return out;
}

std::vector<Case> cases() {
  std::vector<Case> v;
  const auto add = [&](std::string area, std::string input, ErrorCode code,
                       std::function<void(CpuBackend&)> run) {
    v.push_back({std::move(area), std::move(input), code, std::move(run)});
  };
  using E = ErrorCode;

  // ---- memory ----
  add("memory", "alloc of 0 bytes", E::kInvalidArgument, [](CpuBackend& b) { b.alloc(0); });
  add("memory", "alloc of SIZE_MAX bytes", E::kOutOfMemory,
      [](CpuBackend& b) { b.alloc(std::numeric_limits<std::size_t>::max()); });
  add("memory", "alloc above the device's memory (injected limit)", E::kOutOfMemory,
      [](CpuBackend& b) {
        CpuFaults faults;
        faults.max_device_alloc = 1024;
        b.set_faults(faults);
        b.alloc(4096);
      });
  add("memory", "free of a pointer this backend never made", E::kInvalidArgument,
      [](CpuBackend& b) { b.free(DevicePtr{0x1234'5000}); });
  add("memory", "free of an interior pointer", E::kInvalidArgument, [](CpuBackend& b) {
    const DevicePtr p = b.alloc(256);
    try {
      b.free(p.offset(16));
    } catch (...) {
      b.free(p);
      throw;
    }
  });
  add("memory", "double free", E::kInvalidArgument, [](CpuBackend& b) {
    const DevicePtr p = b.alloc(256);
    b.free(p);
    b.free(p);
  });
  add("memory", "free_pinned of device memory", E::kInvalidArgument, [](CpuBackend& b) {
    const DevicePtr p = b.alloc(256);
    try {
      b.free_pinned(reinterpret_cast<void*>(static_cast<std::uintptr_t>(p.address())));
    } catch (...) {
      b.free(p);
      throw;
    }
  });
  add("memory", "copy_h2d past the end of the allocation", E::kInvalidArgument, [](CpuBackend& b) {
    const DevicePtr p = b.alloc(256);
    std::vector<std::byte> host(512);
    try {
      b.copy_h2d(p, host.data(), host.size());
    } catch (...) {
      b.free(p);
      throw;
    }
  });
  add("memory", "copy_d2h from a freed allocation", E::kInvalidArgument, [](CpuBackend& b) {
    const DevicePtr p = b.alloc(256);
    b.free(p);
    std::vector<std::byte> host(256);
    b.copy_d2h(host.data(), p, host.size());
  });
  add("memory", "borrow of a range inside an allocation", E::kInvalidArgument, [](CpuBackend& b) {
    const DevicePtr p = b.alloc(256);
    try {
      b.borrow(p.offset(64), 64);
    } catch (...) {
      b.free(p);
      throw;
    }
  });
  add("memory", "free of borrowed memory", E::kInvalidArgument, [](CpuBackend& b) {
    static std::vector<std::byte> lent(256);
    const DevicePtr p{reinterpret_cast<std::uintptr_t>(lent.data())};
    b.borrow(p, lent.size());
    try {
      b.free(p);
    } catch (...) {
      b.unborrow(p);
      throw;
    }
  });
  add("memory", "unborrow of an allocation", E::kInvalidArgument, [](CpuBackend& b) {
    const DevicePtr p = b.alloc(256);
    try {
      b.unborrow(p);
    } catch (...) {
      b.free(p);
      throw;
    }
  });
  add("memory", "memset of a null pointer", E::kInvalidArgument,
      [](CpuBackend& b) { b.memset(DevicePtr{}, 0, 16); });
  add("memory", "copy_2d with a pitch smaller than the row", E::kInvalidArgument,
      [](CpuBackend& b) {
        const DevicePtr p = b.alloc(1024), q = b.alloc(1024);
        try {
          b.copy_2d_async(p, 16, q, 64, 64, 4, b.default_stream());
        } catch (...) {
          b.free(p);
          b.free(q);
          throw;
        }
      });

  // ---- streams, events, graphs ----
  add("streams", "destroy_stream of the default stream", E::kInvalidArgument,
      [](CpuBackend& b) { b.destroy_stream(b.default_stream()); });
  add("streams", "destroy_stream twice", E::kInvalidArgument, [](CpuBackend& b) {
    const StreamHandle s = b.create_stream();
    b.destroy_stream(s);
    b.destroy_stream(s);
  });
  add("streams", "record_event on a destroyed event", E::kInvalidArgument, [](CpuBackend& b) {
    const EventHandle e = b.create_event();
    b.destroy_event(e);
    b.record_event(e, b.default_stream());
  });
  add("graphs", "end_capture on a stream that is not capturing", E::kCapture, [](CpuBackend& b) {
    const StreamHandle s = b.create_stream();
    try {
      b.end_capture(s);
    } catch (...) {
      b.destroy_stream(s);
      throw;
    }
  });
  add("graphs", "synchronize inside a capture, then end_capture", E::kCapture, [](CpuBackend& b) {
    const StreamHandle s = b.create_stream();
    try {
      b.begin_capture(s);
      try {
        b.synchronize(s);
      } catch (const Error&) {
      }
      b.end_capture(s);
    } catch (...) {
      b.abort_capture(s);
      b.destroy_stream(s);
      throw;
    }
  });
  add("graphs", "launch_graph of a destroyed graph", E::kInvalidArgument, [](CpuBackend& b) {
    const StreamHandle s = b.create_stream();
    try {
      b.begin_capture(s);
      const GraphHandle g = b.end_capture(s);
      b.destroy_graph(g);
      b.launch_graph(g, s);
    } catch (...) {
      b.destroy_stream(s);
      throw;
    }
  });

  // ---- kernels ----
  add("kernels", "kernel of a module that is not loaded", E::kNotFound,
      [](CpuBackend& b) { b.kernel("no_such_module", "fill_u32"); });
  add("kernels", "kernel of a function the module lacks", E::kNotFound,
      [](CpuBackend& b) { b.kernel("core", "no_such_kernel"); });
  add("kernels", "launch_typed with too few arguments", E::kInvalidArgument, [](CpuBackend& b) {
    const ResolvedKernel k = b.kernel("core", "fill_u32");
    const KernelArg args[] = {KernelArg::value(std::uint32_t{1})};
    b.launch_typed(k, {1, 1, 1}, {1, 1, 1}, 0, b.default_stream(), args);
  });
  add("kernels", "fill_u32 over more elements than the buffer holds", E::kInvalidArgument,
      [](CpuBackend& b) {
        const DevicePtr p = b.alloc(64);
        try {
          ops::fill_u32(b, b.default_stream(), p, 17, 7);
        } catch (...) {
          b.free(p);
          throw;
        }
      });

  // ---- quantized GEMM ----
  add("gemm", "M = 0", E::kInvalidArgument, [](CpuBackend& b) {
    with_gemm(b, 1, [&](auto& w, DevicePtr a, DevicePtr c) {
      ops::w4a16_gemm(b, b.default_stream(), a, 0, w, c);
    });
  });
  add("gemm", "K not a multiple of 16 (NVFP4 weights claiming K = 120)", E::kInvalidArgument,
      [](CpuBackend& b) {
        with_gemm(b, 1, [&](auto& w, DevicePtr a, DevicePtr c) {
          ops::QuantWeights bad = w;
          bad.k = 120;
          ops::w4a16_gemm(b, b.default_stream(), a, 1, bad, c);
        });
      });
  add("gemm", "MXFP4 weights with K = 48 (not a multiple of 32)", E::kInvalidArgument,
      [](CpuBackend& b) {
        with_gemm(b, 1, [&](auto& w, DevicePtr a, DevicePtr c) {
          ops::QuantWeights bad = w;
          bad.format = WeightFormat::kMxfp4;
          bad.k = 48;
          ops::w4a16_gemm(b, b.default_stream(), a, 1, bad, c);
        });
      });
  add("gemm", "null A", E::kInvalidArgument, [](CpuBackend& b) {
    with_gemm(b, 1, [&](auto& w, DevicePtr, DevicePtr c) {
      ops::w4a16_gemm(b, b.default_stream(), DevicePtr{}, 1, w, c);
    });
  });
  add("gemm", "C misaligned by 2 bytes", E::kInvalidArgument, [](CpuBackend& b) {
    with_gemm(b, 1, [&](auto& w, DevicePtr a, DevicePtr c) {
      ops::w4a16_gemm(b, b.default_stream(), a, 1, w, c.offset(2));
    });
  });
  add("gemm", "C overlapping A", E::kInvalidArgument, [](CpuBackend& b) {
    with_gemm(b, 1, [&](auto& w, DevicePtr a, DevicePtr) {
      ops::w4a16_gemm(b, b.default_stream(), a, 1, w, a);
    });
  });
  add("gemm", "M = 2 with A and C sized for one row", E::kInvalidArgument, [](CpuBackend& b) {
    with_gemm(b, 1, [&](auto& w, DevicePtr a, DevicePtr c) {
      ops::w4a16_gemm(b, b.default_stream(), a, 2, w, c);
    });
  });
  add("gemm", "scale buffer of the wrong size", E::kInvalidArgument, [](CpuBackend& b) {
    with_gemm(b, 1, [&](auto& w, DevicePtr a, DevicePtr c) {
      ops::QuantWeights bad = w;
      bad.scales_bytes -= 1;
      ops::w4a16_gemm(b, b.default_stream(), a, 1, bad, c);
    });
  });
  add("gemm", "NaN tensor scale", E::kInvalidArgument, [](CpuBackend& b) {
    with_gemm(b, 1, [&](auto& w, DevicePtr a, DevicePtr c) {
      ops::QuantWeights bad = w;
      bad.tensor_scale = std::numeric_limits<float>::quiet_NaN();
      ops::w4a16_gemm(b, b.default_stream(), a, 1, bad, c);
    });
  });
  add("gemm", "E4M3 route forced while exact BF16 activations are required", E::kInvalidArgument,
      [](CpuBackend& b) {
        with_gemm(b, 1, [&](auto& w, DevicePtr a, DevicePtr c) {
          ops::w4a16_gemm(b, b.default_stream(), a, 1, w, c,
                          GemmOptions{Activations::kExactBf16, GemmRoute::kE4m3, DevicePtr{}});
        });
      });
  add("gemm", "cast_bf16_to_e4m3 of 0 elements", E::kInvalidArgument, [](CpuBackend& b) {
    const DevicePtr p = b.alloc(256), q = b.alloc(256);
    try {
      ops::cast_bf16_to_e4m3(b, b.default_stream(), p, q, 0);
    } catch (...) {
      b.free(p);
      b.free(q);
      throw;
    }
  });

  // ---- model lifetime ----
  add("model", "backend() after teardown", E::kState, [](CpuBackend&) {
    ModelScope scope(std::make_unique<CpuBackend>(CpuBackendOptions{.threads = 1}));
    scope.teardown();
    scope.backend();
  });

  // ---- discovery ----
  add("discovery", "create_backend(\"tpu\")", E::kInvalidArgument,
      [](CpuBackend&) { create_backend("tpu"); });

  // ---- safetensors ----
  add("safetensors", "a file that does not exist", E::kIo, [](CpuBackend&) {
    SafetensorsFile::open((fs::temp_directory_path() / "metrale-catalogue-missing").string());
  });
  add("safetensors", "header length beyond the end of the file", E::kIo, [](CpuBackend&) {
    SafetensorsFile::open(write_safetensors("long-header", "{}", 0, 1u << 20));
  });
  add("safetensors", "header that is not JSON", E::kIo,
      [](CpuBackend&) { SafetensorsFile::open(write_safetensors("not-json", "{\"a\": ", 0)); });
  add("safetensors", "data_offsets past the end of the data", E::kIo, [](CpuBackend&) {
    SafetensorsFile::open(write_safetensors(
        "past-end", R"({"w":{"dtype":"U8","shape":[64],"data_offsets":[0,64]}})", 32));
  });
  add("safetensors", "two tensors overlapping", E::kIo, [](CpuBackend&) {
    SafetensorsFile::open(
        write_safetensors("overlap",
                          R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},)"
                          R"("b":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})",
                          12));
  });
  add("safetensors", "shape that does not match the byte range", E::kIo, [](CpuBackend&) {
    SafetensorsFile::open(write_safetensors(
        "shape", R"({"w":{"dtype":"BF16","shape":[8],"data_offsets":[0,8]}})", 8));
  });
  add("safetensors", "unknown dtype", E::kIo, [](CpuBackend&) {
    SafetensorsFile::open(
        write_safetensors("dtype", R"({"w":{"dtype":"Q4","shape":[8],"data_offsets":[0,8]}})", 8));
  });
  add("safetensors", "tensor name that is not UTF-8", E::kIo, [](CpuBackend&) {
    SafetensorsFile::open(write_safetensors(
        "utf8", "{\"w\xff\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}", 8));
  });
  add("safetensors", "NVFP4 layer without its weight_scale tensor", E::kNotFound, [](CpuBackend&) {
    const SafetensorsFile f = SafetensorsFile::open(write_safetensors(
        "no-scale", R"({"l.weight":{"dtype":"U8","shape":[4,8],"data_offsets":[0,32]}})", 32));
    load_nvfp4_linear(f, "l");
  });
  // ---- FP8 checkpoints (DeepSeek-V3 / Qwen layout) ----
  const std::string codes(32, '\x38');  // [4, 8] of 1.0
  const std::string one = f32_bytes({1.0f});
  add("safetensors", "FP8 layer without its weight_scale_inv tensor", E::kIo,
      [=](CpuBackend&) { load_fp8_file("fp8-no-scale", "F8_E4M3", "[4,8]", codes, "", "", ""); });
  add("safetensors", "FP8 scales without their weight", E::kIo,
      [=](CpuBackend&) { load_fp8_file("fp8-no-weight", "", "", "", "F32", "[1,1]", one); });
  add("safetensors", "FP8 weight that is not F8_E4M3", E::kIo, [=](CpuBackend&) {
    load_fp8_file("fp8-weight-dtype", "F8_E5M2", "[4,8]", codes, "F32", "[1,1]", one);
  });
  add("safetensors", "FP8 weight that is not a matrix", E::kIo, [=](CpuBackend&) {
    load_fp8_file("fp8-rank", "F8_E4M3", "[32]", codes, "F32", "[1,1]", one);
  });
  add("safetensors", "FP8 weight with N = 0", E::kIo,
      [=](CpuBackend&) { load_fp8_file("fp8-empty", "F8_E4M3", "[0,8]", "", "F32", "[0,1]", ""); });
  add("safetensors", "FP8 scales that are not F32", E::kIo, [=](CpuBackend&) {
    load_fp8_file("fp8-scale-dtype", "F8_E4M3", "[4,8]", codes, "BF16", "[1,2]", one);
  });
  add("safetensors", "FP8 scales not of shape [ceil(N/128), ceil(K/128)]", E::kIo,
      [=](CpuBackend&) {
        load_fp8_file("fp8-scale-shape", "F8_E4M3", "[4,8]", codes, "F32", "[1]", one);
      });
  add("safetensors", "FP8 scales not 4-byte aligned in the file", E::kIo, [=](CpuBackend&) {
    load_fp8_file("fp8-misaligned", "F8_E4M3", "[1,3]", codes.substr(0, 3), "F32", "[1,1]", one);
  });
  add("safetensors", "FP8 scale that is NaN", E::kIo, [=](CpuBackend&) {
    load_fp8_file("fp8-nan-scale", "F8_E4M3", "[4,8]", codes, "F32", "[1,1]",
                  f32_bytes({std::numeric_limits<float>::quiet_NaN()}));
  });
  add("safetensors", "FP8 scale that is negative", E::kIo, [=](CpuBackend&) {
    load_fp8_file("fp8-neg-scale", "F8_E4M3", "[4,8]", codes, "F32", "[1,1]", f32_bytes({-2.0f}));
  });
  add("safetensors", "FP8 weight code that is NaN", E::kIo, [=](CpuBackend&) {
    std::string nan_codes = codes;
    nan_codes[13] = '\x7f';
    load_fp8_file("fp8-nan-code", "F8_E4M3", "[4,8]", nan_codes, "F32", "[1,1]", one);
  });
  return v;
}

struct Outcome {
  bool ok = false;
  std::string code, message;
};

Outcome run_case(const Case& c) {
  Outcome o;
  CpuBackend backend(CpuBackendOptions{.threads = 1});
  const std::size_t before = backend.live_bytes();
  try {
    c.run(backend);
    o.code = "(none)";
    o.message = "no error";
  } catch (const Error& e) {
    o.code = std::string(to_string(e.code()));
    o.message = e.what();
    o.ok = e.code() == c.expected && o.message.starts_with("[");
  } catch (const std::exception& e) {
    o.code = "(not metrale::Error)";
    o.message = e.what();
  }
  if (backend.live_bytes() != before) {
    o.ok = false;
    o.message +=
        fmt::format(" -- and {} bytes stayed on the ledger", backend.live_bytes() - before);
  }
  return o;
}

// Markdown table cells: no pipes or newlines.
std::string cell(std::string s) {
  for (char& ch : s) {
    if (ch == '|' || ch == '\n') ch = ' ';
  }
  return s;
}

int run(bool check) {
  int failures = 0;
  fmt::print("| area | bad input | error code | message |\n|---|---|---|---|\n");
  for (const Case& c : cases()) {
    const Outcome o = run_case(c);
    fmt::print("| {} | {} | {} | `{}` |\n", c.area, cell(c.input), o.code, cell(o.message));
    if (!o.ok) {
      ++failures;
      std::fprintf(stderr, "UNEXPECTED: %s / %s: wanted %s, got %s: %s\n", c.area.c_str(),
                   c.input.c_str(), std::string(to_string(c.expected)).c_str(), o.code.c_str(),
                   o.message.c_str());
    }
  }
  std::error_code ignored;
  for (const fs::path& p : written()) fs::remove(p, ignored);
  if (check) std::fprintf(stderr, "%d unexpected outcome(s)\n", failures);
  return check && failures ? 1 : 0;
}

}  // namespace
}  // namespace metrale::catalogue

int main(int argc, char** argv) {
  const bool check = argc > 1 && std::string_view(argv[1]) == "--check";
  return metrale::catalogue::run(check);
}

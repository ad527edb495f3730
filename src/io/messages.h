// How the safetensors reader and the ModelOpt loader word their errors: every message names the
// file and, where there is one, the tensor, "[safetensors] <path>: tensor '<name>': <what>", with
// names printed so that a byte that is not UTF-8 cannot garble the terminal.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/error.h"

namespace metrale::io {

// The API name every safetensors and ModelOpt error carries.
inline constexpr std::string_view kSafetensorsApi = "safetensors";

// Length of the valid UTF-8 sequence at s[i], or 0 when the bytes there are not one (overlong
// forms, surrogates and code points past U+10FFFF included).
std::size_t utf8_sequence(std::string_view s, std::size_t i);
// Whether all of s is valid UTF-8.
bool valid_utf8(std::string_view s);
// A name as it can be printed: valid UTF-8 stays, control characters and bytes that are not
// UTF-8 become \xNN.
std::string printable(std::string_view s);
// A shape as the messages print it: "[4, 8]".
std::string shape_str(const std::vector<std::int64_t>& shape);

// Throws Error(code, "safetensors", "<path>: <what>").
[[noreturn]] void fail_file(ErrorCode code, std::string_view path, std::string_view what);
// Throws Error(kInvalidArgument, "safetensors", "<path>: <api>: the <kind> name is empty") when
// `name` is: no lister names an empty layer or projection (a tensor named ".weight" is none's),
// so no loader takes one.
void require_name(std::string_view path, std::string_view api, std::string_view name,
                  std::string_view kind = "layer");
// Throws Error(code, "safetensors", "<path>: tensor '<tensor>': <what>").
[[noreturn]] void fail_tensor(ErrorCode code, std::string_view path, std::string_view tensor,
                              std::string_view what);

}  // namespace metrale::io

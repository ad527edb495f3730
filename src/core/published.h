// Reading a kernel's published metadata: the same rules on every backend, whatever the symbols
// are read from (a CUDA module's globals, a host module's symbol table).
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "metrale/op_cache.h"

namespace metrale {

// Bytes of a published symbol, or nullopt when the module does not publish it.
using SymbolReader = std::function<std::optional<std::vector<std::byte>>(const std::string&)>;

// Reads every <function>_<field> of src/kernels/published.def through `read`. A u32 symbol of
// another size is Error(kDriver) naming `full` (module::function) and the symbol.
KernelMeta read_published(std::string_view full, std::string_view function,
                          const SymbolReader& read);

// Whether an automatic choice may take the kernel: a device run verified it, or it is a host
// module's (the reference, kernels/verified_devices.h), and it is not a placeholder.
bool automatic_choice_allowed(const KernelMeta& meta) noexcept;

// "verified on <GPU>, <YYYY-MM-DD>", "the host reference", or "not yet run on a GPU", for
// `metrale info`; an unknown device id or a malformed date is said as such, never guessed.
std::string verification_text(const KernelMeta& meta);

}  // namespace metrale

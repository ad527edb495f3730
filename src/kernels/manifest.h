// The manifests' lists as arrays, for readers that need names rather than code per entry: the
// w4a16 entries (w4a16.def) and the fields a kernel may publish (published.def).
#pragma once

#include <array>
#include <string_view>

namespace metrale::manifest {

// The entry names of kernels/w4a16.def, in its order.
inline constexpr auto kW4a16Entries = std::to_array<std::string_view>({
#define METRALE_W4A16_ENTRY(entry, Params, route) #entry,
#include "kernels/w4a16.def"
#undef METRALE_W4A16_ENTRY
});

// The symbol suffixes of kernels/published.def ("_n_tile", ..., "_a_e4m3"), in its order.
inline constexpr auto kPublishedSuffixes = std::to_array<std::string_view>({
#define METRALE_PUBLISHED_U32(field) "_" #field,
#define METRALE_PUBLISHED_FLAG(field) "_" #field,
#include "kernels/published.def"
#undef METRALE_PUBLISHED_U32
#undef METRALE_PUBLISHED_FLAG
});

}  // namespace metrale::manifest

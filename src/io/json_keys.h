// Duplicate keys in JSON text. nlohmann's DOM parser keeps the last of two equal keys, and its
// parser callback, the other way to see them, walks the parent object each time a child object
// closes: quadratic in a safetensors header's tensor count (47 s for 74,496 tensors, a review's
// measure). This scans the text once with a SAX handler instead.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace metrale::io {

// A key that appears twice in one object: `key`, in the root (depth 1) or in the object that is
// the root's member `parent` (depth 2).
struct DuplicateKey {
  int depth = 1;
  std::string parent;  // empty at depth 1
  std::string key;
};

// The first duplicate key of the objects `watched` names (depth 1: the root, parent ""; depth
// 2: the root's member `parent`), in one linear pass; nullopt when there is none or the text
// does not parse (the caller's parse reports that).
std::optional<DuplicateKey> first_duplicate_key(
    std::string_view text, const std::function<bool(int depth, std::string_view parent)>& watched);

}  // namespace metrale::io

// Where an allocation or lookup was asked for: the caller's file and line, captured by
// std::source_location defaulted at the public call so records name user code, not backends.
#pragma once

#include <cstdint>
#include <source_location>
#include <string>

namespace metrale {

// A file:line pair; function names are left out to keep reports short.
struct CallSite {
  const char* file = "?";
  std::uint32_t line = 0;

  // Captures the location of the caller of the function that defaults this argument.
  static CallSite from(const std::source_location& loc) noexcept {
    return CallSite{loc.file_name(), static_cast<std::uint32_t>(loc.line())};
  }
  // "file:line", with the file's directories dropped.
  std::string str() const;
  // Just the file name, without directories.
  std::string file_name() const;
};

}  // namespace metrale

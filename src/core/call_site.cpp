#include "metrale/call_site.h"

#include <string_view>

namespace metrale {

std::string CallSite::file_name() const {
  std::string_view f(file == nullptr ? "?" : file);
  const auto slash = f.find_last_of('/');
  return std::string(slash == std::string_view::npos ? f : f.substr(slash + 1));
}

std::string CallSite::str() const {
  return file_name() + ":" + std::to_string(line);
}

}  // namespace metrale

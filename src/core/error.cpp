#include "metrale/error.h"

#include <string>

namespace metrale {

std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid_argument";
    case ErrorCode::kOutOfMemory:
      return "out_of_memory";
    case ErrorCode::kNotFound:
      return "not_found";
    case ErrorCode::kUnavailable:
      return "unavailable";
    case ErrorCode::kDeviceFault:
      return "device_fault";
    case ErrorCode::kCapture:
      return "capture";
    case ErrorCode::kState:
      return "state";
    case ErrorCode::kDriver:
      return "driver";
    case ErrorCode::kIo:
      return "io";
    case ErrorCode::kTimeout:
      return "timeout";
    case ErrorCode::kInternal:
      return "internal";
  }
  return "unknown";
}

namespace {
std::string compose(std::string_view api, std::string_view message) {
  std::string s;
  s.reserve(api.size() + message.size() + 3);
  s += '[';
  s += api;
  s += "] ";
  s += message;
  return s;
}
}  // namespace

Error::Error(ErrorCode code, std::string_view api, std::string_view message)
    : std::runtime_error(compose(api, message)), code_(code), api_(api), message_(message) {}

}  // namespace metrale

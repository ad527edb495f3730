// The one exception type of metrale. Every user-facing failure is an Error whose message starts
// with the API name in brackets ("[alloc] ..."), so a log line says which call went wrong.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

namespace metrale {

// What kind of failure an Error reports; callers branch on this, people read the message.
enum class ErrorCode {
  kInvalidArgument,  // the caller passed a bad value (shape, pointer, size, handle)
  kOutOfMemory,      // an allocation could not be satisfied
  kNotFound,         // a module, kernel, symbol or resource does not exist
  kUnavailable,      // a backend or feature is not usable on this machine
  kDeviceFault,      // the device reported a fault; later calls may keep failing
  kCapture,          // the operation is not allowed while a stream is capturing (or vice versa)
  kState,            // the object is in the wrong state for the call (released, busy, ...)
  kDriver,           // a driver or OS call failed for another reason
  kIo,               // a file could not be read or is malformed
  kTimeout,          // a wait reached its limit (a collective whose peers did not answer)
  kInternal,         // an invariant of metrale itself broke: a bug to report
};

// Stable lower-case name of a code, e.g. "invalid_argument".
std::string_view to_string(ErrorCode code) noexcept;

// An exception carrying a code and a message of the form "[api] what went wrong".
class Error : public std::runtime_error {
 public:
  // Builds "[api] message"; api is the public call that failed.
  Error(ErrorCode code, std::string_view api, std::string_view message);

  // The failure kind.
  ErrorCode code() const noexcept { return code_; }
  // The public call that failed, as given to the constructor ("alloc").
  const std::string& api() const noexcept { return api_; }
  // The message without the "[api] " prefix: the reason itself, for callers that pass it on
  // (discovery reports why a backend is unavailable from it, never by parsing what()).
  const std::string& message() const noexcept { return message_; }

 private:
  ErrorCode code_;
  std::string api_;
  std::string message_;
};

}  // namespace metrale

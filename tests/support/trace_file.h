// Test helpers for the launch trace (METRALE_TRACE): a scoped switch with a fresh path per use,
// and the reader of the file's complete ("ph": "X") events.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace metrale::testing {

// Sets METRALE_TRACE to a new file under the temp directory (a new path each time: the
// process keeps each path's trace open to its end) and unsets it on destruction.
class TraceSwitch {
 public:
  explicit TraceSwitch(const std::string& path = fresh_path()) : path_(path) {
    setenv("METRALE_TRACE", path_.c_str(), 1);
  }
  ~TraceSwitch() {
    unsetenv("METRALE_TRACE");
    std::error_code ec;
    std::filesystem::remove(path_, ec);
  }
  TraceSwitch(const TraceSwitch&) = delete;
  TraceSwitch& operator=(const TraceSwitch&) = delete;
  const std::string& path() const { return path_; }

  static std::string fresh_path() {
    static std::atomic<int> n{0};
    return (std::filesystem::temp_directory_path() /
            ("metrale-trace-" + std::to_string(getpid()) + "-" + std::to_string(n++) + ".json"))
        .string();
  }

 private:
  std::string path_;
};

// The whole trace document; a parse failure fails the test and returns null.
inline nlohmann::json read_trace(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    ADD_FAILURE() << "no trace file at " << path;
    return nullptr;
  }
  try {
    return nlohmann::json::parse(in);
  } catch (const std::exception& e) {
    ADD_FAILURE() << "the trace at " << path << " is not JSON: " << e.what();
    return nullptr;
  }
}

// The trace's launches: its complete events.
inline std::vector<nlohmann::json> traced_launches(const nlohmann::json& doc) {
  std::vector<nlohmann::json> out;
  if (!doc.is_object() || !doc.contains("traceEvents")) return out;
  for (const auto& e : doc["traceEvents"]) {
    if (e.value("ph", "") == "X") out.push_back(e);
  }
  return out;
}

}  // namespace metrale::testing

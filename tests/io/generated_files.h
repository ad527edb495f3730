// The safetensors files tests/io/make_safetensors.py writes, shared by the io tests of
// core_tests: ctest's fixture safetensors.make_files writes them and hands the folder over in
// METRALE_SAFETENSORS_DIR (to suites whose name starts with "Safetensors"); a run without it
// (./core_tests) runs the script itself, once, into a temporary folder removed at exit.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <vector>

namespace metrale::testing {

// Runs the generator into a temporary folder (and removes it at exit) when ctest's fixture did
// not provide one.
class GeneratedFiles {
 public:
  GeneratedFiles() {
    if (const char* env = std::getenv("METRALE_SAFETENSORS_DIR"); env && *env) {
      dir_ = env;
      return;
    }
    dir_ = std::filesystem::path(::testing::TempDir()) /
           fmt::format("metrale-safetensors-{}", ::getpid());
    owned_ = true;
    const std::string cmd =
        fmt::format("python3 '{}' '{}'", METRALE_SAFETENSORS_SCRIPT, dir_.string());
    if (std::system(cmd.c_str()) != 0) error_ = "failed: " + cmd;
  }
  ~GeneratedFiles() {
    std::error_code ec;
    if (owned_) std::filesystem::remove_all(dir_, ec);
  }
  GeneratedFiles(const GeneratedFiles&) = delete;
  GeneratedFiles& operator=(const GeneratedFiles&) = delete;

  const std::filesystem::path& dir() const { return dir_; }
  const std::string& error() const { return error_; }

 private:
  std::filesystem::path dir_;
  bool owned_ = false;
  std::string error_;
};

// The one GeneratedFiles of the test program (inline: every test file shares it).
inline const GeneratedFiles& files() {
  static const GeneratedFiles f;
  return f;
}

// The path of one generated file; fails the test when the files could not be made.
inline std::string path_of(std::string_view name) {
  EXPECT_EQ(files().error(), "") << "run scripts/install-deps.sh (python3 with safetensors, numpy)";
  return (files().dir() / name).string();
}

// A generated sidecar's bytes.
inline std::vector<std::uint8_t> read_bin(std::string_view name) {
  std::ifstream in(path_of(name), std::ios::binary);
  EXPECT_TRUE(in) << name;
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace metrale::testing

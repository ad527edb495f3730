#include "comm/id_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <fmt/format.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <thread>
#include <vector>

#include "metrale/error.h"

namespace metrale::comm {
namespace {

constexpr std::string_view kApi = "Communicator::create";
// Leads the file, so a stray file of the right size is not taken for an id.
constexpr std::array<char, 8> kMagic = {'m', 't', 'r', 'l', '-', 'i', 'd', '1'};

void fail_io(const std::string& path, std::string_view what) {
  throw Error(ErrorCode::kIo, kApi,
              fmt::format("id file {}: {}: {}", path, what, std::strerror(errno)));
}

}  // namespace

void write_id_file(const std::string& path, std::span<const std::byte> bytes) {
  const std::string temp = fmt::format("{}.tmp.{}", path, ::getpid());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) fail_io(temp, "cannot create");
  std::vector<char> all(kMagic.begin(), kMagic.end());
  const auto* data = reinterpret_cast<const char*>(bytes.data());
  all.insert(all.end(), data, data + bytes.size());
  std::size_t done = 0;
  while (done < all.size()) {
    const ssize_t n = ::write(fd, all.data() + done, all.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      ::unlink(temp.c_str());
      fail_io(temp, "cannot write");
    }
    done += static_cast<std::size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    ::unlink(temp.c_str());
    fail_io(temp, "cannot flush");
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    ::unlink(temp.c_str());
    fail_io(path, "cannot rename the temporary file into place");
  }
}

void read_id_file(const std::string& path, std::span<std::byte> bytes,
                  std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const std::size_t want = kMagic.size() + bytes.size();
  for (;;) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      std::vector<char> all(want + 1);
      std::size_t got = 0;
      for (;;) {
        const ssize_t n = ::read(fd, all.data() + got, all.size() - got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) break;
        got += static_cast<std::size_t>(n);
      }
      ::close(fd);
      if (got != want || std::memcmp(all.data(), kMagic.data(), kMagic.size()) != 0) {
        throw Error(ErrorCode::kIo, kApi,
                    fmt::format("id file {} holds {} bytes that are not an id metrale wrote "
                                "(expected {} bytes starting 'mtrl-id1')",
                                path, got, want));
      }
      std::memcpy(bytes.data(), all.data() + kMagic.size(), bytes.size());
      return;
    }
    if (errno != ENOENT) fail_io(path, "cannot open");
    if (std::chrono::steady_clock::now() >= deadline) {
      throw Error(ErrorCode::kTimeout, kApi,
                  fmt::format("id file {} did not appear within {} ms: rank 0 has not written it "
                              "(is it running, with the same path?)",
                              path, timeout.count()));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace metrale::comm

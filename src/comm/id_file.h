// A rendezvous through a file: rank 0 writes a few bytes (NCCL's unique id), every other rank
// waits for them. The write is atomic (a temporary file renamed into place), so a reader never
// sees half of it.
#pragma once

#include <chrono>
#include <cstddef>
#include <span>
#include <string>

namespace metrale::comm {

// Writes bytes to path atomically. Throws Error(kIo) naming the path and the OS error.
void write_id_file(const std::string& path, std::span<const std::byte> bytes);

// Waits until path holds exactly bytes.size() bytes written by write_id_file, then reads them.
// Throws Error(kTimeout) naming the path when it does not appear within timeout, Error(kIo) when
// it holds something else.
void read_id_file(const std::string& path, std::span<std::byte> bytes,
                  std::chrono::milliseconds timeout);

}  // namespace metrale::comm

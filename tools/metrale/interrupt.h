// Ctrl-C during a long command: the first SIGINT asks the command to stop after the case it is
// running, so it still tears its model down (and reports it) before it exits with kInterrupted.
// A second SIGINT ends the process at once, as the default handler would.
#pragma once

namespace metrale::cli {

// The exit code of a command stopped by Ctrl-C: 128 + SIGINT, as a shell reports it.
inline constexpr int kInterrupted = 130;

// While alive, SIGINT sets the flag interrupted() reads instead of ending the process; the
// previous handler comes back when it goes. One at a time per process.
class InterruptScope {
 public:
  InterruptScope();
  InterruptScope(const InterruptScope&) = delete;
  InterruptScope& operator=(const InterruptScope&) = delete;
  ~InterruptScope();
};

// Whether SIGINT arrived since the innermost InterruptScope began.
bool interrupted() noexcept;

}  // namespace metrale::cli

#include "interrupt.h"

#include <csignal>

namespace metrale::cli {
namespace {

volatile std::sig_atomic_t g_interrupted = 0;
struct sigaction g_previous {};

extern "C" void on_sigint(int) {
  if (g_interrupted) {  // the second Ctrl-C: the user wants out now
    std::signal(SIGINT, SIG_DFL);
    std::raise(SIGINT);
    return;
  }
  g_interrupted = 1;
}

}  // namespace

InterruptScope::InterruptScope() {
  g_interrupted = 0;
  struct sigaction action {};
  action.sa_handler = on_sigint;
  sigemptyset(&action.sa_mask);
  sigaction(SIGINT, &action, &g_previous);
}

InterruptScope::~InterruptScope() {
  sigaction(SIGINT, &g_previous, nullptr);
}

bool interrupted() noexcept {
  return g_interrupted != 0;
}

}  // namespace metrale::cli

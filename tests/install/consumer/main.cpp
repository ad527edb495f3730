// A program outside the metrale tree: allocates through an installed metrale, runs an op,
// tears the model down and checks that nothing is left.
#include <metrale/cpu_backend.h>
#include <metrale/model_scope.h>
#include <metrale/ops/elementwise.h>

#include <cstdio>
#include <memory>
#include <vector>

int main() {
  auto backend = std::make_unique<metrale::CpuBackend>();
  const metrale::LedgerProbe probe = backend->ledger_probe();
  metrale::ModelScope scope(std::move(backend));
  metrale::Backend& b = scope.backend();
  const std::size_t n = 1000;
  const metrale::DevicePtr p = scope.alloc_buffer("consumer", n * 4);
  metrale::ops::fill_u32(b, b.default_stream(), p, n, 7u);
  std::vector<unsigned> out(n);
  b.copy_d2h(out.data(), p, n * 4);
  for (unsigned v : out) {
    if (v != 7u) return 1;
  }
  scope.teardown();
  std::printf("consumer ok: %zu live bytes after teardown\n", probe.live_bytes());
  return probe.live_bytes() == 0 ? 0 : 1;
}

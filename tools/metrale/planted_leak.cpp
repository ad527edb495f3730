#include "planted_leak.h"

namespace metrale::cli {

void plant_leak_for_tests([[maybe_unused]] Backend& backend) {
#ifdef METRALE_CLI_PLANT_LEAK
  (void)backend.alloc(4321);
#endif
}

}  // namespace metrale::cli

// The w4a16 manifest's names against the published fields (kernels/w4a16.def,
// kernels/published.def): a module publishes entry e's field f as the global e_f beside its
// kernels, so no entry may be named as another entry's field. Were one named so, a CUDA module
// would hold a function and a global of one name, and a reader of e's field would depend on how
// the driver tells them apart (cuModuleGetGlobal on a function's name), which no test without a
// device can show.
#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace metrale {
namespace {

std::vector<std::string> entries() {
  return {
#define METRALE_W4A16_ENTRY(entry, Params, route) #entry,
#include "kernels/w4a16.def"
#undef METRALE_W4A16_ENTRY
  };
}

std::vector<std::string> fields() {
  return {
#define METRALE_PUBLISHED_U32(field) #field,
#define METRALE_PUBLISHED_FLAG(field) #field,
#include "kernels/published.def"
#undef METRALE_PUBLISHED_U32
#undef METRALE_PUBLISHED_FLAG
  };
}

TEST(ManifestNames, NoEntryIsNamedAsAnotherEntrysPublishedField) {
  const std::vector<std::string> names = entries(), published = fields();
  ASSERT_GT(names.size(), 5u);
  ASSERT_GT(published.size(), 5u);
  for (const std::string& e : names) {
    for (const std::string& f : published) {
      for (const std::string& other : names) {
        EXPECT_NE(other, e + "_" + f) << "entry " << other << " is also the name of entry " << e
                                      << "'s published field " << f;
      }
    }
  }
}

}  // namespace
}  // namespace metrale

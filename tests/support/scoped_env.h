// An environment switch set for one scope (a test, or part of one) and unset after it.
#pragma once

#include <cstdlib>

namespace metrale::testing {

class ScopedEnv {
 public:
  // Sets name to value (both must outlive the object) until the destructor unsets it.
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  const char* name_;
};

}  // namespace metrale::testing

// Runs a callable that must throw metrale::Error and hands the error back, so a test can assert
// on its code and message. A callable that returns normally (or throws something else) fails
// the test at the caller's line.
#pragma once

#include <gtest/gtest.h>

#include <exception>
#include <source_location>
#include <string>
#include <utility>

#include "metrale/error.h"

namespace metrale::testing {

template <class F>
Error expect_error(F&& f, std::source_location loc = std::source_location::current()) {
  try {
    std::forward<F>(f)();
  } catch (const Error& e) {
    return e;
  } catch (const std::exception& e) {
    ADD_FAILURE_AT(loc.file_name(), static_cast<int>(loc.line()))
        << "expected metrale::Error, got another exception: " << e.what();
    return Error(ErrorCode::kInternal, "expect_error", "another exception was thrown");
  }
  ADD_FAILURE_AT(loc.file_name(), static_cast<int>(loc.line()))
      << "expected metrale::Error, nothing was thrown";
  return Error(ErrorCode::kInternal, "expect_error", "nothing was thrown");
}

}  // namespace metrale::testing

// expr must throw metrale::Error with `code` and a message containing `text`.
#define EXPECT_ERROR(expr, want, text)                                                   \
  do {                                                                                   \
    const ::metrale::Error e_ = ::metrale::testing::expect_error([&] { (void)(expr); }); \
    EXPECT_EQ(e_.code(), (want)) << e_.what();                                           \
    EXPECT_NE(std::string(e_.what()).find(text), std::string::npos) << e_.what();        \
  } while (0)

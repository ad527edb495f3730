// metrale::Error as Python exceptions. The classes live in metrale/errors.py (so they can carry
// docstrings and multiple bases: InvalidArgumentError is a ValueError, DtypeError a TypeError
// too); the package hands them over at import, and this translator raises the one for the code,
// with the "[api] message" text and the attributes code, api and reason.
#include <nanobind/stl/string.h>

#include <exception>
#include <string>

#include "bindings.h"

namespace nb = nanobind;

namespace metrale::py {
namespace {

// Raises cls(what) with the Error's parts as attributes; RuntimeError when cls is missing (the
// package was imported without errors.py, which only a broken install does).
void raise(nb::handle cls, const Error& e) {
  if (!cls.is_valid() || cls.is_none()) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return;
  }
  nb::object exc = cls(e.what());
  exc.attr("code") = std::string(to_string(e.code()));
  exc.attr("api") = e.api();
  exc.attr("reason") = e.message();
  PyErr_SetObject(cls.ptr(), exc.ptr());
}

nb::object error_class(const char* key) {
  nb::object mod = nb::module_::import_("metrale._metrale");
  if (!nb::hasattr(mod, "_error_classes")) return nb::none();
  nb::dict classes = nb::borrow<nb::dict>(mod.attr("_error_classes"));
  return classes.contains(key) ? nb::object(classes[key]) : nb::none();
}

}  // namespace

void bind_errors(nb::module_& m) {
  m.def(
      "_set_error_classes",
      [](nb::dict classes) {
        nb::module_::import_("metrale._metrale").attr("_error_classes") = classes;
      },
      "Registers the exception class for each ErrorCode name (and 'dtype'); errors.py calls it.");
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const DtypeError& e) {
      raise(error_class("dtype"), e);
    } catch (const Error& e) {
      raise(error_class(std::string(to_string(e.code())).c_str()), e);
    }
  });
}

}  // namespace metrale::py

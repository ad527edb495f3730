"""metrale's exceptions: one class per C++ ErrorCode, each keeping the "[api] message" text.

Every class derives from Error, so ``except metrale.Error`` catches them all, and from the
built-in exception a Python caller would expect: a bad argument is a ValueError (and a wrong
dtype a TypeError too); anything the machine or the runtime refused is a RuntimeError.
"""

from __future__ import annotations


class Error(Exception):
    """A failure reported by metrale.

    Attributes:
        code: the C++ ErrorCode name, e.g. "invalid_argument".
        api: the call that failed, e.g. "gemm".
        reason: the message without the "[api] " prefix.
    """

    code = "internal"
    api = ""
    reason = ""


class InvalidArgumentError(Error, ValueError):
    """The caller passed a bad value: a shape, size, pointer, option or device."""

    code = "invalid_argument"


class DtypeError(InvalidArgumentError, TypeError):
    """An array argument of the wrong element type (or not an array at all)."""


class OutOfMemoryError(Error, RuntimeError):
    """An allocation could not be satisfied."""

    code = "out_of_memory"


class NotFoundError(Error, RuntimeError):
    """A module, kernel, tensor or resource does not exist."""

    code = "not_found"


class UnavailableError(Error, RuntimeError):
    """A backend or feature is not usable on this machine."""

    code = "unavailable"


class DeviceFaultError(Error, RuntimeError):
    """The device reported a fault; later calls may keep failing."""

    code = "device_fault"


class CaptureError(Error, RuntimeError):
    """The operation is not allowed while a stream is capturing."""

    code = "capture"


class StateError(Error, RuntimeError):
    """The object is in the wrong state for the call (e.g. the model is closed)."""

    code = "state"


class DriverError(Error, RuntimeError):
    """A driver or OS call failed."""

    code = "driver"


class IoError(Error, RuntimeError):
    """A file could not be read or is malformed."""

    code = "io"


class TimedOutError(Error, TimeoutError):
    """A wait reached its limit: a collective whose other ranks did not answer in time."""

    code = "timeout"


class InternalError(Error, RuntimeError):
    """An invariant of metrale itself broke: a bug to report."""

    code = "internal"


class LeakError(Error, RuntimeError):
    """Teardown found memory that no resource gave back; ``report`` says where it was made."""

    code = "state"

    def __init__(self, message: str, report: object = None) -> None:
        super().__init__(message)
        self.api = "teardown"
        self.reason = message.removeprefix("[teardown] ")
        self.report = report


BY_CODE: dict[str, type[Error]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        OutOfMemoryError,
        NotFoundError,
        UnavailableError,
        DeviceFaultError,
        CaptureError,
        StateError,
        DriverError,
        IoError,
        TimedOutError,
        InternalError,
    )
}


def argument_error(api: str, message: str, cls: type[Error] = InvalidArgumentError) -> Error:
    """An error raised by the Python layer, shaped as the extension's are."""
    err = cls(f"[{api}] {message}")
    err.api, err.reason = api, message
    return err

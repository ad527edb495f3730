"""What `pip install .` put in place: the extension, its type stubs, the CLI, the errors' map."""

from __future__ import annotations

import os
from pathlib import Path

import metrale
from metrale import _metrale, errors
from metrale.__main__ import cli_path

PACKAGE = Path(metrale.__file__).parent


def test_stubs_and_marker_ship_with_the_extension():
    assert (PACKAGE / "py.typed").exists()
    stub = (PACKAGE / "_metrale.pyi").read_text()
    for name in ("class HostWeights", "class Weights", "class Plan", "def backends",
                 "def quantize_nvfp4", "def load_safetensors"):
        assert name in stub, name


def test_cli_ships_beside_the_package():
    assert os.access(cli_path(), os.X_OK)


def test_every_error_code_has_its_class():
    codes = {"invalid_argument", "out_of_memory", "not_found", "unavailable", "device_fault",
             "capture", "state", "driver", "io", "timeout", "internal"}
    assert set(errors.BY_CODE) == codes
    assert issubclass(metrale.InvalidArgumentError, ValueError)
    assert issubclass(metrale.DtypeError, TypeError) and issubclass(metrale.DtypeError, ValueError)
    for cls in errors.BY_CODE.values():
        assert issubclass(cls, metrale.Error)
        assert (cls is metrale.InvalidArgumentError or issubclass(cls, RuntimeError)
                or cls is metrale.TimedOutError)
    assert issubclass(metrale.TimedOutError, TimeoutError)
    assert set(_metrale._error_classes) == codes | {"dtype"}


def test_public_names_have_docstrings():
    for name in metrale.__all__:
        obj = getattr(metrale, name)
        assert obj.__doc__, name

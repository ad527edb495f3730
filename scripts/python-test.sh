#!/usr/bin/env bash
# The Python package's tests: a virtual environment in build/venv with the package installed by
# pip (scikit-build-core through the project's CMake), torch and transformers beside it, then
# pytest over python/tests.
#
# It reuses the tree test.sh has just built (build/, the ci preset) as pip's build directory, so
# the library is compiled once: pip adds only the extension and the CLI beside it. A plain
# `pip install .` builds the same in its own tree (build-py/); README.md, "Python".
set -euo pipefail
cd "$(dirname "$0")/.."

venv=$PWD/build/venv
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
  numpy ml_dtypes pytest matplotlib nanobind scikit-build-core
# metrale.torch's tests: PyTorch and transformers from PyPI (torch pulls its CUDA libraries, about
# 3 GB, two minutes here), and the libraries that wrote the test checkpoints, which read each
# quantized layer back for the whole-model test (compressed-tensors, ModelOpt; the quantizers
# themselves are not needed: tests/fixtures/models/make_models.py), the versions they were
# written against. Their tests fail rather than skip when these are missing
# (METRALE_TEST_REQUIRE, python/tests/conftest.py).
# (ModelOpt imports requests without declaring it.)
"$venv/bin/python" -m pip install -q --disable-pip-version-check \
  torch==2.15.0 transformers==5.17.0 safetensors compressed-tensors==0.20.1 \
  nvidia-modelopt==0.47.0 requests
export METRALE_TEST_REQUIRE=torch,transformers,compressed_tensors,modelopt
# The ci tree's own settings, so that pip's configure keeps everything it built.
"$venv/bin/python" -m pip install -q --disable-pip-version-check --no-build-isolation \
  -C build-dir=build -C cmake.build-type=RelWithDebInfo \
  -C cmake.define.METRALE_BUILD_TESTS=ON -C cmake.define.METRALE_BUILD_BENCH=ON \
  -C cmake.define.METRALE_WERROR=ON .
# From the tests' folder, so `import metrale` finds the installed package, not python/metrale.
cd python/tests
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"

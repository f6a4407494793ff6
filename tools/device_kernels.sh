#!/usr/bin/env bash
# Device-machine preamble for kernel runs without the CuTe DSL: tvm-ffi from the carried wheel, the DSL's runtime
# library from the carried .xz, mokgen from the repo. Source it: `source tools/device_kernels.sh`.
set -e
mkdir -p /tmp/site /tmp/rt
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .devdeps/apache_tvm_ffi-*.whl
[ -f /tmp/rt/libcute_dsl_runtime.so ] || xz -dc .devdeps/libcute_dsl_runtime.so.xz > /tmp/rt/libcute_dsl_runtime.so
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export MOKGEN_RUNTIME_LIB=/tmp/rt/libcute_dsl_runtime.so
export PYTHONUNBUFFERED=1
export TVM_FFI_DISABLE_TORCH_C_DLPACK=1
set +e

#!/usr/bin/env bash
# Source this at the start of a device-machine run, from the repository root:
#
#     source tools/device_env.sh
#
# The GPU machine has torch on Python 3.12 but neither apache-tvm-ffi nor the CuTe DSL, and no registry.
# What the call carries is installed into /tmp/site (kept while the machine stays warm; done once):
#   .whl/*.whl, .devdeps/*.whl                 wheels (tvm-ffi for cp312), installed with pip --no-index --target
#   .devdeps/cutlass-dsl-*.tar.xz              the CuTe DSL bundle (../shared/device/README.md), if present
#   .devdeps/libcute_dsl_runtime.so.xz         the DSL runtime alone (for loading prebuilt kernels) -> MOKGEN_RUNTIME_LIB
#   .prebuilt/*.tar.xz                         `mokgen cache pack` archives, unpacked into $MOKGEN_CACHE_DIR
# and PYTHONPATH is set so that `import mokgen` works from the repository root; MOKGEN_GPU_TAG names the card
# (h200, h100, ...) for the record files the device scripts write.
# It never exits the calling shell; it returns non-zero (and says why) if a step fails.

_mokgen_env() {
  local site=${MOKGEN_DEVICE_SITE:-/tmp/site} py=${PYTHON:-python3} f stamp
  mkdir -p "$site" || return 1

  local wheels=()
  for f in .whl/*.whl .devdeps/*.whl; do [ -f "$f" ] && wheels+=("$f"); done
  if [ ${#wheels[@]} -gt 0 ]; then
    stamp=$site/.mokgen-wheels.$(cat "${wheels[@]}" | sha256sum | cut -c1-16)
    if [ ! -f "$stamp" ]; then
      echo "device_env: installing ${wheels[*]} into $site" >&2
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "${wheels[@]}" || { echo "device_env: pip install of ${wheels[*]} failed" >&2; return 1; }
      touch "$stamp"
    fi
  fi

  local dsl=""
  for f in .devdeps/cutlass-dsl-*.tar.xz; do [ -f "$f" ] && dsl=$f; done
  if [ -n "$dsl" ]; then
    stamp=$site/.mokgen-dsl.$(basename "$dsl")
    if [ ! -f "$stamp" ]; then
      echo "device_env: unpacking $dsl into $site" >&2
      tar -C "$site" -xJf "$dsl" || { echo "device_env: cannot unpack $dsl" >&2; return 1; }
      touch "$stamp"
    fi
  fi

  if [ -f .devdeps/libcute_dsl_runtime.so.xz ] && [ -z "$dsl" ]; then
    mkdir -p "$site/runtime"
    if [ ! -f "$site/runtime/libcute_dsl_runtime.so" ]; then
      xz -dc .devdeps/libcute_dsl_runtime.so.xz > "$site/runtime/libcute_dsl_runtime.so.tmp" \
        && mv "$site/runtime/libcute_dsl_runtime.so.tmp" "$site/runtime/libcute_dsl_runtime.so" \
        || { echo "device_env: cannot unpack the DSL runtime" >&2; return 1; }
    fi
    export MOKGEN_RUNTIME_LIB=$site/runtime/libcute_dsl_runtime.so
  fi

  local pp=$site
  [ -d "$site/nvidia_cutlass_dsl/dsl_packages" ] && pp=$site/nvidia_cutlass_dsl/dsl_packages:$pp
  export PYTHONPATH=$pp:$PWD${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONUNBUFFERED=1
  export MOKGEN_CACHE_DIR=${MOKGEN_CACHE_DIR:-/tmp/mokgen-cache}

  for f in .prebuilt/*.tar.xz; do
    [ -f "$f" ] || continue
    "$py" -m mokgen cache unpack "$f" >&2 || { echo "device_env: cannot unpack $f" >&2; return 1; }
  done

  "$py" - <<'PY' >&2 || return 1
import importlib.util as u, sys
have = {m: u.find_spec(m) is not None for m in ("torch", "tvm_ffi", "cutlass", "mokgen")}
print("device_env: python %s; %s" % (sys.version.split()[0], ", ".join(f"{m} {'ok' if v else 'missing'}"
      for m, v in have.items())))
sys.exit(0 if have["mokgen"] else 1)
PY
  # the card's tag for record file names (mokgen.tunedb.gpu_tag: h200, h100, ...), so that a call's records go to
  # bench/results/<kind>-<tag>.json, the file tools/merge_records.py takes them into
  MOKGEN_GPU_TAG=$("$py" -c "import torch, mokgen.tunedb as t; print(t.gpu_tag(torch.cuda.get_device_name(0)))" \
    2>/dev/null || echo unknown)
  export MOKGEN_GPU_TAG
}
_mokgen_env
_mokgen_env_rc=$?
unset -f _mokgen_env
if [ "$_mokgen_env_rc" -ne 0 ]; then echo "device_env: FAILED" >&2; fi
(exit "$_mokgen_env_rc")

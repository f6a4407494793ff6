"""Hardware counters for our kernels next to cuBLAS's on the same work (kernel author's tool, GPU + Nsight Compute).

    ncu --clock-control none --profile-from-start off --set full -o OUT python tools/ncu_profile.py ITEM [...]

ITEM is a built library or cache entry as for tools/kernel_check.py (``BUILD_DIR:SPEC``, ``SPEC[@k=v+k=v]``:
its routing, GEMM 1, GEMM 2 and combine kernels, once each) or ``torch:layer:SPEC`` (the spec's two GEMMs as
dense ``torch.mm`` over all its rows, as the bench's ``dense_layer_mm``). Every item runs once outside the
profiled range (warm-up, loading), then once inside ``cudaProfilerStart/Stop``, so ncu sees each kernel exactly
once, in the order this script prints on stdout (``label`` lines): that is how ncu's rows map to our phases.
The counters that are independent of the clock (instructions, bytes between L2 and the SMs, shared-memory
wavefronts, tensor-pipe cycles per clock) are the point; ncu's kernel durations are single cold launches.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_check import Setup, resolve_item  # noqa: E402
from probe_clocks import _torch_item  # noqa: E402  (the bench's dense_layer_mm operands, each GEMM alone)


def main(argv=None) -> int:
    items = sys.argv[1:] if argv is None else argv
    if not items:
        print(__doc__, file=sys.stderr)
        return 2
    import tvm_ffi

    cudart = torch.cuda.cudart()
    for item in items:
        if item.startswith("torch:layer:"):
            _, phases = _torch_item("layer", item.split(":", 2)[2])
            steps = [(name, fn) for name, (fn, _) in phases.items() if name != "chain"]
            for _, fn in steps:
                fn()
            torch.cuda.synchronize()
            cudart.cudaProfilerStart()
            for name, fn in steps:
                print(f"label {item} {name}", flush=True)
                fn()
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()
            continue
        d, s = resolve_item(item)
        st = Setup(d, s, None)
        w = st.ws()
        st.run(w)
        torch.cuda.synchronize()
        with tvm_ffi.use_torch_stream():
            cudart.cudaProfilerStart()
            for name, step in st.steps:
                if name == "gemm1" and st.xg is not None:
                    print(f"label {item} gather", flush=True)
                print(f"label {item} {name}", flush=True)
                step(w, None)
            torch.cuda.synchronize()
            cudart.cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

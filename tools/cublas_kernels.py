#!/usr/bin/env python
"""Which kernel does torch (cuBLAS / CUTLASS) run for a GEMM? (kernel author's tool, GPU.) Prints the CUDA kernel
names the torch profiler sees for ``torch.mm`` on bf16 operands and for ``torch._grouped_mm`` as the
``torch_gemm_only`` baseline calls it, for the given shapes; the names encode tile, cluster and schedule.

    python tools/cublas_kernels.py [SPEC ...]      (default: kimi-k2 deepseek-v4-pro glm-5; plus 8192^3)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mokgen import baselines as B  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402


def kernels(fn) -> list[str]:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in names:
            names.append(e.name)
    return names


def main(argv=None) -> int:
    specs = (argv if argv is not None else sys.argv[1:]) or ["kimi-k2", "deepseek-v4-pro", "glm-5"]
    dev = "cuda"
    r = lambda *s: torch.randn(*s, device=dev).to(torch.bfloat16)  # noqa: E731
    a = r(8192, 8192)
    print("mm 8192^3:", kernels(lambda: torch.mm(a, a)))
    for name in specs:
        spec = load_spec(name)
        rows, H, I, G = spec.rows, spec.hidden, spec.ffn, spec.groups
        x, w1, w2 = r(spec.tokens, H), r(G, 2 * I, H), r(G, H, I)
        d = B.prepare_dense_layer(x, w1, w2, rows)  # the bench's dense_layer_mm operands
        print(f"{name} mm GEMM1 [{rows}x{H}]x[{H}x{2 * I}]:", kernels(lambda: torch.mm(d.x, d.w1t)))
        print(f"{name} mm GEMM2 [{rows}x{I}]x[{I}x{H}]:", kernels(lambda: torch.mm(d.h, d.w2t)))
        idx = torch.randint(0, spec.local_experts, (spec.tokens, spec.topk), device=dev, dtype=torch.int32)
        g = B.prepare_gemm_only(x, idx, w1, w2, spec)
        print(f"{name} grouped_mm:", kernels(lambda: B.torch_gemm_only(g)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

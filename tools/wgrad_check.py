"""Render templates/sm90/wgrad.py.j2 with given parameters, compile it for sm_90a (no GPU needed) and report.

    python tools/wgrad_check.py --preset kimi-dw1 [--preset gpt-oss-dw2-acc ...]
    python tools/wgrad_check.py --m-out 4096 --n-out 7168 --groups 7 --bn 256 [--accumulate] [--stages N]
    python tools/wgrad_check.py --preset all --out-dir /tmp/wgrad      (keeps each rendered .py and .ptx)
    python tools/wgrad_check.py --preset all --run [--rows-per-group 1024] --timeout 300     (on a GPU machine)

Each parameter set is rendered, then compiled in its own child process (the CuTe DSL keeps global state, and
must see CUTE_DSL_KEEP / CUTE_DSL_DUMP_DIR before it is imported). Per set it prints the compile time, the
shared memory the stages take, PTX instruction counts (wgmma.mma_async, cp.async.bulk.tensor, mbarrier,
stmatrix, setmaxnreg, global loads/stores) and, with ptxas on PATH, the registers and spills ptxas reports.
``--stages`` defaults to as many as fit in the sm_90a shared memory per CTA beside the epilogue buffers.
``--run`` (needs torch and a Hopper GPU) also runs each kernel on random data against a float32 torch
reference (empty groups, a NaN tail no group owns, bitwise determinism across num_ctas) and times it.
Exit status 0 only when every set compiled, its PTX has wgmma, TMA and mbarrier instructions (and with --run,
every check passed).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATE_DIR = REPO / "templates"
TEMPLATE = "sm90/wgrad.py.j2"

sys.path.insert(0, str(REPO))
from mokgen.plan import BARRIER_BYTES as SMEM_BARRIERS, get_arch  # noqa: E402  (the plan's own numbers)

SMEM_PER_CTA = get_arch("sm_90a").smem_per_cta  # shared memory per CTA on sm_90a

# name -> (m_out, n_out, groups, bn, accumulate)
PRESETS = {
    "kimi-dw1": dict(m_out=4096, n_out=7168, groups=7, bn=256),
    "kimi-dw2": dict(m_out=7168, n_out=2048, groups=7, bn=256),
    "gpt-oss-dw1": dict(m_out=5760, n_out=2880, groups=128, bn=192),
    "gpt-oss-dw2-acc": dict(m_out=2880, n_out=2880, groups=128, bn=192, accumulate=True),
    "qwen3-30b-dw1": dict(m_out=1536, n_out=2048, groups=128, bn=256),
}

DEFAULTS = dict(group_m=128, bm=128, bk=64, epi_n=32, epi_stages=2, raster=8, accumulate=False,
                producer_regs=40, consumer_regs=232)

PTX_COUNTS = {
    "wgmma": r"wgmma\.mma_async",
    "tma_load": r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global|cp\.async\.bulk\.tensor\.\dd\.shared::cta\.global",
    "tma_store": r"cp\.async\.bulk\.tensor\.\dd\.global\.shared",
    "mbarrier": r"mbarrier\.",
    "stmatrix": r"stmatrix",
    "setmaxnreg": r"setmaxnreg",
    "ld_global": r"ld\.global",
    "st_global": r"st\.global",
    "ld_local": r"ld\.local",
}
REQUIRED = ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier")


def stage_bytes(p: dict) -> int:
    return (p["bm"] * p["bk"] + p["bn"] * p["bk"]) * 2


def epi_bytes(p: dict) -> int:
    return 0 if p["accumulate"] else p["bm"] * p["epi_n"] * 2 * p["epi_stages"]  # fp32 path: no smem epilogue


def max_stages(p: dict) -> int:
    return (SMEM_PER_CTA - SMEM_BARRIERS - epi_bytes(p)) // stage_bytes(p)


def full_params(**overrides) -> dict:
    p = dict(DEFAULTS)
    p.update({k: v for k, v in overrides.items() if v is not None})
    if not p.get("stages"):
        p["stages"] = max_stages(p)
    smem = p["stages"] * stage_bytes(p) + epi_bytes(p) + SMEM_BARRIERS
    if smem > SMEM_PER_CTA:
        raise SystemExit(f"{p['stages']} stages need {smem} bytes of shared memory, limit {SMEM_PER_CTA}")
    p["smem"] = smem
    return p


def render(p: dict, name: str = "wgrad") -> str:
    from mokgen import kernels
    from mokgen.emit import _environment  # the emit stage's jinja2 setup (filters the block library uses)

    env = _environment()
    ctx = {"epi_ring": False, "epi_w": 0, "fp8": False, "promote": "serial", "mma_split": 1, "ctas_per_sm": 1, "pdl": False,
           "pdl_tail": False, **{k: v for k, v in p.items() if k != "smem"}}
    table = "wgrad1_acc" if ctx["accumulate"] else "wgrad1"
    title = (f"wgrad {name}: out[{ctx['groups']}, {ctx['m_out']}, {ctx['n_out']}] "
             f"{'+=' if ctx['accumulate'] else '='} A^T B per group")
    return env.get_template(TEMPLATE).render(
        header=f"# Rendered by tools/wgrad_check.py from templates/{TEMPLATE}: {json.dumps(ctx, sort_keys=True)}",
        name=name, title=title, args=kernels.ARGS[table], symbols=kernels.SYMBOLS[table], **ctx)


def ptx_stats(ptx: str) -> dict:
    stats = {k: len(re.findall(v, ptx)) for k, v in PTX_COUNTS.items()}
    stats["required"] = {r: (r in ptx) for r in REQUIRED}
    stats["target_sm_90a"] = re.search(r"^\.target\s+sm_90a\b", ptx, re.M) is not None
    return stats


def ptxas_stats(ptx_path: Path) -> dict | None:
    """Registers / spills / stack as ``ptxas -v`` reports them, and its wgmma advisories (mokgen.build.run_ptxas:
    an older ptxas gets the ``.version`` line lowered, noted as ``version_patched``)."""
    from mokgen import build

    t0 = time.monotonic()
    res = build.run_ptxas(ptx_path.read_text(errors="replace"), "sm_90a")
    if res is None:
        return None
    rc, log, patched = res
    out: dict = {"ok": rc == 0, "seconds": round(time.monotonic() - t0, 1)}
    if patched:
        out["version_patched"] = patched
    m = re.search(r"Used (\d+) registers", log)
    if m:
        out["registers"] = int(m.group(1))
    m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if m:
        out["spill_stores"], out["spill_loads"] = int(m.group(1)), int(m.group(2))
    m = re.search(r"(\d+) bytes stack frame", log)
    if m:
        out["stack"] = int(m.group(1))
    out["advisories"] = sorted(set(re.findall(r"\((C75\d\d)\)", log)))
    if rc != 0:
        out["log"] = log[-2000:]
    return out


def cubin_info(cubin: Path) -> dict:
    """Registers and local-memory frame per kernel from the DSL's own cubin (the EIATTR_REGCOUNT 0x2f,
    EIATTR_FRAME_SIZE 0x11 and EIATTR_MIN_STACK_SIZE 0x12 records of its .nv.info section): a frame above 0
    means local memory, i.e. spills or an indexed register array."""
    import struct

    data = cubin.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return {}
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    secs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    stroff = secs[shstrndx][4]

    def name(off: int) -> str:
        return data[stroff + off:data.index(b"\0", stroff + off)].decode(errors="replace")

    keys = {0x2F: "registers", 0x11: "frame", 0x12: "min_stack"}
    out: dict = {}
    for sec in secs:
        if name(sec[0]) != ".nv.info":
            continue
        p, end = sec[4], sec[4] + sec[5]
        while p + 4 <= end:
            fmt, attr = data[p], data[p + 1]
            if fmt == 4:  # EIFMT_SVAL: u16 size, payload
                size, = struct.unpack_from("<H", data, p + 2)
                if attr in keys and size == 8:
                    _, val = struct.unpack_from("<II", data, p + 4)
                    out[keys[attr]] = max(out.get(keys[attr], 0), val)
                p += 4 + size
            else:
                p += 4
    return out


# ---------------------------------------------------------------------------------------------------- child


def compile_child(src: str, ptx_out: str, arch: str, run: dict | None = None) -> int:
    """Compile one rendered file (in this fresh process) and write its PTX; with ``run`` (a GPU is needed) also
    check and time it (:func:`gpu_check`). Prints one JSON line."""
    dump = tempfile.mkdtemp(prefix="wgrad.dump.")
    os.environ["CUTE_DSL_ARCH"] = arch
    os.environ["CUTE_DSL_KEEP"] = "ptx,cubin"
    os.environ["CUTE_DSL_DUMP_DIR"] = dump
    import importlib.util
    import warnings

    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    t0 = time.monotonic()
    try:
        spec = importlib.util.spec_from_file_location("wgrad_kernel", src)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        t_import = time.monotonic() - t0
        compiled = mod.compile(arch)
        t_compile = time.monotonic() - t0 - t_import
        found = sorted(Path(dump).rglob("*.ptx"))
        ptx = "".join(f.read_text(errors="replace") for f in found)
        if not ptx:
            cand = getattr(compiled, "__ptx__", None)
            ptx = cand if isinstance(cand, str) else ""
        Path(ptx_out).write_text(ptx)
        for kind in ("cubin",):  # kept beside the PTX when the DSL produced them
            found = sorted(Path(dump).rglob(f"*.{kind}"))
            if found:
                shutil.copyfile(found[0], Path(ptx_out).with_suffix(f".{kind}"))
        res: dict = {"ok": True, "import_s": round(t_import, 1), "compile_s": round(t_compile, 1)}
        if run is not None:
            res["gpu"] = gpu_check(mod, compiled, **run)
            res["ok"] = res["gpu"]["ok"]
        print(json.dumps(res), flush=True)
        return 0
    finally:
        shutil.rmtree(dump, ignore_errors=True)


def gpu_check(mod, compiled, rows_per_group: int = 1024, seed: int = 0, reps: int = 10) -> dict:
    """Run a compiled wgrad kernel on the GPU against a float32 torch reference.

    Group sizes are random multiples of GROUP_M averaging ``rows_per_group`` with some groups empty (the first
    and the last among them); GROUP_M rows of NaN follow the last group (the kernel must not read them). Checks:
    relative error (Frobenius) against the float32 reference, empty groups (zeros; accumulate: untouched bits),
    NaN, bitwise equality across num_ctas = SMs / 37 / 1 ... and a re-run; then times it (CUDA events, median)."""
    import contextlib

    import torch

    try:  # launch on torch's current stream (the kernel takes its stream from the tvm-ffi environment)
        import tvm_ffi

        stream_ctx = tvm_ffi.use_torch_stream
    except (ImportError, AttributeError):
        stream_ctx = contextlib.nullcontext
    raw_kernel = compiled

    def compiled(*args):
        with stream_ctx():
            raw_kernel(*args)

    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    M, N, G, GM, acc_mode = mod.M_OUT, mod.N_OUT, mod.GROUPS, mod.GROUP_M, mod.ACCUMULATE
    gen = torch.Generator().manual_seed(seed)
    mean_tiles = max(1, rows_per_group // GM)
    counts = torch.randint(0, 2 * mean_tiles + 1, (G,), generator=gen) * GM
    empty = [0, G - 1] if G > 2 else [0]
    for g in empty:
        counts[g] = 0
    gs = torch.zeros(G + 1, dtype=torch.int64)
    gs[1:] = torch.cumsum(counts, 0)
    used = int(gs[-1])
    rows = used + GM  # a tail that no group owns
    a = torch.randn(rows, M, generator=gen).to(torch.bfloat16).to(dev)
    b = torch.randn(rows, N, generator=gen).to(torch.bfloat16).to(dev)
    a[used:] = float("nan")
    b[used:] = float("nan")
    group_start = gs.to(torch.int32).to(dev)
    ref = torch.zeros(G, M, N, dtype=torch.float32, device=dev)
    for g in range(G):
        s, e = int(gs[g]), int(gs[g + 1])
        if e > s:
            ref[g] = a[s:e].float().T @ b[s:e].float()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    out0 = (torch.randn(G, M, N, generator=gen).to(dev) if acc_mode
            else torch.full((G, M, N), float("nan"), dtype=torch.bfloat16, device=dev))

    def launch(num_ctas: int) -> torch.Tensor:
        out = out0.clone()
        compiled(a, b, group_start, out, num_ctas)
        torch.cuda.synchronize()
        return out

    res: dict = {"rows": rows, "used_rows": used, "group_rows": counts.tolist()[:16], "empty_groups": empty}
    out = launch(sms)
    expect = out0 + ref if acc_mode else ref
    diff = (out.float() - expect).norm() / expect.norm().clamp_min(1e-30)
    res["rel_err"] = float(diff)
    res["max_abs_err"] = float((out.float() - expect).abs().max())
    res["nan"] = bool(torch.isnan(out).any())
    if acc_mode:
        res["empty_untouched"] = all(bool(torch.equal(out[g], out0[g])) for g in empty)
    else:
        res["empty_zero"] = all(bool((out[g] == 0).all()) for g in empty)
    same = True
    bits = torch.int32 if acc_mode else torch.int16
    for n in (sms, 37, 1 if M * N * G <= 64 * 1024 * 1024 else 5):
        same &= bool(torch.equal(launch(n).view(bits), out.view(bits)))
    res["bitwise_same"] = same
    tol = 1e-5 if acc_mode else 8e-3
    res["ok"] = (res["rel_err"] < tol and not res["nan"] and same
                 and res.get("empty_zero", True) and res.get("empty_untouched", True))
    # timing (out is re-used: the accumulate numbers include the read-add-write of out)
    out = out0.clone()
    start = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for _ in range(3):
        compiled(a, b, group_start, out, sms)
    for i in range(reps):
        start[i].record()
        compiled(a, b, group_start, out, sms)
        end[i].record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in zip(start, end))[reps // 2]
    res["ms"] = round(ms, 4)
    res["tflops"] = round(2.0 * used * M * N / (ms * 1e-3) / 1e12, 1)
    # torch reference point: one bf16 matmul per group (as a grouped wgrad would call them)
    def torch_wgrad():
        for g in range(G):
            s, e = int(gs[g]), int(gs[g + 1])
            if e > s:
                torch.mm(a[s:e].T, b[s:e])
    torch_wgrad()
    torch.cuda.synchronize()
    t0 = torch.cuda.Event(enable_timing=True)
    t1 = torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(3):
        torch_wgrad()
    t1.record()
    torch.cuda.synchronize()
    res["torch_loop_ms"] = round(t0.elapsed_time(t1) / 3, 4)
    return res


# ---------------------------------------------------------------------------------------------------- parent


def check_one(label: str, p: dict, out_dir: Path, arch: str = "sm_90a", ptxas: bool = True,
              run: dict | None = None, timeout: float | None = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / f"wgrad_{label}.py"
    src.write_text(render(p, name="wgrad"))
    ptx_path = out_dir / f"wgrad_{label}.ptx"
    t0 = time.monotonic()
    cmd = [sys.executable, __file__, "--child", str(src), str(ptx_path), "--arch", arch]
    if run is not None:
        cmd += ["--child-run", json.dumps(run)]
    res: dict = {"label": label, "params": p, "source": str(src)}
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=str(REPO), timeout=timeout)
    except subprocess.TimeoutExpired as e:
        res.update(ok=False, wall_s=round(time.monotonic() - t0, 1),
                   error=f"timed out after {timeout} s (a hang?)\n" + str(e.stdout or "")[-3000:])
        return res
    res["wall_s"] = round(time.monotonic() - t0, 1)
    line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("{")), None)
    if r.returncode != 0 or line is None:
        res["ok"] = False
        res["error"] = (r.stdout + r.stderr)[-6000:]
        return res
    res.update(json.loads(line))
    ptx = ptx_path.read_text(errors="replace")
    res["ptx"] = str(ptx_path)
    res["ptx_stats"] = ptx_stats(ptx)
    res["ok"] = res["ok"] and all(res["ptx_stats"]["required"].values()) and res["ptx_stats"]["target_sm_90a"]
    cubin = ptx_path.with_suffix(".cubin")
    if cubin.is_file():
        res["cubin"] = cubin_info(cubin)
    if ptxas and ptx:
        res["ptxas"] = ptxas_stats(ptx_path)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=2, metavar=("SRC", "PTX_OUT"), help=argparse.SUPPRESS)
    ap.add_argument("--child-run", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run", action="store_true",
                    help="(GPU) also run each kernel: check against torch, empty groups, determinism; time it")
    ap.add_argument("--rows-per-group", type=int, default=1024, help="--run: mean rows per group")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per parameter set (a hung kernel)")
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--preset", action="append", choices=[*PRESETS, "all"], help="named parameter set (repeatable)")
    ap.add_argument("--m-out", type=int)
    ap.add_argument("--n-out", type=int)
    ap.add_argument("--groups", type=int)
    ap.add_argument("--bn", type=int)
    ap.add_argument("--group-m", type=int)
    ap.add_argument("--stages", type=int, help="default: as many as fit")
    ap.add_argument("--raster", type=int)
    ap.add_argument("--epi-n", type=int)
    ap.add_argument("--epi-stages", type=int)
    ap.add_argument("--accumulate", action="store_true")
    ap.add_argument("--render-only", action="store_true", help="write the rendered sources, compile nothing")
    ap.add_argument("--no-ptxas", action="store_true", help="skip the ptxas register/spill report")
    ap.add_argument("--out-dir", default=None, help="where rendered sources and PTX go (default: a temp dir)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.child:
        return compile_child(args.child[0], args.child[1], args.arch,
                             json.loads(args.child_run) if args.child_run else None)

    sets: list[tuple[str, dict]] = []
    names = list(PRESETS) if args.preset and "all" in args.preset else (args.preset or [])
    common = dict(group_m=args.group_m, stages=args.stages, raster=args.raster, epi_n=args.epi_n,
                  epi_stages=args.epi_stages)
    for nm in names:
        sets.append((nm, full_params(**{**PRESETS[nm], **common})))
    if args.m_out or args.n_out:
        if not (args.m_out and args.n_out and args.groups and args.bn):
            ap.error("--m-out, --n-out, --groups and --bn go together")
        label = f"m{args.m_out}_n{args.n_out}_g{args.groups}_bn{args.bn}" + ("_acc" if args.accumulate else "")
        sets.append((label, full_params(m_out=args.m_out, n_out=args.n_out, groups=args.groups, bn=args.bn,
                                        accumulate=args.accumulate, **common)))
    if not sets:
        ap.error("give --preset or --m-out/--n-out/--groups/--bn")
    out_dir = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="wgrad_check."))
    results = []
    ok = True
    for label, p in sets:
        if args.render_only:
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / f"wgrad_{label}.py").write_text(render(p))
            print(f"{label}: rendered {out_dir / f'wgrad_{label}.py'} (stages {p['stages']}, smem {p['smem']} B)")
            continue
        print(f"{label}: compiling (stages {p['stages']}, smem {p['smem']} B) ...", flush=True)
        run = {"rows_per_group": args.rows_per_group} if args.run else None
        res = check_one(label, p, out_dir, args.arch, ptxas=not args.no_ptxas, run=run, timeout=args.timeout)
        results.append(res)
        ok &= res["ok"]
        if "error" in res:
            print(f"{label}: FAILED after {res['wall_s']} s\n{res['error']}")
            continue
        s = res["ptx_stats"]
        print(f"{label}: {'ok' if res['ok'] else 'MISSING INSTRUCTIONS'}  compile {res['compile_s']} s "
              f"(wall {res['wall_s']} s)  " + " ".join(f"{k}={v}" for k, v in s.items() if k != "required")
              + f"  required={s['required']}")
        if res.get("gpu"):
            print(f"{label}: GPU {'ok' if res['gpu']['ok'] else 'FAILED'} {json.dumps(res['gpu'])}")
        if res.get("cubin"):
            print(f"{label}: cubin {res['cubin']}")
        if res.get("ptxas"):
            print(f"{label}: ptxas {res['ptxas']}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

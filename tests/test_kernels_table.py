"""The argument table (mokgen/kernels.py) is the one source of every kernel's arguments: the emitted launch
signatures and compile() fake tensors, the runtime's launches and the reference's step functions agree with it."""
from __future__ import annotations

import ast

import pytest


from mokgen import kernels, reference
from mokgen.emit import emit
from mokgen.plan import solve
from mokgen.spec import load_spec


def _launch_params(src: str) -> list[str]:
    tree = ast.parse(src)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "launch")
    return [a.arg for a in fn.args.args]


def _compile_args(src: str) -> int:
    tree = ast.parse(src)
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "compile")
    tup = next(n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) and n.targets[0].id == "args")
    return len(tup.elts)


@pytest.mark.parametrize("preset,overrides", [("kimi-k2", {}), ("gpt-oss-120b", {}), ("qwen3-30b-a3b", {"gemm1_a_load": "tma"}),
                                              ("kimi-k2", {"schedule": "fused"})])
def test_emitted_signatures_follow_the_table(preset, overrides):
    plan = solve(load_spec(preset), "sm_90a", **overrides)
    src = emit(plan)
    fused = plan.schedule == "fused"
    for fname, text in src.files.items():
        kernel = fname[:-3]
        key = kernels.table_key(kernel, fused)
        assert _launch_params(text) == list(kernels.names(key)) + ["stream"], kernel
        assert _compile_args(text) == len(kernels.ARGS[key]) + 1, kernel  # + the stream
        for a in kernels.ARGS[key]:
            if a.dtype != "scalar":
                assert a.fake in text, (kernel, a.name)


def test_reference_steps_follow_the_table():
    fns = reference.reference_kernels(load_spec("kimi-k2"), 128, training=True)
    for name, fn in fns.items():
        with pytest.raises(TypeError, match=name):
            fn(*range(len(kernels.names(name)) + 1))  # one argument too many: named in the error


def test_call_checks_names():
    seen = []
    fns = {"combine": lambda *a: seen.append(a)}
    kernels.call(fns, "combine", ys=1, slot_pos=2, y=3)
    assert seen == [(1, 2, 3)]
    with pytest.raises(TypeError, match="missing"):
        kernels.call(fns, "combine", ys=1, slot_pos=2)
    with pytest.raises(TypeError, match="unknown"):
        kernels.call(fns, "combine", ys=1, slot_pos=2, y=3, z=4)


def test_table_rows_are_well_formed():
    for kernel, rows in kernels.ARGS.items():
        names = [a.name for a in rows]
        assert len(set(names)) == len(names), kernel
        syms = kernels.SYMBOLS[kernel]
        for a in rows:
            assert a.dtype in ("bf16", "fp32", "int32", "u8", "i64", "scalar"), (kernel, a)
            for dim in a.shape:
                # lower-case names in a shape are symbolic sizes the kernel's compile() declares
                for tok in dim.replace("*", " ").replace("+", " ").replace("/", " ").split():
                    if tok.isidentifier() and tok.islower():
                        assert tok in syms, (kernel, a.name, tok)


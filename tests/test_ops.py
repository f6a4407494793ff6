"""mokgen.ops on a CPU: workspace sizing, input validation, the launch sequence (with the reference kernels of
mokgen.reference standing in for libmokgen.so), routing errors, the custom op, autograd and the nn.Module."""

import importlib.util
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if importlib.util.find_spec("mokgen") is None:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mokgen import ops  # noqa: E402
from mokgen.module import MoE  # noqa: E402
from mokgen import plan as plan_mod  # noqa: E402
from mokgen import spec as spec_mod  # noqa: E402
from mokgen import reference as ref  # noqa: E402
from mokgen.ops import CompiledMoE, MoEInputError, RoutingError, Workspace, cap_rows  # noqa: E402
from mokgen.reference import LayerConfig, rel_err  # noqa: E402

BM = 16


def small(activation="swiglu", limit=None, layout="concat", bias=False, shared=1, H=32, I=16, E=6, K=3, T=37,
          ep=1):
    return LayerConfig(hidden=H, ffn=I, experts=E * ep, ep=ep, topk=K, tokens=T, shared_experts=shared,
                       activation=activation, swiglu_limit=limit, gate_up_layout=layout, bias=bias)


class Recorder:
    """Wraps kernel callables and records (name, args) of every launch."""

    def __init__(self, fns):
        self.calls = []
        self.fns = {n: self._wrap(n, f) for n, f in fns.items()}

    def _wrap(self, name, f):
        def call(*args):
            self.calls.append((name, args))
            return f(*args)

        return call

    @property
    def names(self):
        return [n for n, _ in self.calls]


def emulated(cfg, plan=BM, gather=False, **kw):
    rec = Recorder(ref.reference_kernels(cfg, BM, gather=gather, training=True))
    return CompiledMoE(cfg, plan, functions=rec.fns, allow_cpu=True, **kw), rec


def inputs(cfg, T=None, seed=0, routing="random"):
    return ref.random_inputs(cfg, tokens=T, seed=seed, routing=routing)


# ---- workspace -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [0, 1, 7, 128, 1000, 2048, 4096])
@pytest.mark.parametrize("K,S,G,bm", [(8, 1, 7, 128), (4, 0, 128, 128), (10, 1, 9, 64), (3, 2, 8, 16)])
def test_cap_rows_formula(T, K, S, G, bm):
    raw = T * K + S * T + G * (bm - 1)
    want = -(-raw // bm) * bm
    assert cap_rows(T, K, S, G, bm) == want
    assert want % bm == 0 and want >= raw


def test_cap_rows_is_a_worst_case_bound():
    """No routing can need more padded rows than cap_rows (each group wastes at most bm-1)."""
    cfg = small(E=5, K=3, shared=2)
    for routing in ref.ROUTING_MODES:
        for T in (1, 5, 33):
            _, idx, *_ = inputs(cfg, T=T, routing=routing)
            counts = torch.bincount(idx.reshape(-1).long(), minlength=5).tolist() + [T] * 2
            used = sum(-(-c // BM) * BM for c in counts)
            assert used <= cap_rows(T, 3, 2, 7, BM)


@pytest.mark.parametrize("T", [1, 100, 1000, 4096])
def test_workspace_layout_matches_contract(T):
    cfg = small(shared=2, E=6, K=3)
    lay = Workspace.layout(cfg, BM, T)
    cap = cap_rows(T, 3, 2, 8, BM)
    assert lay == {
        "row_src": ((cap,), torch.int32),
        "row_w": ((cap,), torch.float32),
        "tile_group": ((cap // BM,), torch.int32),
        "meta": ((4,), torch.int32),
        "slot_pos": ((T, 5), torch.int32),
        "h": ((cap, 16), torch.bfloat16),
        "ys": ((cap, 32), torch.bfloat16),
    }
    ws = Workspace.allocate(cfg, BM, T, "cpu")
    assert (ws.tokens, ws.bm, ws.cap_rows, ws.max_m_tiles) == (T, BM, cap, cap // BM)
    for name, (shape, dtype) in lay.items():
        t = getattr(ws, name)
        assert tuple(t.shape) == shape and t.dtype == dtype and t.is_contiguous(), name
    assert bool((ws.meta == 0).all())          # the error flag meta[1] starts clear; the rest is the kernels'
    assert ws.xg is None and ws.sync is None
    assert ws.nbytes == sum(getattr(ws, n).numel() * getattr(ws, n).element_size() for n in lay)


def test_workspace_with_gather_kernel_plan():
    cfg = small()
    plan = SimpleNamespace(bm=BM, gemm1=SimpleNamespace(a_load="tma"))
    assert ops.kernels_of(plan) == ("routing", "gather", "gemm1", "gemm2", "combine")
    assert ops.kernels_of(BM) == ops.KERNELS
    lay = Workspace.layout(cfg, plan, 10)
    assert lay["xg"] == ((cap_rows(10, 3, 1, 7, BM), 32), torch.bfloat16)
    assert Workspace.allocate(cfg, plan, 10, "cpu").xg.shape == lay["xg"][0]


def test_workspace_matches_plan_for_presets():
    for spec in spec_mod.list_presets():
        plan = plan_mod.solve(spec, "sm_90a")
        for T in (1, 1000, spec.tokens):
            lay = Workspace.layout(spec, plan, T)
            assert lay["row_src"][0] == (plan_mod.cap_rows(spec, plan.bm, T),)
            assert lay["slot_pos"][0] == (T, spec.topk + spec.shared_experts)
            assert lay["h"][0][1] == spec.ffn and lay["ys"][0][1] == spec.hidden
        lay = Workspace.layout(spec, plan, spec.tokens)
        assert lay["row_src"][0] == (plan.cap_rows,) and lay["tile_group"][0] == (plan.max_m_tiles,)


def routing_buffers(rec, i=0):
    """The workspace buffers the i-th routing launch got (row_src, row_w, tile_group, meta, slot_pos[, sync])."""
    return [args for name, args in rec.calls if name == "routing"][i][2:]


def test_workspace_is_per_call():
    """Every call gets its own buffers (none is cached on the CompiledMoE: two layers of one spec on two streams
    never share one), with meta zeroed even after a call that flagged an error; nothing else is kept per T."""
    cfg = small()
    moe, rec = emulated(cfg)
    a = good_args(cfg, T=10)
    bad = a["topk_idx"].clone()
    bad[0, 0] = 99
    call(moe, dict(a, topk_idx=bad))
    call(moe, a)
    first, second = routing_buffers(rec, 0), routing_buffers(rec, 1)
    for t1, t2 in zip(first, second):
        assert t1 is not t2 and t1.data_ptr() != t2.data_ptr()   # the recorder keeps the first call's alive
    assert int(first[3][1]) == 1 and int(second[3][1]) == 0       # meta: the flag of the bad call only
    assert not hasattr(moe, "workspace") and not hasattr(moe, "_workspaces")
    with pytest.raises(RoutingError):
        moe.check_errors()


# ---- validation ----------------------------------------------------------------------------------------------


def good_args(cfg, T=9, device="cpu"):
    x, idx, w, w1, w2, b1, b2 = inputs(cfg, T=T)
    args = dict(x=x, topk_idx=idx, topk_weight=w, w1=w1, w2=w2, b1=b1, b2=b2)
    return {k: (v.to(device) if v is not None else None) for k, v in args.items()}


def call(moe, a, **kw):
    return moe(a["x"], a["topk_idx"], a["topk_weight"], a["w1"], a["w2"], a["b1"], a["b2"], **kw)


BAD = [
    ("x", lambda a: a["x"][:, :16].contiguous(), r"x must be \[9, 32\] bfloat16"),
    ("x", lambda a: a["x"].float(), r"x must be \[9, 32\] bfloat16 .*got \[9, 32\] float32"),
    ("x", lambda a: a["x"][0], r"x must be \[T, H=32\] bfloat16, got \[32\]"),
    ("topk_idx", lambda a: a["topk_idx"][:, :2].contiguous(), r"topk_idx must be \[9, 3\] int32 or int64"),
    ("topk_idx", lambda a: a["topk_idx"][:5].contiguous(), r"topk_idx must be \[9, 3\]"),
    ("topk_idx", lambda a: a["topk_idx"].float(), r"topk_idx must be .*got \[9, 3\] float32"),
    ("topk_weight", lambda a: a["topk_weight"].bfloat16(), r"topk_weight must be \[9, 3\] float32"),
    ("w1", lambda a: a["w1"][:6].contiguous(), r"w1 must be \[7, 32, 32\] bfloat16 \(\[G, 2I, H\]"),
    ("w1", lambda a: a["w1"].float(), r"w1 must be \[7, 32, 32\] bfloat16"),
    ("w2", lambda a: a["w2"].transpose(1, 2).contiguous(), r"w2 must be \[7, 32, 16\] bfloat16"),
    ("x", lambda a: a["x"].t().contiguous().t(), r"x must be contiguous"),
    ("w1", lambda a: a["w1"].transpose(1, 2).contiguous().transpose(1, 2), r"w1 must be contiguous"),
    ("b1", lambda a: torch.zeros(7, 32), r"bias=false: b1 must be None"),
]


@pytest.mark.parametrize("name,make,msg", BAD)
def test_validation_errors(name, make, msg):
    cfg = small()
    moe, rec = emulated(cfg)
    a = good_args(cfg)
    a[name] = make(a)
    with pytest.raises(MoEInputError, match=msg):
        call(moe, a)
    assert rec.calls == [], "nothing may be launched before validation passes"


def test_validation_bias():
    cfg = small(bias=True)
    moe, rec = emulated(cfg)
    a = good_args(cfg)
    with pytest.raises(MoEInputError, match="bias=true: b2 is required"):
        call(moe, dict(a, b2=None))
    with pytest.raises(MoEInputError, match=r"b1 must be \[7, 32\] float32"):
        call(moe, dict(a, b1=a["b1"].bfloat16()))
    with pytest.raises(MoEInputError, match=r"b2 must be \[7, 32\] float32"):
        call(moe, dict(a, b2=a["b2"][:, :8].contiguous()))
    with pytest.raises(MoEInputError, match="must be a torch.Tensor"):
        call(moe, dict(a, b1=[0.0]))
    assert rec.calls == []


def test_validation_out_and_num_ctas():
    cfg = small()
    moe, rec = emulated(cfg)
    a = good_args(cfg)
    with pytest.raises(MoEInputError, match=r"out must be \[9, 32\] bfloat16"):
        call(moe, a, out=torch.empty(9, 32))
    with pytest.raises(MoEInputError, match="out must be contiguous"):
        call(moe, a, out=torch.empty(32, 9, dtype=torch.bfloat16).t())
    for bad in (0, -1, 1.5, True):
        with pytest.raises(MoEInputError, match="num_ctas must be a positive int"):
            call(moe, a, num_ctas=bad)
    assert rec.calls == []


def test_validation_device():
    cfg = small()
    moe, rec = emulated(cfg)
    strict = CompiledMoE(cfg, BM, functions=rec.fns)          # allow_cpu=False: the production setting
    a = good_args(cfg)
    with pytest.raises(MoEInputError, match="inputs must be CUDA tensors, got cpu"):
        call(strict, a)
    mixed = dict(a, w2=a["w2"].to("meta"))
    with pytest.raises(MoEInputError, match="all inputs must be on one device: x is on cpu, w2 on meta"):
        call(moe, mixed)
    assert rec.calls == []


def test_validation_preset_shapes_on_meta_tensors():
    """Shape checks at real preset sizes, without allocating anything (meta tensors)."""
    spec = spec_mod.load_spec("kimi-k2")
    rec = Recorder(ref.reference_kernels(spec, 128))
    moe = CompiledMoE(spec, 128, functions=rec.fns, arch="sm_90a")
    m = dict(device="meta")
    T, H, I, G, K = 2048, spec.hidden, spec.ffn, spec.groups, spec.topk
    a = dict(x=torch.empty(T, H, dtype=torch.bfloat16, **m), topk_idx=torch.empty(T, K, dtype=torch.int32, **m),
             topk_weight=torch.empty(T, K, **m), w1=torch.empty(G, 2 * I, H, dtype=torch.bfloat16, **m),
             w2=torch.empty(G, H, I, dtype=torch.bfloat16, **m), b1=None, b2=None)
    with pytest.raises(MoEInputError, match="inputs must be CUDA tensors, got meta"):
        call(moe, a)                                       # every shape passed
    with pytest.raises(MoEInputError, match=r"mokgen kimi-k2: w1 must be \[7, 4096, 7168\] bfloat16"):
        call(moe, dict(a, w1=torch.empty(G + 1, 2 * I, H, dtype=torch.bfloat16, **m)))
    with pytest.raises(MoEInputError, match=r"topk_idx must be \[2048, 8\]"):
        call(moe, dict(a, topk_idx=torch.empty(T, 6, dtype=torch.int32, **m)))


def test_arch_mismatch(monkeypatch):
    cfg = small()
    monkeypatch.setattr(ops, "_device_arch", lambda device: "sm_90")
    moe, rec = emulated(cfg, arch="sm_100a")
    with pytest.raises(ops.ArchMismatchError, match=r"built for sm_100a but cpu is sm_90.*arch='sm_90a'"):
        call(moe, good_args(cfg))
    assert rec.calls == []
    ok, _ = emulated(cfg, arch="sm_90a")
    call(ok, good_args(cfg))                                # sm_90a runs on sm_90


def test_arch_read_from_entry_meta(tmp_path):
    (tmp_path / "meta.json").write_text('{"arch": "sm_100a", "key": "ab"}')
    moe = CompiledMoE(small(), BM, tmp_path, functions=ref.reference_kernels(small(), BM), allow_cpu=True)
    assert moe.arch == "sm_100a"


# ---- the launch sequence -------------------------------------------------------------------------------------


def test_call_order_and_arguments():
    cfg = small(shared=1)
    moe, rec = emulated(cfg)
    a = good_args(cfg, T=20)
    y = call(moe, a, num_ctas=66)
    assert rec.names == ["routing", "gemm1", "gemm2", "combine"]
    args = dict(rec.calls)
    row_src, row_w, tile_group, meta, slot_pos = routing_buffers(rec)
    h, ys, dummy = args["gemm1"][6], args["gemm2"][6], args["gemm1"][2]
    lay = Workspace.layout(cfg, BM, 20)
    for name, t in dict(row_src=row_src, row_w=row_w, tile_group=tile_group, meta=meta, slot_pos=slot_pos, h=h,
                        ys=ys).items():
        assert (tuple(t.shape), t.dtype) == lay[name], name
    want = {
        "routing": (a["topk_idx"], a["topk_weight"], row_src, row_w, tile_group, meta, slot_pos),
        "gemm1": (a["x"], a["w1"], dummy, row_src, tile_group, meta, h, 66),
        "gemm2": (h, a["w2"], dummy, row_w, tile_group, meta, ys, 66),
        "combine": (ys, slot_pos, y),
    }
    for name, expected in want.items():
        got = args[name]
        assert len(got) == len(expected), name
        for g, e in zip(got, expected):
            assert g is e if isinstance(e, torch.Tensor) else g == e, name
    assert dummy.shape == (1, 1) and dummy.dtype == torch.float32
    rec.calls.clear()
    call(moe, a)
    assert dict(rec.calls)["gemm1"][-1] == 1               # default num_ctas: the SM count (1 on a CPU)


def test_call_order_with_gather_kernel():
    cfg = small(bias=True)
    plan = SimpleNamespace(bm=BM, gemm1=SimpleNamespace(a_load="tma"))
    moe, rec = emulated(cfg, plan=plan, gather=True)
    a = good_args(cfg, T=20)
    y = call(moe, a)
    assert rec.names == ["routing", "gather", "gemm1", "gemm2", "combine"]
    args = dict(rec.calls)
    xg = args["gather"][3]
    assert (tuple(xg.shape), xg.dtype) == Workspace.layout(cfg, plan, 20)["xg"]
    assert args["gather"][0] is a["x"] and args["gather"][1] is routing_buffers(rec)[0]
    assert args["gemm1"][0] is xg and args["gemm1"][2] is a["b1"] and args["gemm2"][2] is a["b2"]
    y_ref = ref.forward(*[a[k] for k in ("x", "topk_idx", "topk_weight", "w1", "w2")], cfg, a["b1"], a["b2"])
    assert rel_err(y.float(), y_ref) < 1e-2


def test_call_order_fused_schedule():
    """schedule "fused": routing (which also gets the sync counters) and one fused kernel."""
    cfg = small(bias=True)
    plan = SimpleNamespace(bm=BM, schedule="fused", gemm1=SimpleNamespace(a_load="gather"))
    rec = Recorder(ref.reference_kernels(cfg, BM, fused=True))
    moe = CompiledMoE(cfg, plan, functions=rec.fns, allow_cpu=True)
    assert ops.kernels_of(plan) == ("routing", "fused")
    a = good_args(cfg, T=20)
    y = call(moe, a, num_ctas=66)
    assert rec.names == ["routing", "fused"]
    args = dict(rec.calls)
    row_src, row_w, tile_group, meta, slot_pos, sync = routing_buffers(rec)
    lay = Workspace.layout(cfg, plan, 20)
    assert (tuple(sync.shape), sync.dtype) == lay["sync"] == ((4 + lay["tile_group"][0][0],), torch.int32)
    h, ys = args["fused"][10], args["fused"][11]
    want = (a["x"], a["w1"], a["b1"], a["w2"], a["b2"], row_src, row_w, tile_group, meta, slot_pos,
            h, ys, y, sync, 66)
    got = args["fused"]
    assert len(got) == len(want)
    for g, e in zip(got, want):
        assert g is e if isinstance(e, torch.Tensor) else g == e
    y_ref = ref.forward(*[a[k] for k in ("x", "topk_idx", "topk_weight", "w1", "w2")], cfg, a["b1"], a["b2"])
    assert rel_err(y.float(), y_ref) < 1e-2


def test_fused_timeout_flag_raises():
    """sync[2] set by the fused kernel (a wait ran out) -> KernelTimeoutError from check=True / check_errors."""
    cfg = small()
    plan = SimpleNamespace(bm=BM, schedule="fused", gemm1=SimpleNamespace(a_load="gather"))
    fns = ref.reference_kernels(cfg, BM, fused=True)
    inner = fns["fused"]

    def timing_out(*args):
        inner(*args)
        args[13][2] = 1

    fns["fused"] = timing_out
    moe = CompiledMoE(cfg, plan, functions=fns, allow_cpu=True)
    a = good_args(cfg, T=9)
    with pytest.raises(ops.KernelTimeoutError, match="timed out"):
        call(moe, a, check=True)
    call(moe, a)
    with pytest.raises(ops.KernelTimeoutError, match="since the last check"):
        moe.check_errors()
    moe.check_errors()  # cleared


CFGS = [small(), small(bias=True, shared=0), small("swiglu", 0.5, "interleaved", shared=2),
        small("swiglu_oai", None, "interleaved", bias=True), small(E=2, K=4, ep=1, shared=1)]


@pytest.mark.parametrize("cfg", CFGS, ids=lambda c: f"{c.activation}-{c.limit}-{c.gate_up_layout}-b{int(c.bias)}"
                                                  f"-S{c.shared_experts}-E{c.local_experts}-K{c.topk}")
@pytest.mark.parametrize("routing", ref.ROUTING_MODES)
def test_emulated_forward_matches_reference(cfg, routing):
    moe, _ = emulated(cfg)
    for T in (1, 37, 100):
        x, idx, w, w1, w2, b1, b2 = inputs(cfg, T=T, seed=T, routing=routing)
        out = torch.full((T, cfg.hidden), float("nan"), dtype=torch.bfloat16)
        y = moe(x, idx, w, w1, w2, b1, b2, out=out)
        assert y is out and not bool(y.isnan().any())
        y_ref = ref.forward(x, idx, w, w1, w2, cfg, b1, b2)
        assert rel_err(y.float(), y_ref) < 1e-2
        y2 = moe(x, idx, w, w1, w2, b1, b2, num_ctas=132)
        assert torch.equal(y.view(torch.int16), y2.view(torch.int16))


def test_zero_tokens_launch_nothing():
    cfg = small()
    moe, rec = emulated(cfg)
    a = good_args(cfg, T=0)
    y = call(moe, a)
    assert y.shape == (0, 32) and y.dtype == torch.bfloat16 and rec.calls == []


def test_int64_topk_idx_is_converted_with_one_warning():
    cfg = small()
    moe, rec = emulated(cfg)
    a = good_args(cfg)
    y32 = call(moe, a)
    a64 = dict(a, topk_idx=a["topk_idx"].long())
    with pytest.warns(UserWarning, match="topk_idx is int64; converting to int32"):
        y64 = call(moe, a64)
    assert torch.equal(y32, y64)
    assert dict(rec.calls)["routing"][0].dtype == torch.int32
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call(moe, a64)                                      # warned once only


# ---- routing errors ------------------------------------------------------------------------------------------


def test_routing_error_with_check():
    cfg = small()
    moe, _ = emulated(cfg)
    a = good_args(cfg)
    bad = a["topk_idx"].clone()
    bad[2, 1] = 6
    bad[4, 0] = -3
    with pytest.raises(RoutingError, match=r"2 topk_idx value\(s\) outside \[0, 6\), e.g. topk_idx\[2, 1\] = 6"):
        call(moe, dict(a, topk_idx=bad), check=True)
    moe.check_errors()                                      # reported by check=True: nothing pending
    call(moe, a, check=True)                                # clean call passes


def test_routing_error_flag_is_sticky_until_checked():
    cfg = small()
    moe, _ = emulated(cfg)
    a = good_args(cfg)
    bad = a["topk_idx"].clone()
    bad[0, 0] = 99
    y_bad = call(moe, dict(a, topk_idx=bad))               # no sync, no raise
    w0 = a["topk_weight"].clone()
    w0[0, 0] = 0
    y_ref = ref.forward(a["x"], bad, a["topk_weight"], a["w1"], a["w2"], cfg)
    assert rel_err(y_bad.float(), y_ref) < 1e-2            # the bad slot was dropped
    call(moe, a)                                            # a clean call does not clear it
    call(moe, good_args(cfg, T=5))                          # nor one of another T
    with pytest.raises(RoutingError, match=r"since the last check.*outside \[0, 6\)"):
        moe.check_errors()
    moe.check_errors()                                      # cleared by the check
    # an unchecked error found by a later check=True call is kept for check_errors()
    call(moe, dict(a, topk_idx=bad))
    call(moe, a, check=True)                                # this call is clean: no raise
    with pytest.raises(RoutingError):
        moe.check_errors()
    moe.check_errors()


# ---- torch.library op, fake impl, autograd -------------------------------------------------------------------


def op_args(cfg, moe, T=9, requires_grad=False):
    x, idx, w, w1, w2, b1, b2 = inputs(cfg, T=T)
    leaves = [x, w, w1, w2, b1, b2]
    if requires_grad:
        for t in leaves:
            if t is not None:
                t.requires_grad_(True)
    return (x, idx, w, w1, w2, b1, b2, moe.registry_id)


def test_fake_impl_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = small(bias=True)
    moe, rec = emulated(cfg)
    args = op_args(cfg, moe, T=13)
    cap = ops.cap_rows(13, cfg.topk, cfg.shared_experts, cfg.groups, BM)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fargs = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        y = torch.ops.mokgen.moe_forward(*fargs)
        assert y.shape == (13, 32) and y.dtype == torch.bfloat16
        out = torch.ops.mokgen.moe_forward_train(*fargs[:7], None, None, fargs[7])
        # the saved tensors, then x's FP8 column form where plan bwd_x_cols="forward" makes it (empty here: BF16)
        assert [tuple(t.shape) for t in out] == [(13, 32), (cap, 32), (cap,), (cap,), (cap // BM,), (4,), (13, 4),
                                                 (0,), (0,)]
        dy = torch.empty(13, 32, dtype=torch.bfloat16)
        x, idx, w, w1, w2, b1, b2, mid = fargs
        g = torch.ops.mokgen.moe_backward(dy, x, w, w1, w2, b1, b2, *out[1:], None, None, mid)
        assert [tuple(t.shape) for t in g] == [(13, 32), (13, 3), (7, 32, 32), (7, 32, 16), (7, 32), (7, 32)]
        g = torch.ops.mokgen.moe_backward(dy, x, w, w1, w2, b1, b2, *out[1:], torch.empty(7, 32, 32),
                                          torch.empty(7, 32, 16), mid)
        assert [tuple(t.shape) for t in g][2:4] == [(0,), (0,)]   # added into main_grad instead
    assert rec.calls == []
    # meta tensors go through the fake impl too
    meta = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in args]
    assert torch.ops.mokgen.moe_forward(*meta).shape == (13, 32)


@pytest.mark.parametrize("bias", [False, True])
def test_opcheck(bias):
    cfg = small(bias=bias, T=12)
    moe, _ = emulated(cfg)
    args = op_args(cfg, moe, T=12)
    torch.library.opcheck(torch.ops.mokgen.moe_forward.default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    args = op_args(cfg, moe, T=12, requires_grad=True)
    # (no test_aot_dispatch_dynamic here: the training op's state outputs hold unwritten rows past the used
    # tiles, which that test compares; test_torch_compile_training covers the traced forward + backward)
    torch.library.opcheck(torch.ops.mokgen.moe_forward_train.default, (*args[:7], None, None, args[7]),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


def test_torch_compile_training():
    """torch.compile(fullgraph=True) of forward + backward through mokgen.MoE equals eager (aot_eager here; the
    GPU suite runs the inductor backend on the real kernels)."""
    spec = tiny_spec()
    moe, _ = emulated(spec)
    torch.manual_seed(0)
    layer = MoE(spec, compiled=moe)
    x, idx, w, *_ = ref.random_inputs(spec, tokens=16, seed=3)

    def step(x, idx, w):
        return layer(x, idx, w).float().square().sum()

    grads = []
    for fn in (step, torch.compile(step, backend="aot_eager", fullgraph=True)):
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        fn(xx, idx, w).backward()
        grads.append((xx.grad, layer.w1.grad, layer.w2.grad))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_inference_op_refuses_backward():
    cfg = small(T=8)
    moe, _ = emulated(cfg)
    x, idx, w, w1, w2, b1, b2, mid = op_args(cfg, moe, T=8, requires_grad=True)
    y = torch.ops.mokgen.moe_forward(x, idx, w, w1, w2, b1, b2, mid)
    with pytest.raises(RuntimeError, match="inference op"):
        y.float().sum().backward()


def test_main_grad_accumulates_and_backward_is_per_call():
    """main_grad: the wgrads add into fp32 buffers (w1/w2 get no .grad); two calls' saved state is their own
    (f1, f2, b2, b1 equals each call run alone)."""
    cfg = small(T=10)
    moe, _ = emulated(cfg)
    x, idx, w, w1, w2, b1, b2, mid = op_args(cfg, moe, T=10)
    x2, idx2, w_2, *_ = inputs(cfg, T=10, seed=5)
    dy = torch.randn(10, cfg.hidden, generator=torch.Generator().manual_seed(2)).bfloat16()
    alone = [moe.backward(dy, moe.forward_train(a, i, ww, w1, w2)[1], a, ww, w1, w2)
             for a, i, ww in ((x, idx, w), (x2, idx2, w_2))]
    s1, s2 = moe.forward_train(x, idx, w, w1, w2)[1], moe.forward_train(x2, idx2, w_2, w1, w2)[1]
    g2, g1 = moe.backward(dy, s2, x2, w_2, w1, w2), moe.backward(dy, s1, x, w, w1, w2)
    for got, want in ((g1, alone[0]), (g2, alone[1])):
        for n in ("x", "topk_weight", "w1", "w2"):
            assert torch.equal(getattr(got, n), getattr(want, n))
    mg1, mg2 = torch.full(w1.shape, 0.5), torch.full(w2.shape, -0.25)
    g = moe.backward(dy, s1, x, w, w1, w2, w1_main_grad=mg1, w2_main_grad=mg2)
    assert g.w1 is None and g.w2 is None and torch.equal(g.x, g1.x)
    assert rel_err(mg1 - 0.5, g1.w1.float()) < 1e-2 and rel_err(mg2 + 0.25, g1.w2.float()) < 1e-2
    with pytest.raises(ops.MoEInputError, match="w1_main_grad must be a contiguous float32"):
        moe.backward(dy, s1, x, w, w1, w2, w1_main_grad=torch.zeros(3))


@pytest.mark.parametrize("bias", [False, True])
def test_training_writes_into_caller_buffers(bias):
    """forward_train(out=) and backward(out=Grads(...)): every output lands in the caller's (NaN-poisoned)
    buffer, is fully written and has the bits of the call that allocates its own outputs."""
    cfg = small("swiglu_oai", None, "interleaved", bias=True, shared=0) if bias else small()
    moe, _ = emulated(cfg)
    x, idx, w, w1, w2, b1, b2 = inputs(cfg, T=21, seed=5)
    dy = torch.randn(21, cfg.hidden, generator=torch.Generator().manual_seed(2)).bfloat16()
    y_own, s_own = moe.forward_train(x, idx, w, w1, w2, b1, b2)
    g_own = moe.backward(dy, s_own, x, w, w1, w2, b1, b2)
    y_buf = torch.full_like(y_own, float("nan"))
    y, saved = moe.forward_train(x, idx, w, w1, w2, b1, b2, out=y_buf)
    assert y is y_buf and torch.equal(y, y_own)
    bufs = ref.Grads(*(None if t is None else torch.full_like(t, float("nan")) for t in (x, w, w1, w2, b1, b2)))
    g = moe.backward(dy, saved, x, w, w1, w2, b1, b2, out=bufs)
    for name, got, buf, own in zip(ref.Grads._fields, g, bufs, g_own):
        assert got is buf, name
        if got is not None:
            assert not bool(got.isnan().any()) and torch.equal(got, own), name
    # partial out: the rest is allocated
    g = moe.backward(dy, saved, x, w, w1, w2, b1, b2, out=ref.Grads(x=bufs.x, topk_weight=None, w1=None, w2=None,
                                                                   b1=None, b2=None))
    assert g.x is bufs.x and torch.equal(g.w1, g_own.w1)


def test_backward_out_errors():
    cfg = small()
    moe, _ = emulated(cfg)
    x, idx, w, w1, w2, b1, b2 = inputs(cfg, T=9)
    dy = torch.randn(9, cfg.hidden).bfloat16()
    _, saved = moe.forward_train(x, idx, w, w1, w2)
    none = dict(x=None, topk_weight=None, w1=None, w2=None, b1=None, b2=None)
    with pytest.raises(MoEInputError, match=r"out.w1 must be a contiguous tensor like w1 \(\[7, 32, 32\] bfloat16 on cpu\)"):
        moe.backward(dy, saved, x, w, w1, w2, out=ref.Grads(**dict(none, w1=torch.empty(7, 32, 31).bfloat16())))
    with pytest.raises(MoEInputError, match="out.x must be a contiguous tensor like x"):
        moe.backward(dy, saved, x, w, w1, w2, out=ref.Grads(**dict(none, x=torch.empty(9, 32))))   # fp32
    with pytest.raises(MoEInputError, match="out.b1 must be None: there is no b1"):
        moe.backward(dy, saved, x, w, w1, w2, out=ref.Grads(**dict(none, b1=torch.empty(7, 32))))
    with pytest.raises(MoEInputError, match="out.w2 must be None when w2_main_grad is given"):
        moe.backward(dy, saved, x, w, w1, w2, w2_main_grad=torch.zeros(w2.shape),
                     out=ref.Grads(**dict(none, w2=torch.empty_like(w2))))
    with pytest.raises(MoEInputError, match="out must be a mokgen.reference.Grads"):
        moe.backward(dy, saved, x, w, w1, w2, out=(None,) * 6)
    with pytest.raises(MoEInputError, match=r"out must be \[9, 32\] bfloat16"):
        moe.forward_train(x, idx, w, w1, w2, out=torch.empty(9, 32))


@pytest.mark.parametrize("cfg", [small(), small("swiglu_oai", None, "interleaved", bias=True, shared=0)],
                         ids=["swiglu", "oai-bias"])
def test_autograd_matches_reference_backward(cfg):
    moe, _ = emulated(cfg)
    x, idx, w, w1, w2, b1, b2, mid = op_args(cfg, moe, T=21, requires_grad=True)
    y = ops.moe_forward(x, idx, w, w1, w2, b1, b2, moe=moe)
    dy = torch.randn(21, cfg.hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    y.backward(dy)
    g = ref.backward(dy, x.detach(), idx, w.detach(), w1.detach(), w2.detach(), cfg,
                     None if b1 is None else b1.detach(), None if b2 is None else b2.detach())
    pairs = [(x, g.x), (w, g.topk_weight), (w1, g.w1), (w2, g.w2)] + ([(b1, g.b1), (b2, g.b2)] if cfg.bias else [])
    for leaf, want in pairs:
        assert leaf.grad is not None and leaf.grad.dtype == leaf.dtype and leaf.grad.shape == leaf.shape
        assert rel_err(leaf.grad, want) < 2e-2


def test_torch_compile_graph_with_op():
    cfg = small(T=16)
    moe, _ = emulated(cfg)
    x, idx, w, w1, w2, b1, b2, mid = op_args(cfg, moe, T=16)

    def f(x, idx, w, w1, w2):
        return torch.ops.mokgen.moe_forward(x, idx, w, w1, w2, None, None, mid) * 2

    if not torch._dynamo.is_dynamo_supported():   # the one documented case: no dynamo on this Python
        pytest.skip("torch.compile (dynamo) is not supported on this Python / torch build")
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    y = compiled(x, idx, w, w1, w2)
    assert torch.equal(y, f(x, idx, w, w1, w2))


def test_registry_lookup_error():
    cfg = small()
    moe, _ = emulated(cfg)
    args = op_args(cfg, moe)
    moe.close()
    with pytest.raises(RuntimeError, match="no CompiledMoE with registry id"):
        torch.ops.mokgen.moe_forward(*args)


# ---- nn.Module -----------------------------------------------------------------------------------------------


def tiny_spec(**kw):
    d = dict(name="tiny", hidden=64, ffn=64, experts=4, topk=2, shared_experts=1, ep=1, tokens=16,
             archs=["sm_90a"])
    d.update(kw)
    return spec_mod.load_spec(d)


@pytest.mark.parametrize("bias", [False, True])
def test_module(bias):
    kw = dict(activation="swiglu_oai", gate_up_layout="interleaved", bias=True, shared_experts=0) if bias else {}
    spec = tiny_spec(**kw)
    moe, rec = emulated(spec)
    torch.manual_seed(0)
    layer = MoE(spec, compiled=moe)
    G = spec.groups
    assert layer.w1.shape == (G, 128, 64) and layer.w2.shape == (G, 64, 64)
    assert layer.w1.dtype == layer.w2.dtype == torch.bfloat16
    assert (layer.b1 is not None) == bias
    names = {n for n, _ in layer.named_parameters()}
    assert names == ({"w1", "w2", "b1", "b2"} if bias else {"w1", "w2"})
    assert abs(float(layer.w1.detach().float().std()) * 8 - 1) < 0.1      # N(0, 1/H), H = 64
    x, idx, w, *_ = ref.random_inputs(spec, tokens=16, seed=3)
    x.requires_grad_(True)
    y = layer(x, idx, w)
    assert y.shape == (16, 64) and y.dtype == torch.bfloat16
    y_ref = ref.forward(x.detach(), idx, w, layer.w1.detach(), layer.w2.detach(), spec,
                        None if not bias else layer.b1.detach(), None if not bias else layer.b2.detach())
    assert rel_err(y.float(), y_ref) < 1e-2
    y.float().square().sum().backward()
    assert layer.w1.grad is not None and x.grad is not None and layer.w1.grad.shape == layer.w1.shape
    assert "tiny" in repr(layer)
    layer.check_errors()


def test_module_rejects_other_dtypes_and_meta_init():
    spec = tiny_spec()
    with pytest.raises(ValueError, match="only bfloat16"):
        MoE(spec, dtype=torch.float32, compiled=emulated(spec)[0])
    layer = MoE(spec, device="meta", compiled=emulated(spec)[0])
    assert layer.w1.device.type == "meta"


# ---- loading -------------------------------------------------------------------------------------------------


def test_load_library_errors(tmp_path, monkeypatch):
    with pytest.raises(ops.LoadError, match="not a built mokgen cache entry"):
        ops.load_library(tmp_path)
    monkeypatch.setenv("MOKGEN_RUNTIME_LIB", str(tmp_path / "nope.so"))
    with pytest.raises(ops.LoadError, match="MOKGEN_RUNTIME_LIB=.*is not a file"):
        ops.find_runtime_library(tmp_path)
    lib = tmp_path / "libcute_dsl_runtime.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("MOKGEN_RUNTIME_LIB", str(lib))
    assert ops.find_runtime_library(None) == str(lib)


def test_runtime_search_packed_copy(tmp_path, monkeypatch):
    monkeypatch.delenv("MOKGEN_RUNTIME_LIB", raising=False)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(ops.importlib.util, "find_spec",
                        lambda name, *a: None if name == "cutlass" else real_find_spec(name, *a))
    entry = tmp_path / "sm_90a" / "0123456789abcdef"
    entry.mkdir(parents=True)
    with pytest.raises(ops.LoadError, match="the CuTe DSL is not installed.*mokgen\\[compiler\\]"):
        ops.find_runtime_library(entry)
    (tmp_path / "runtime").mkdir()
    (tmp_path / "runtime" / "libcute_dsl_runtime.so").write_bytes(b"")
    assert ops.find_runtime_library(entry) == str(tmp_path / "runtime" / "libcute_dsl_runtime.so")


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="CuTe DSL not installed")
def test_runtime_search_finds_the_dsl_copy(monkeypatch):
    monkeypatch.delenv("MOKGEN_RUNTIME_LIB", raising=False)
    p = ops.find_runtime_library(None)
    assert Path(p).name == "libcute_dsl_runtime.so" and Path(p).is_file()


def test_compile_without_compiler_or_cache(mokgen_cache, monkeypatch):
    from mokgen import driver

    monkeypatch.setattr(driver, "_dsl_available", lambda: False)
    import mokgen

    with pytest.raises(RuntimeError, match=r"no cached kernels for 'qwen3-30b-a3b' on sm_90a.*mokgen\[compiler\]"):
        mokgen.compile("qwen3-30b-a3b", arch="sm_90a")


def test_import_mokgen_is_light():
    import subprocess

    code = ("import sys, mokgen; assert 'torch' not in sys.modules, 'torch'; assert 'cutlass' not in sys.modules;"
            "print(mokgen.__version__)")
    env = dict(__import__("os").environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


@pytest.mark.parametrize("main_grad", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_backward_two_streams_same_bits_and_order(bias, main_grad):
    """plan.backward.streams 2: the weight gradients (wgrad2, the x-row gather, wgrad1) are launched right after
    dgrad1 (on the side stream on a GPU), dgrad2 writes a buffer of its own, and every gradient has the bits of
    the one-stream order (the reference kernels here; the GPU suite repeats it on the real ones)."""
    cfg = small(activation="swiglu_oai", layout="interleaved", bias=bias, shared=1, T=29) if bias else small(T=29)
    got = {}
    for streams in (1, 2):
        moe, rec = emulated(cfg)
        moe._bwd_streams = streams   # what CompiledMoE reads from plan.backward.streams
        x, idx, w, w1, w2, b1, b2, _ = op_args(cfg, moe, T=29)
        dy = torch.randn(29, cfg.hidden, generator=torch.Generator().manual_seed(3)).bfloat16()
        saved = moe.forward_train(x, idx, w, w1, w2, b1, b2)[1]
        n0 = len(rec.calls)
        mg = (torch.full(w1.shape, 0.5), torch.full(w2.shape, -0.25)) if main_grad else (None, None)
        g = moe.backward(dy, saved, x, w, w1, w2, b1, b2, w1_main_grad=mg[0], w2_main_grad=mg[1])
        names = rec.names[n0:]
        got[streams] = (g, mg, names)
        # launch_sequence (what profilers are told) is the backward's host launch order
        kernel = {"gather_dO": ops.GATHER_KERNEL, "gather_x": ops.GATHER_KERNEL, "combine_dx": "combine"}
        seq = moe.launch_sequence()
        seq = [kernel.get(ph, ph) for ph in seq[seq.index("gather_dO"):]]
        assert [n.removesuffix("_acc") for n in names] == seq, (names, seq)
        # with two streams dgrad2's output is not the buffer wgrad2 reads (and the x rows are gathered into)
        dg2_out = [a for n, a in rec.calls[n0:] if n == "dgrad2"][0]
        wg_in = [a for n, a in rec.calls[n0:] if n.startswith("wgrad2")][0]
        shared_buf = any(t.dim() == 2 and t.shape == u.shape and t.data_ptr() == u.data_ptr()
                         for t in dg2_out if isinstance(t, torch.Tensor) for u in wg_in if isinstance(u, torch.Tensor))
        assert shared_buf == (streams == 1), names
    wg2, wg1 = ("wgrad2_acc", "wgrad1_acc") if main_grad else ("wgrad2", "wgrad1")
    order1, order2 = got[1][2], got[2][2]
    assert order1.index(wg2) < order1.index("dgrad2") < order1.index(wg1)
    assert order2.index(wg2) < order2.index(wg1) < order2.index("dgrad2")   # the side stream's work goes first
    assert sorted(order1) == sorted(order2)
    (g1, mg1, _), (g2, mg2, _) = got[1], got[2]
    for n in ref.Grads._fields:
        a, b = getattr(g1, n), getattr(g2, n)
        assert (a is None) == (b is None), n
        if a is not None:
            assert torch.equal(a, b), n
    if main_grad:
        assert torch.equal(mg1[0], mg2[0]) and torch.equal(mg1[1], mg2[1])


@pytest.mark.parametrize("shared", [0, 1])
def test_db2_from_slot_weights(shared):
    """db2 as the backward forms it, (per token, its slots' weights per group)ᵀ · dO (ops.slot_group_weights),
    equals the sum over each group's gathered dO rows weighted by the rows' routing weights (ops.group_sums, the
    EP backward's form) and a float64 sum over the slots: with shared experts, a dropped slot (an out-of-range id)
    and two slots of one token in one group; and it has the same bits on a rerun."""
    T, K, E, H, bm = 29, 3, 5, 8, 4
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, E, (T, K), generator=gen)
    idx[3, 1] = idx[3, 0]   # two slots of token 3 in one group
    idx[5, 2] = E + 2       # dropped: slot_pos -1
    w = torch.rand(T, K, generator=gen)
    G, cap = E + shared, -(-T * (K + shared) // bm) * bm + (E + shared) * bm
    row_src, row_w = torch.zeros(cap, dtype=torch.int32), torch.zeros(cap)
    tile_group, meta = torch.zeros(cap // bm, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    slot_pos = torch.zeros(T, K + shared, dtype=torch.int32)
    ref.ref_routing(idx, w, row_src, row_w, tile_group, meta, slot_pos, local_experts=E, shared_experts=shared, bm=bm)
    assert int(slot_pos[5, 2]) == -1 and int(meta[1]) == 1
    dO = torch.randn(T, H, generator=gen).bfloat16()
    sw = ops.slot_group_weights(slot_pos, tile_group, row_w, bm, G)
    new = sw.t() @ dO.float()
    assert torch.equal(new, ops.slot_group_weights(slot_pos, tile_group, row_w, bm, G).t() @ dO.float())
    onehot, _ = ops.group_layout(tile_group, G, bm)
    old = ops.group_sums(onehot, tile_group, dO[row_src.long()], bm, row_weight=row_w)
    want = torch.zeros(G, H, dtype=torch.float64)
    for t in range(T):
        for j in range(K + shared):
            p = int(slot_pos[t, j])
            if p >= 0:
                want[int(tile_group[p // bm])] += float(row_w[p]) * dO[t].double()
    assert torch.allclose(new.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(old.double(), want, rtol=1e-5, atol=1e-5)
    assert float(sw[3, int(idx[3, 0])]) == pytest.approx(float(w[3, 0] + w[3, 1]))
    assert float(sw[5].sum()) == pytest.approx(float(w[5, 0] + w[5, 1]) + shared)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("main_grad", [False, True])
def test_eager_calls_equal_the_custom_ops(bias, main_grad, monkeypatch):
    """moe_forward outside torch.compile calls the kernels directly (inference: the CompiledMoE; training:
    _EagerTrain), not through torch.ops.mokgen: the same launches in the same order, y and every gradient (and
    main_grad accumulator) bit-identical to the custom-op path (EAGER_CALLS False), the op never dispatched, and
    the saved tensors reach saved-tensor hooks like the op's outputs (z and the routing metadata included)."""
    cfg = small("swiglu_oai", None, "interleaved", bias=True, shared=0) if bias else small()
    runs = {}
    for eager in (True, False):
        monkeypatch.setattr(ops, "EAGER_CALLS", eager)
        moe, rec = emulated(cfg)
        x, idx, w, w1, w2, b1, b2, _ = op_args(cfg, moe, T=21, requires_grad=True)
        mg = (torch.full(w1.shape, 0.5), torch.full(w2.shape, -0.25)) if main_grad else (None, None)
        dispatched = []
        real_op = torch.ops.mokgen.moe_forward_train
        if eager:
            monkeypatch.setattr(torch.ops.mokgen, "moe_forward_train",
                                lambda *a: dispatched.append(a) or real_op(*a), raising=False)
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t, lambda t: t):
            y = ops.moe_forward(x, idx, w, w1, w2, b1, b2, moe=moe, w1_main_grad=mg[0], w2_main_grad=mg[1])
        if eager:
            monkeypatch.undo()
        dy = torch.randn(21, cfg.hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
        y.backward(dy)
        with torch.no_grad():
            y_inf = ops.moe_forward(x, idx, w, w1, w2, b1, b2, moe=moe)
        assert not dispatched
        assert any(t.dtype == torch.bfloat16 and t.shape[-1] == 2 * cfg.ffn for t in packed)   # z
        runs[eager] = (rec.names, [y, y_inf, x.grad, w.grad] + ([w1.grad, w2.grad] if not main_grad else list(mg))
                       + ([b1.grad, b2.grad] if bias else []))
    assert runs[True][0] == runs[False][0]
    for a, b in zip(runs[True][1], runs[False][1]):
        assert a is not None and torch.equal(a, b)
    if main_grad:
        assert not torch.equal(runs[True][1][4], torch.full_like(runs[True][1][4], 0.5))


def test_eager_calls_leave_fake_tensors_to_the_ops():
    """Tensors that are not plain (fake, functional, other subclasses) go through the custom ops, whose fake impls
    meet them: moe_forward under a FakeTensorMode gives the op's output shape without launching anything."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cfg = small(T=8)
    moe, rec = emulated(cfg)
    x, idx, w, w1, w2, b1, b2, _ = op_args(cfg, moe, T=8)
    with FakeTensorMode() as mode:
        fx, fidx, fw, fw1, fw2 = (mode.from_tensor(t) for t in (x, idx, w, w1, w2))
        assert not ops._eager(fx)
        y = ops.moe_forward(fx, fidx, fw, fw1, fw2, moe=moe)
    assert tuple(y.shape) == (8, cfg.hidden) and not rec.calls


def test_launch_context_without_stream_wrapper():
    """The pinned tvm-ffi (>= 0.1.15) sets the environment stream per call from torch's current stream, so the
    launch context is a no-op off CUDA and on the current device (tests/test_gpu_streams.py checks the streams
    on a GPU)."""
    from mokgen import launch

    assert launch.ffi_call_sets_stream()
    ctx = launch.on_device(torch.device("cpu"))
    with ctx:
        pass
    assert ctx is launch.on_device(torch.device("cpu"))

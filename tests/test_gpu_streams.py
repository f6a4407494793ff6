"""Two layers of one spec on two CUDA streams (issue 11 point 8): every call owns its buffers, so concurrent calls
of one ``CompiledMoE`` give the bits of the same calls run in sequence on one stream.

Per preset, two layers (different random weights) share the one ``CompiledMoE`` of their spec:

* inference forward: several iterations, launches interleaved between the two streams, each call's inputs made on
  the default stream and handed over with an event; at the default CTA count and with half the SMs per stream
  (so the two layers' persistent GEMMs can run side by side); against the same calls in sequence;
* CUDA graphs: one graph per layer, replayed on the two streams at once;
* training: ``forward_train`` + ``backward`` of the two layers on the two streams (f0, f1, b1, b0 interleaved) for
  every iteration, outputs and every gradient bitwise equal to the sequential run (the weight gradients compared
  through bit fingerprints, so that all iterations' results need not be kept);

The sequential runs the others are compared with are themselves checked: every output finite, and the first and
last iteration of each layer against the float64 reference (``mokgen.reference``; an FP8 spec's quantization-aware
one; relative error <= 1e-2), so
that a kernel broken the same way on one and two streams cannot pass.
* the sticky routing-error flag set by a call on one stream is reported by ``check_errors()``.

``MOKGEN_GPU_PRESETS`` (comma-separated) picks presets; ``MOKGEN_GPU_TOKENS`` caps the token count (default:
each preset's own ``tokens``); ``MOKGEN_GPU_OVERRIDES`` (``k=v,...``) plan overrides for ``mokgen.compile``;
``MOKGEN_GPU_STREAM_ITERS`` the number of iterations (default 6).
"""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("mokgen") is None:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mokgen  # noqa: E402
from mokgen import reference as ref  # noqa: E402
from mokgen.plan import parse_overrides  # noqa: E402
from mokgen.ops import RoutingError  # noqa: E402
from test_gpu_backward import forward_ref, grad_tol  # noqa: E402  (the references an FP8 spec is checked against)

pytestmark = [pytest.mark.gpu, pytest.mark.training]

PRESETS = ["kimi-k2", "deepseek-v4-pro", "qwen3.5-397b-a17b", "qwen3-30b-a3b", "gpt-oss-120b"]
if os.environ.get("MOKGEN_GPU_PRESETS"):
    PRESETS = [p.strip() for p in os.environ["MOKGEN_GPU_PRESETS"].split(",") if p.strip()]
OVERRIDES = parse_overrides(os.environ.get("MOKGEN_GPU_OVERRIDES", ""))  # typed as the CLI's --set
ITERS = int(os.environ.get("MOKGEN_GPU_STREAM_ITERS", "6"))
GRAD_NAMES = ref.Grads._fields


def _tokens(spec) -> int:
    cap = os.environ.get("MOKGEN_GPU_TOKENS")
    return min(spec.tokens, int(cap)) if cap else spec.tokens


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


TOL = 1e-2


def fingerprint(t: torch.Tensor | None) -> tuple[int, int] | None:
    """Two int64 sums over t's raw bits (plain, and weighted by a position hash), a slab at a time: equal tensors
    give equal fingerprints; a changed element changes them (barring a 2^-64-scale collision)."""
    if t is None:
        return None
    b = bits(t).reshape(-1)
    s0 = s1 = 0
    step = 1 << 26
    for i in range(0, b.numel(), step):
        v = b[i:i + step].long()
        pos = torch.arange(i, i + v.numel(), device=v.device, dtype=torch.int64)
        s0 += int(v.sum())
        s1 += int((v * ((pos * 2654435761) % 2147483647 + 1)).sum())
    return s0, s1


def check_reference_forward(spec, layer, inp, y, what):
    """y (bf16) finite and within TOL of the float64 reference of the call (an FP8 spec's: the quantization-aware
    one, ``ref.forward_fp8``, as tests/test_gpu_fp8.py checks it)."""
    x, idx, w = inp
    assert not bool(y.isnan().any()), f"{what}: NaN in y"
    y_ref = forward_ref(spec)(x, idx, w, layer.w1, layer.w2, spec, layer.b1, layer.b2, dtype=torch.float64)
    err = ref.rel_err(y.float(), y_ref)
    assert err <= TOL, f"{what}: y relative error {err:.3e} > {TOL}"


def check_sequential_forward(spec, layers, calls, want):
    """The sequential outputs the concurrent runs are compared with: all finite, first and last iteration of each
    layer against the reference."""
    for i, layer in enumerate(layers):
        for it in range(ITERS):
            assert bool(torch.isfinite(want[i][it]).all()), f"{spec.name}: layer {i}, iteration {it}: non-finite y"
        for it in sorted({0, ITERS - 1}):
            check_reference_forward(spec, layer, calls[i][it], want[i][it], f"{spec.name}: layer {i}, iteration {it}")


def call_inputs(spec, T: int, seed: int):
    """x [T, H] bf16, topk_idx [T, K] int32 (distinct experts per token where K <= E), topk_weight [T, K] fp32
    (softmax), made on the current stream."""
    c = ref.layer_config(spec)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, c.hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    E, K = c.local_experts, c.topk
    if K <= E:
        idx = torch.rand(T, E, generator=g, device="cuda").argsort(dim=1)[:, :K]
    else:
        idx = torch.randint(0, E, (T, K), generator=g, device="cuda")
    w = torch.randn(T, K, generator=g, device="cuda").softmax(dim=-1)
    return x, idx.to(torch.int32).contiguous(), w.contiguous()


@pytest.fixture(scope="module", params=PRESETS)
def case(request):
    spec = mokgen.load_spec(request.param)
    moe = mokgen.compile(spec, overrides=OVERRIDES)
    assert mokgen.compile(spec, overrides=OVERRIDES) is moe, "layers of one spec must share one CompiledMoE"
    T = _tokens(spec)
    layers = [ref.random_inputs(spec, tokens=T, device="cuda", seed=10 + i) for i in range(2)]   # weights
    calls = [[call_inputs(spec, T, seed=100 * (i + 1) + it) for it in range(ITERS)] for i in range(2)]
    torch.cuda.synchronize()
    yield spec, moe, layers, calls
    del layers, calls
    moe.check_errors()
    torch.cuda.empty_cache()


def forward(moe, layer, inp, **kw):
    x, idx, w = inp
    return moe(x, idx, w, layer.w1, layer.w2, layer.b1, layer.b2, **kw)


def sequential_forward(moe, layers, calls):
    """[layer][iteration] outputs, every call in order on the current stream."""
    out = [[None] * ITERS for _ in layers]
    for it in range(ITERS):
        for i, layer in enumerate(layers):
            out[i][it] = forward(moe, layer, calls[i][it])
    torch.cuda.synchronize()
    return out


def handed_over(inp, stream: torch.cuda.Stream):
    """Copies of a call's inputs made on the current (producer) stream, handed to ``stream`` through an event
    (and recorded on it, so that the allocator keeps them until that stream is done with them)."""
    copies = tuple(t.clone() for t in inp)
    ev = torch.cuda.Event()
    ev.record()
    stream.wait_event(ev)
    for t in copies:
        t.record_stream(stream)
    return copies


def test_forward_two_streams_match_sequential(case, ctas):
    spec, moe, layers, calls = case
    want = sequential_forward(moe, layers, calls)
    check_sequential_forward(spec, layers, calls, want)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for num_ctas in (None, ctas.half):
        got = [[None] * ITERS for _ in layers]
        for it in range(ITERS):                      # launches interleaved: layer 0, layer 1, layer 0, ...
            for i, layer in enumerate(layers):
                inp = handed_over(calls[i][it], streams[i])
                with torch.cuda.stream(streams[i]):
                    got[i][it] = forward(moe, layer, inp, num_ctas=num_ctas)
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        for i in range(2):
            for it in range(ITERS):
                assert same_bits(got[i][it], want[i][it]), \
                    f"{spec.name}: layer {i}, iteration {it}, num_ctas={num_ctas}: two-stream bits differ"
    moe.check_errors()


def test_graphs_replayed_on_two_streams(case):
    """One graph per layer (each with its own buffers from its pool), replayed concurrently on two streams."""
    spec, moe, layers, calls = case
    want = sequential_forward(moe, layers, calls)
    check_sequential_forward(spec, layers, calls, want)
    static = [tuple(t.clone() for t in calls[i][0]) for i in range(2)]
    outs, graphs = [], []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(2):
            forward(moe, layers[i], static[i])   # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    for i in range(2):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs.append(forward(moe, layers[i], static[i]))
        graphs.append(g)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for it in range(ITERS):
        for i in range(2):
            for dst, src in zip(static[i], calls[i][it]):
                dst.copy_(src)                       # the producer: the default stream
        for i in range(2):
            streams[i].wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(streams[i]):
                graphs[i].replay()
        for i in range(2):
            torch.cuda.current_stream().wait_stream(streams[i])
        torch.cuda.synchronize()
        for i in range(2):
            assert same_bits(outs[i], want[i][it]), f"{spec.name}: graph of layer {i}, iteration {it}: bits differ"
    del graphs
    moe.check_errors()


def test_training_two_streams_match_sequential(case):
    spec, moe, layers, calls = case
    if not moe.trainable:
        pytest.skip(f"{spec.name}: these kernels have no training kernels (fused schedule?)")
    T = calls[0][0][0].shape[0]
    g = torch.Generator(device="cuda").manual_seed(7)
    dys = [[torch.randn(T, spec.hidden, generator=g, device="cuda").to(torch.bfloat16) for _ in range(ITERS)]
           for _ in range(2)]

    def step_args(i, inp):
        x, idx, w = inp
        L = layers[i]
        return x, idx, w, L.w1, L.w2, L.b1, L.b2

    def keep(y, gr):
        """What is kept of a step: y and the small gradients whole, the weight gradients (6.4 GB a set on
        gpt-oss-120b) as fingerprints."""
        return y, {n: (t if n in ("x", "topk_weight", "b1", "b2") else fingerprint(t))
                   for n, t in zip(GRAD_NAMES, gr)}

    # sequential, one stream; the first and last iteration of each layer checked against the reference
    want = [[None] * ITERS for _ in range(2)]
    for it in range(ITERS):
        for i in range(2):
            x, idx, w, w1, w2, b1, b2 = step_args(i, calls[i][it])
            y, saved = moe.forward_train(x, idx, w, w1, w2, b1, b2)
            gr = moe.backward(dys[i][it], saved, x, w, w1, w2, b1, b2)
            torch.cuda.synchronize()
            what = f"{spec.name}: sequential training, layer {i}, iteration {it}"
            for n, t in zip(GRAD_NAMES, gr):
                assert t is None or bool(torch.isfinite(t).all()), f"{what}: d{n} not finite"
            if it in (0, ITERS - 1):
                check_reference_forward(spec, layers[i], calls[i][it], y, what)
                g_ref = ref.backward(dys[i][it], x, idx, w, w1, w2, spec, b1, b2, dtype=torch.float64)
                tol = grad_tol(spec)   # an FP8 spec's: test_gpu_fp8's bound against the BF16 reference
                for n, t, r in zip(GRAD_NAMES, gr, g_ref):
                    if r is not None:
                        err = ref.rel_err(t.float(), r)
                        assert err <= tol, f"{what}: d{n} relative error {err:.3e} > {tol}"
                del g_ref
            want[i][it] = keep(y, gr)
            del gr, saved

    # two streams: f0, f1 then b1, b0 per iteration, each on its layer's stream; compared per iteration
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for it in range(ITERS):
        pending, got = [], [None, None]
        for i in range(2):
            inp = handed_over(calls[i][it], streams[i])
            dy = handed_over((dys[i][it],), streams[i])[0]
            with torch.cuda.stream(streams[i]):
                x, idx, w, w1, w2, b1, b2 = step_args(i, inp)
                y, saved = moe.forward_train(x, idx, w, w1, w2, b1, b2)
            pending.append((i, inp, dy, y, saved))
        for i, inp, dy, y, saved in reversed(pending):
            with torch.cuda.stream(streams[i]):
                x, idx, w, w1, w2, b1, b2 = step_args(i, inp)
                got[i] = (y, moe.backward(dy, saved, x, w, w1, w2, b1, b2))
        for s_ in streams:
            torch.cuda.current_stream().wait_stream(s_)
        torch.cuda.synchronize()
        for i in range(2):
            (y, gr), (y_w, gr_w) = keep(*got[i]), want[i][it]
            assert same_bits(y, y_w), f"{spec.name}: training forward of layer {i}, iteration {it}: bits differ"
            for name in GRAD_NAMES:
                a, b = gr[name], gr_w[name]
                same = same_bits(a, b) if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) else a == b
                assert same, f"{spec.name}: layer {i}, iteration {it}: d{name} bits differ on two streams"
        del pending, got
    moe.check_errors()


def test_routing_error_on_one_stream_is_reported(case):
    spec, moe, layers, calls = case
    moe.check_errors()
    x, idx, w = calls[1][0]
    bad = idx.clone()
    bad[0, 0] = spec.local_experts
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(3):
        with torch.cuda.stream(streams[0]):
            forward(moe, layers[0], calls[0][0])       # clean calls on stream 0 ...
        with torch.cuda.stream(streams[1]):
            forward(moe, layers[1], (x, bad, w))        # ... while stream 1 sees a bad id
    with torch.cuda.stream(streams[0]):
        forward(moe, layers[0], calls[0][1])
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    with pytest.raises(RoutingError, match="since the last check"):
        moe.check_errors()
    moe.check_errors()                                 # cleared

#!/usr/bin/env python
"""Whole-model training benchmark through transformers: a Qwen3-MoE-shaped causal LM trained with AdamW on
synthetic tokens, its experts computed by mokgen's backend, transformers' grouped_mm backend and (if importable)
Liger-Kernel's qwen3_moe patch, in one process.

    python tools/bench_model.py [--steps 100] [--warmup-steps 10] [--batch 4] [--seq 1024] [--accum 1] [--layers 4]
                                [--hidden 2048] [--experts 128] [--topk 8] [--moe-intermediate 768] [--vocab 8192]
                                [--impls mokgen,mokgen_fp8,grouped_mm,liger] [--liger-full] [--liger-autotune] [--rounds 1]
                                [--out bench/results/model-<gpu>.json] [--dry-run]

The model: ``Qwen3MoeForCausalLM`` from ``Qwen3MoeConfig`` with qwen3-30b-a3b's layer shape (hidden 2048, 128
experts, top-8, moe_intermediate 768, 32 heads of 128, 4 KV heads, norm_topk_prob) but ``--layers`` layers (4)
and a small vocabulary (``--vocab``), bf16 parameters, random init (seeded; every implementation starts from
the same weights: ``init_checksum`` in the records), SDPA attention, no dropout. Data: ``--batch`` sequences of
``--seq`` tokens per step (T = batch * seq tokens through every MoE layer), each sequence a random segment of 64
tokens repeated (so the loss has something to learn: copying), the same batches for every implementation. The
step: LM loss (labels = inputs), ``loss.backward()``, ``AdamW.step()`` (lr ``--lr``, fused on CUDA),
``zero_grad(set_to_none=True)``; with ``--accum N`` (gradient accumulation) a step runs N micro-batches' forward and
backward (each loss divided by N, the step's loss their sum) before its one AdamW update, so the optimizer's cost,
the same for every implementation, is spread over N times the tokens (``tokens_per_step`` = batch * seq * N).

Implementations: ``mokgen`` (``model.set_experts_implementation("mokgen")``: mokgen.integrations.transformers),
``mokgen_fp8`` (the same backend with ``configure(dtype="fp8")``: the experts' GEMMs in Hopper's blockwise FP8,
the model's parameters bf16 master weights; its loss curve against grouped_mm's says whether FP8 training
tracks BF16 on this model, and ``speedup_vs_mokgen`` is mokgen BF16's median_ms over its own),
``grouped_mm`` (transformers' default experts backend), ``liger`` (``apply_liger_kernel_to_qwen3_moe(model=...,
swiglu=True)``: Liger's ``LigerExperts`` with its fused Triton MoE; rope / rms_norm / fused linear cross entropy
left off so that only the experts differ, unless ``--liger-full``; ``LIGER_FUSED_MOE_AUTOTUNE=0`` unless
``--liger-autotune``). Liger runs last (its patch also replaces the ``Qwen3MoeExperts`` class for models built
afterwards). Install it on the GPU machine from a wheel: ``pip download liger-kernel==0.8.5 --no-deps -d .whl``
here, carry ``.whl`` (``tools/device_env.sh`` installs it into /tmp/site).

Timing: CUDA events around every step (no host sync inside the loop; the losses are read at the end);
``step_ms`` lists them all, ``median_ms`` is the median over the steps after ``--warmup-steps`` (the first
ones include mokgen's kernel load or compile, Triton's JIT, the optimizer's state allocation), ``tokens_per_s``
= batch * seq * accum / median. ``--rounds N`` runs every implementation's loop N times, interleaved (fresh model each
time), and records the median of the rounds' medians (``round_ms``). Ratios are measured in this run:
``speedup_vs_grouped_mm`` / ``speedup_vs_liger`` = that implementation's median_ms / this one's.

The experts' share of the step: ``no_experts`` trains the same model with every experts module returning zeros
(``hidden_states * 0``: the router, its top-k and everything outside the experts still run, forward and
backward); for each other implementation ``experts_ms`` = its median_ms - no_experts' median_ms (what its experts
cost per step, forward + backward + their optimizer update) and ``experts_share`` = experts_ms / median_ms.
no_experts' own losses are not a model's: it is a timing reference only.

Records (one per implementation, APPENDED to the JSON list in ``--out``; '-' writes nothing): gpu, date,
versions (torch, cuda, triton, CuTe DSL, mokgen git sha, transformers, liger-kernel), shape, dims, impl,
median_ms, tokens_per_s, speedup_vs_grouped_mm, speedup_vs_liger, losses (every step's), final_loss,
loss_max_rel_diff_vs_grouped_mm (over the steps), step_ms, round_ms, steps, warmup_steps, peak_mem_mb,
init_checksum, optimizer, timing, plus ``error`` where an implementation failed (the others go on).

Exit status 0 when every implementation that ran has a record without ``error``, else 1 (the records are
written either way); 2 for bad arguments or no GPU.

``--dry-run``: CPU, tiny dims (hidden 256, 2 layers, 8 experts, top-2, moe_intermediate 128, 2 x 64 tokens,
4 steps), mokgen through its reference kernels (``mokgen.integrations.transformers.reference_compiler``), no
Liger; writes nothing unless ``--out`` is given. It keeps this script from rotting (tests/test_bench_model.py).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import gc
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

_TOOLS = Path(__file__).resolve().parent
if str(_TOOLS) not in sys.path:
    sys.path.insert(0, str(_TOOLS))

import bench_forward as BF  # noqa: E402  (puts the repository root on sys.path too)
import torch  # noqa: E402

DEFAULT_OUT = f"{BF.RESULTS_DIR}/model-<gpu>.json"   # BF.default_out: the GPU's own file
IMPLS = ["no_experts", "grouped_mm", "mokgen", "mokgen_fp8", "liger"]   # the run order: liger last (its patch
#                                                                         replaces a class)
MOKGEN_DTYPES = {"mokgen": "bf16", "mokgen_fp8": "fp8"}   # the backend's configure(dtype=...) per implementation
RECORD_FIELDS = ["gpu", "date", "versions", "shape", "dims", "impl", "median_ms", "tokens_per_s",
                 "speedup_vs_grouped_mm", "speedup_vs_liger", "losses", "final_loss",
                 "loss_max_rel_diff_vs_grouped_mm", "step_ms", "round_ms", "steps", "warmup_steps", "peak_mem_mb",
                 "init_checksum", "optimizer", "timing", "experts_ms", "experts_share", "speedup_vs_mokgen"]
DRY = dict(hidden=256, layers=2, experts=8, topk=2, moe_intermediate=128, vocab=512, batch=2, seq=64, steps=4,
           warmup_steps=1)
PERIOD = 64   # the synthetic sequences repeat a random segment of this many tokens

_log = BF._log
_short_error = BF._short_error


# ---------------------------------------------------------------------------------------------------------
# model and data
# ---------------------------------------------------------------------------------------------------------


def model_config(a: argparse.Namespace) -> Any:
    from transformers import Qwen3MoeConfig

    heads = max(1, a.hidden // 64) if a.hidden < 2048 else 32
    return Qwen3MoeConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                          num_attention_heads=heads, num_key_value_heads=max(1, heads // 8),
                          head_dim=128 if a.hidden >= 2048 else 64, intermediate_size=4 * a.moe_intermediate,
                          moe_intermediate_size=a.moe_intermediate, num_experts=a.experts,
                          num_experts_per_tok=a.topk, norm_topk_prob=True, max_position_embeddings=max(4096, a.seq),
                          tie_word_embeddings=False, attention_dropout=0.0, output_router_logits=False,
                          decoder_sparse_step=1, mlp_only_layers=[])


def build_model(cfg: Any, device: torch.device, seed: int, impl: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    if device.type == "cuda":
        torch.cuda.manual_seed(seed)
    backend = "grouped_mm" if impl in ("liger", "no_experts") else "mokgen" if impl in MOKGEN_DTYPES else impl
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, experts_implementation=backend)
    if impl == "no_experts":
        drop_experts(model)
    return model.train()


def _zero_experts(self, hidden_states, top_k_index, top_k_weights):
    """The no_experts timing reference: an experts module that costs (almost) nothing."""
    return hidden_states * 0


def drop_experts(model: torch.nn.Module) -> int:
    """Make every experts module of ``model`` return zeros (the ``no_experts`` reference); their count."""
    import types

    n = 0
    for layer in model.model.layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None:
            experts.forward = types.MethodType(_zero_experts, experts)
            n += 1
    if not n:
        raise RuntimeError("no experts modules found (model.model.layers[i].mlp.experts)")
    return n


def checksum(model: torch.nn.Module) -> float:
    with torch.no_grad():
        return float(sum(p.float().sum().item() * (i + 1) for i, p in enumerate(model.parameters())))


def batches(a: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    """``steps * accum`` micro-batches of ``[batch, seq]`` token ids (seeded, the same for every implementation)."""
    g = torch.Generator().manual_seed(a.seed + 1)
    out = []
    reps = -(-a.seq // PERIOD)
    for _ in range(a.steps * a.accum):
        seg = torch.randint(0, a.vocab, (a.batch, PERIOD), generator=g)
        out.append(seg.repeat(1, reps)[:, :a.seq].contiguous().to(device))
    return out


def apply_liger(model: torch.nn.Module, full: bool) -> None:
    from transformers.models.qwen3_moe import modeling_qwen3_moe as M
    from liger_kernel.transformers import apply_liger_kernel_to_qwen3_moe

    keep = {n: getattr(M, n) for n in ("Qwen3MoeExperts", "Qwen3MoeRMSNorm", "apply_rotary_pos_emb")}
    keep_fwd = M.Qwen3MoeForCausalLM.forward
    try:
        if full:
            apply_liger_kernel_to_qwen3_moe(model=model)
        else:
            apply_liger_kernel_to_qwen3_moe(rope=False, cross_entropy=False, fused_linear_cross_entropy=False,
                                            rms_norm=False, swiglu=True, model=model)
    finally:   # the class-level patches would reach models built later in this process: undo them (the
        #        instance patches on this model stay)
        for n, v in keep.items():
            setattr(M, n, v)
        M.Qwen3MoeForCausalLM.forward = keep_fwd
    name = model.model.layers[0].mlp.experts._get_name()
    if "Liger" not in name:
        raise RuntimeError(f"Liger's patch did not reach the experts (their module says {name!r})")


# ---------------------------------------------------------------------------------------------------------
# one training run
# ---------------------------------------------------------------------------------------------------------


def train(impl: str, a: argparse.Namespace, cfg: Any, data: list[torch.Tensor], device: torch.device,
          liger_full: bool) -> dict[str, Any]:
    """Build the model for ``impl``, train ``a.steps`` optimizer steps of ``a.accum`` micro-batches each; {losses
    (per step: the mean over its micro-batches), step_ms, peak_mem_mb, init_checksum}."""
    model = build_model(cfg, device, a.seed, impl)
    res: dict[str, Any] = {"init_checksum": checksum(model)}
    if impl == "liger":
        apply_liger(model, liger_full)
    elif impl in MOKGEN_DTYPES:
        import mokgen.integrations.transformers as mt

        # plan for this step's T (any T would run); the experts' precision of this implementation
        mt.configure(tokens=a.batch * a.seq, dtype=MOKGEN_DTYPES[impl])
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.0,
                            **({"fused": True} if fused else {}))
    res["optimizer"] = f"AdamW(lr={a.lr}, betas=(0.9, 0.95), weight_decay=0, fused={fused})"
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    losses, events, wall = [], [], []
    for step in range(a.steps):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        else:
            t0 = time.perf_counter()
        loss = 0.0
        for ids in data[step * a.accum:(step + 1) * a.accum]:   # gradient accumulation: the micro-batches' mean
            micro = model(input_ids=ids, labels=ids).loss / a.accum
            micro.backward()
            loss = loss + micro.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss)
        if cuda:
            e.record()
            events.append((s, e))
        else:
            wall.append((time.perf_counter() - t0) * 1e3)
    if cuda:
        torch.cuda.synchronize(device)
        res["step_ms"] = [s.elapsed_time(e) for s, e in events]
        res["peak_mem_mb"] = (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    else:
        res["step_ms"] = wall
        res["peak_mem_mb"] = None
    res["losses"] = [float(v) for v in torch.stack(losses).float().cpu()]
    if impl in MOKGEN_DTYPES:
        import mokgen.integrations.transformers as mt

        mt.check_errors()   # a routing error flagged during the run voids it
    del model, opt, losses
    BF._free(device)
    return res


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def run_all(a: argparse.Namespace, impls: list[str], device: torch.device) -> tuple[dict[str, dict[str, Any]], Any]:
    cfg = model_config(a)
    data = batches(a, device)
    results: dict[str, dict[str, Any]] = {i: {"rounds": []} for i in impls}
    for r in range(a.rounds):
        for impl in impls:
            if results[impl].get("error"):
                continue
            t0 = time.perf_counter()
            try:
                res = train(impl, a, cfg, data, device, a.liger_full)
            except Exception as e:  # noqa: BLE001 - record and go on with the others
                results[impl] = {"error": _short_error(e) if r == 0 else f"round {r + 1}: {_short_error(e)}"}
                _log(f"{impl}: FAILED {results[impl]['error']}")
                if os.environ.get("MOKGEN_BENCH_TRACEBACK"):
                    traceback.print_exc()
                BF._free(device)
                continue
            timed = res["step_ms"][a.warmup_steps:] or res["step_ms"]
            res["median_ms"] = _median(timed)
            results[impl]["rounds"].append(res)
            _log(f"round {r + 1} {impl}: median {res['median_ms']:.2f} ms/step "
                 f"({a.batch * a.seq * a.accum / (res['median_ms'] * 1e-3):,.0f} tokens/s), loss {res['losses'][0]:.3f} -> "
                 f"{res['losses'][-1]:.3f}, peak {res['peak_mem_mb'] or 0:.0f} MiB ({time.perf_counter() - t0:.1f} s)")
    return results, cfg


def records(a: argparse.Namespace, results: dict[str, dict[str, Any]], ctx: dict[str, Any]) -> list[dict[str, Any]]:
    dims = dict(hidden=a.hidden, layers=a.layers, experts=a.experts, topk=a.topk, moe_intermediate=a.moe_intermediate,
                vocab=a.vocab, batch=a.batch, seq=a.seq, accum=a.accum, tokens_per_step=a.batch * a.seq * a.accum,
                lr=a.lr,
                liger_full=a.liger_full, liger_autotune=a.liger_autotune)
    shape = f"qwen3-moe-h{a.hidden}-e{a.experts}-k{a.topk}-i{a.moe_intermediate}-{a.layers}L"
    med = {i: _median([rr["median_ms"] for rr in r["rounds"]]) for i, r in results.items() if r.get("rounds")}
    base_losses = results.get("grouped_mm", {}).get("rounds", [{}])[0].get("losses") if med.get("grouped_mm") else None
    out = []
    for impl, r in results.items():
        rec: dict[str, Any] = dict(gpu=ctx["gpu"], date=ctx["date"], versions=ctx["versions"], shape=shape,
                                   dims=dims, impl=impl, timing=ctx["timing"], steps=a.steps,
                                   warmup_steps=a.warmup_steps)
        if r.get("error") or not r.get("rounds"):
            rec.update({k: None for k in RECORD_FIELDS if k not in rec})
            rec["error"] = r.get("error", "no run")
            out.append(rec)
            continue
        first = r["rounds"][0]
        ms = med[impl]
        losses = first["losses"]
        diff = None
        if base_losses and impl not in ("grouped_mm", "no_experts"):
            diff = max(abs(x - y) / abs(y) for x, y in zip(losses, base_losses) if y)
        ref_ms = med.get("no_experts")
        if impl != "no_experts" and ref_ms is not None:
            rec.update(experts_ms=ms - ref_ms, experts_share=(ms - ref_ms) / ms)
        else:
            rec.update(experts_ms=None, experts_share=None)
        rec.update(median_ms=ms, tokens_per_s=a.batch * a.seq * a.accum / (ms * 1e-3),
                   speedup_vs_grouped_mm=(med["grouped_mm"] / ms) if med.get("grouped_mm") else None,
                   speedup_vs_liger=(med["liger"] / ms) if med.get("liger") else None,
                   speedup_vs_mokgen=(med["mokgen"] / ms) if med.get("mokgen") and impl == "mokgen_fp8" else None,
                   losses=losses, final_loss=losses[-1], loss_max_rel_diff_vs_grouped_mm=diff,
                   step_ms=first["step_ms"], round_ms=[rr["median_ms"] for rr in r["rounds"]],
                   peak_mem_mb=first["peak_mem_mb"], init_checksum=first["init_checksum"],
                   optimizer=first["optimizer"])
        if impl == "no_experts":   # a timing reference, not a model: no ratios, no loss comparison
            rec.update(speedup_vs_grouped_mm=None, speedup_vs_liger=None)
        if not all(math.isfinite(v) for v in losses):
            rec["error"] = "non-finite loss"
        out.append(rec)
    sums = {r["init_checksum"] for r in out if r.get("init_checksum") is not None}
    if len(sums) > 1:
        for r in out:
            r.setdefault("error", f"implementations started from different weights: checksums {sorted(sums)}")
    return out


def print_table(recs: list[dict[str, Any]], title: str) -> None:
    header = ["shape", "impl", "ms/step", "tokens/s", "vs grouped_mm", "vs liger", "vs mokgen", "experts ms (share)",
              "loss first->last", "max loss diff", "peak MiB"]
    rows = []
    for r in recs:
        if r.get("error") and r.get("median_ms") is None:
            rows.append([r["shape"], r["impl"], "ERROR", r["error"][:60]] + [""] * (len(header) - 4))
            continue
        rows.append([r["shape"], r["impl"], f"{r['median_ms']:.2f}", f"{r['tokens_per_s']:,.0f}",
                     "-" if r["speedup_vs_grouped_mm"] is None else f"{r['speedup_vs_grouped_mm']:.2f}x",
                     "-" if r["speedup_vs_liger"] is None else f"{r['speedup_vs_liger']:.2f}x",
                     "-" if r.get("speedup_vs_mokgen") is None else f"{r['speedup_vs_mokgen']:.2f}x",
                     "-" if r.get("experts_ms") is None else f"{r['experts_ms']:.2f} ({r['experts_share']:.0%})",
                     f"{r['losses'][0]:.3f} -> {r['final_loss']:.3f}",
                     "-" if r["loss_max_rel_diff_vs_grouped_mm"] is None
                     else f"{r['loss_max_rel_diff_vs_grouped_mm']:.2e}",
                     "-" if r["peak_mem_mb"] is None else f"{r['peak_mem_mb']:.0f}"])
    BF.render_table(title, header, rows, width=140)


# ---------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_model", description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="AdamW steps per implementation (default 100)")
    ap.add_argument("--warmup-steps", type=int, default=None, help="steps left out of the median (default 10)")
    ap.add_argument("--batch", type=int, default=None, help="sequences per step (default 4)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 1024)")
    ap.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step (gradient accumulation: "
                    "each step runs ACCUM forward+backward passes of --batch sequences, then one AdamW update; "
                    "default 1)")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers, all MoE (default 4)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 2048)")
    ap.add_argument("--experts", type=int, default=None, help="experts per layer (default 128)")
    ap.add_argument("--topk", type=int, default=None, help="experts per token (default 8)")
    ap.add_argument("--moe-intermediate", type=int, default=None, help="expert FFN size (default 768)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary size (default 8192)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=1, help="train every implementation this many times, "
                    "interleaved, and record the median of the rounds (default 1)")
    ap.add_argument("--impls", default=None, help=f"comma-separated subset of {','.join(IMPLS)} (no_experts: the "
                    "timing reference for the experts' share)")
    ap.add_argument("--liger-full", action="store_true", help="all of Liger's qwen3_moe kernels (rope, rms_norm, "
                    "fused linear cross entropy, experts), not only its experts")
    ap.add_argument("--liger-autotune", action="store_true", help="LIGER_FUSED_MOE_AUTOTUNE=1 (default 0)")
    ap.add_argument("--out", default=None, help=f"JSON list the records are appended to (default {DEFAULT_OUT}; "
                    "with --dry-run: nothing); '-' writes nothing")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny dims, mokgen on its reference kernels")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    full = dict(hidden=2048, layers=4, experts=128, topk=8, moe_intermediate=768, vocab=8192, batch=4, seq=1024,
                steps=100, warmup_steps=10)
    for k, v in (DRY if a.dry_run else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.steps < 1 or a.warmup_steps < 0 or a.rounds < 1 or a.accum < 1:
        print("bench_model: --steps >= 1, --warmup-steps >= 0, --rounds >= 1, --accum >= 1", file=sys.stderr)
        return 2
    device = BF.pick_device(a.dry_run, "bench_model")
    impls = BF.parse_impls(a.impls, IMPLS, "bench_model")
    if device is None or impls is None:
        return 2
    impls = [i for i in IMPLS if i in impls]   # liger last
    try:
        import transformers
    except ImportError as e:
        print(f"bench_model: {_short_error(e)} (pip install 'mokgen[transformers]')", file=sys.stderr)
        return 2
    versions = BF.collect_versions()
    versions["transformers"] = transformers.__version__
    if any(i in MOKGEN_DTYPES for i in impls):
        import mokgen.integrations.transformers as mt

        if device.type == "cpu":
            mt.set_compiler(mt.reference_compiler())
    if "liger" in impls:
        if device.type == "cpu":
            _log("dry-run: liger skipped (needs CUDA)")
            impls.remove("liger")
        else:
            os.environ["LIGER_FUSED_MOE_AUTOTUNE"] = "1" if a.liger_autotune else "0"
            try:
                import liger_kernel  # noqa: F401
                from importlib.metadata import version

                versions["liger-kernel"] = version("liger-kernel")
            except Exception as e:  # noqa: BLE001 - "if importable": say so and go on without it
                _log(f"liger: not importable ({_short_error(e)}); no liger record")
                impls.remove("liger")
    timing = ("cuda events per step, median after warm-up" if device.type == "cuda"
              else "perf_counter per step, median after warm-up")
    ctx = dict(gpu=BF.gpu_name(device), date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               versions=versions, timing=timing)
    _log(f"bench_model on {ctx['gpu']}; {timing}; versions {versions}; impls {impls}; T = {a.batch} x {a.seq}"
         + (f", {a.accum} micro-batches per optimizer step" if a.accum > 1 else ""))
    t0 = time.perf_counter()
    results, _cfg = run_all(a, impls, device)
    recs = records(a, results, ctx)
    _log(f"total {time.perf_counter() - t0:.1f}s")
    print_table(recs, f"{a.layers}-layer Qwen3-MoE-shaped model, {a.steps} AdamW steps, {ctx['gpu']}")
    out = a.out if a.out is not None else ("-" if a.dry_run else BF.default_out("model", device))
    if out != "-":
        BF.append_records(out, recs)
        _log(f"appended {len(recs)} records to {out}")
    gc.collect()
    return 0 if all(not r.get("error") for r in recs) else 1


if __name__ == "__main__":
    sys.exit(main())

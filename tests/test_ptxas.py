"""mokgen.build's ptxas advisories: the check that every GEMM keeps its wgmma pipeline (tests/test_emit.py runs it
on every preset's kernels) must flag a kernel whose accumulator is read on a path that skips the final wait.

Two hand-written PTX kernels, the same but for one branch: in the bad one a path reaches the accumulator's
reader without `wgmma.wait_group 0` (as the varlen-K wgrads' conditional drain did: bench/NOTES.md v12), and
ptxas serializes every wgmma of the loop (C7514). Needs a ptxas (CI's image has one); no GPU, no CuTe DSL."""

from __future__ import annotations

import pytest

from mokgen import build

_PTX = """.version 8.0
.target sm_90a
.address_size 64
.visible .entry k(.param .u64 out, .param .u64 desc, .param .u32 n)
{
  .reg .f32 %f<8>;
  .reg .b64 %rd<4>;
  .reg .b32 %r<4>;
  .reg .pred %p<2>;
  ld.param.u64 %rd1, [desc];
  ld.param.u64 %rd2, [out];
  ld.param.u32 %r1, [n];
  mov.f32 %f1, 0f00000000; mov.f32 %f2, 0f00000000; mov.f32 %f3, 0f00000000; mov.f32 %f4, 0f00000000;
  mov.u32 %r2, 0;
LOOP:
  wgmma.fence.sync.aligned;
  wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%f1,%f2,%f3,%f4}, %rd1, %rd1, 1, 1, 1, 0, 0;
  wgmma.commit_group.sync.aligned;
  wgmma.wait_group.sync.aligned 1;
  add.u32 %r2, %r2, 1;
  setp.lt.u32 %p1, %r2, %r1;
  @%p1 bra LOOP;
  setp.eq.u32 %p1, %r1, 7;
SKIP_BRANCH
  wgmma.wait_group.sync.aligned 0;
SKIP:
  add.f32 %f5, %f1, %f2;
  st.global.f32 [%rd2], %f5;
  ret;
}
"""

needs_ptxas = pytest.mark.skipif(build.find_ptxas() is None, reason="no ptxas on PATH (or $MOKGEN_PTXAS)")


@needs_ptxas
def test_serialized_wgmma_is_flagged():
    bad = build.ptxas_advisories(_PTX.replace("SKIP_BRANCH", "  @%p1 bra SKIP;"), "sm_90a")
    assert bad is not None and any(a.startswith("C7514") for a in bad), bad


@needs_ptxas
def test_pipelined_wgmma_is_clean():
    assert build.ptxas_advisories(_PTX.replace("SKIP_BRANCH", ""), "sm_90a") == []


@needs_ptxas
def test_newer_ptx_version_is_read():
    """The DSL writes a newer PTX ISA than an older ptxas knows: the header is lowered, the check still runs."""
    text = _PTX.replace(".version 8.0", ".version 99.9").replace("SKIP_BRANCH", "  @%p1 bra SKIP;")
    assert any(a.startswith("C7514") for a in build.ptxas_advisories(text, "sm_90a"))


def test_no_ptxas_means_no_answer(monkeypatch, tmp_path):
    monkeypatch.setenv("MOKGEN_PTXAS", str(tmp_path / "missing-ptxas"))
    assert build.find_ptxas() is None
    assert build.ptxas_advisories(_PTX, "sm_90a") is None

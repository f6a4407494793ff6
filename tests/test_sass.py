"""SASS checks (issue 20: sm_100a kernels "whose PTX and SASS hold what they must"): mokgen.build assembles a
kernel's PTX for its arch with ptxas and disassembles the cubin with nvdisasm (``sass_of_ptx`` / ``sass_texts`` /
``sass_report``; nvdisasm from PATH or the ``nvidia-cuda-nvdisasm`` wheel of the dev extra); the checks here read
the mnemonics of the tensor-core, TMEM, TMA, mbarrier and Cluster Launch Control instructions.

The PTX -> SASS correspondence, as observed (ptxas 13.0 -> sm_100a / sm_90a cubins, nvdisasm 13.5; read off our
own kernels by matching instruction counts in the PTX and the SASS of kimi-k2 and kimi-k2-mxfp8, not taken from
a specification; NVIDIA does not document SASS):

================================================================  =============================================
PTX                                                               SASS (first word; modifiers as printed)
================================================================  =============================================
``tcgen05.mma.cta_group::1.kind::f16``                            ``UTCHMMA gdesc, gdesc, tmem, tmem, idesc, UR``
``tcgen05.mma.cta_group::1.kind::mxf8f6f4.block_scale.block32``  ``UTCQMMA gdesc, gdesc, tmem, tmem, idesc, tmem``
                                                                  (the operand after idesc a TMEM address: the
                                                                  scale factors; kind::f16's is a register)
``tcgen05.cp.cta_group::1.32x128b.warpx4`` (scale atoms to TMEM)  ``UTCCP.T.S.4x32dp128bit``
``tcgen05.ld.sync.aligned.32x32b.x32``                            ``LDTM.x32``
``tcgen05.commit...mbarrier::arrive::one``                        ``UTCBAR``
``tcgen05.alloc`` / ``tcgen05.dealloc``                           ``UTCATOMSWS.FIND_AND_SET.ALIGN`` (in a retry
                                                                  loop) / ``UTCATOMSWS.AND``
``cp.async.bulk.tensor.Nd.shared::cta.global`` (TMA load)         ``UTMALDG.ND``
``cp.async.bulk.tensor.Nd.global.shared::cta`` (TMA store)        ``UTMASTG.ND``
``cp.async.bulk.commit_group``                                    ``UTMACMDFLUSH``
``prefetch.tensormap``                                            ``UTMACCTL.PF``
``clusterlaunchcontrol.try_cancel``                               ``UGETNEXTWORKID.SELFCAST``
``mbarrier.init`` / ``.arrive(.expect_tx)`` / ``.try_wait``       ``SYNCS.EXCH.64`` / ``SYNCS.ARRIVE.TRANS64`` /
                                                                  ``SYNCS.PHASECHK.TRANS64(.TRYWAIT)``
``wgmma.mma_async`` (sm_90a)                                      ``HGMMA.64xNx16...`` (with ``WARPGROUP.ARRIVE``)
================================================================  =============================================

No ``tcgen05.st`` is issued by our kernels (no STTM observed). The checks assert presence (and the block-scaled
operand form), not counts: counts follow ptxas's unrolling. Tests without ptxas or nvdisasm skip with the reason;
the checkers themselves are tested on short SASS texts (observed lines) with each wanted instruction removed."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from mokgen import build

_MISSING = [what for what, found in (("ptxas (PATH or $MOKGEN_PTXAS)", build.find_ptxas()),
                                     ("nvdisasm (PATH, $MOKGEN_NVDISASM or the nvidia-cuda-nvdisasm wheel of the dev "
                                      "extra)", build.find_nvdisasm())) if found is None]
needs_sass = pytest.mark.skipif(bool(_MISSING), reason=f"SASS checks need {' and '.join(_MISSING)}: not found")

GEMMS = ("gemm1", "gemm2", "gemm1_train", "dgrad1", "dgrad2", "wgrad1", "wgrad2", "wgrad1_acc", "wgrad2_acc")
MX_GEMMS = ("gemm1", "gemm2", "gemm1_train", "dgrad1", "dgrad2")   # block-scaled in an MXFP8 entry
# every sm_100a GEMM: tcgen05.commit, TMEM alloc / dealloc, tcgen05.ld, TMA loads, mbarriers, CLC
SM100_GEMM_WANTED = ("UTCBAR", "UTCATOMSWS", "LDTM", "UTMALDG", "SYNCS", "UGETNEXTWORKID")
SM100_ONLY = ("UTCHMMA", "UTCQMMA", "UTCBAR", "UTCCP", "UTCATOMSWS", "LDTM", "UGETNEXTWORKID")
HOPPER_MMA = ("HGMMA", "WARPGROUP")
_TMEM = r"tmem\[[^\]]+\]"
_GDESC = r"gdesc\[[^\]]+\]"
_BLOCK_SCALED_RE = re.compile(rf"\bUTCQMMA(?:\.\S+)?\s+{_GDESC},\s*{_GDESC},\s*{_TMEM},\s*{_TMEM},\s*"
                              rf"idesc\[[^\]]+\],\s*{_TMEM}")


def check_sm100_sass(texts: dict[str, str], mx: bool = False) -> None:
    """``texts``: ``{kernel: SASS}`` of an sm_100a training entry (``build.sass_texts``). Every GEMM holds the
    tcgen05 MMA, TMEM and TMA instructions (``SM100_GEMM_WANTED``), the outputs of all but the ``_acc`` weight
    gradients go out by TMA store; the MMA is ``UTCQMMA`` in its block-scaled form (TMEM scale operands) with
    ``UTCCP`` scale copies in an MXFP8 entry's forward GEMMs and dgrads (``mx``), ``UTCHMMA`` (kind::f16)
    elsewhere; no kernel has Hopper's HGMMA, and the other kernels no tcgen05 MMA or TMEM load."""
    assert set(texts) >= set(GEMMS), sorted(set(GEMMS) - set(texts))
    for k, text in texts.items():
        ops = build.sass_opcodes(text)
        assert not [o for o in HOPPER_MMA if o in ops], (k, "Hopper wgmma in an sm_100a kernel")
        if k not in GEMMS:
            assert not [o for o in ("UTCHMMA", "UTCQMMA", "LDTM") if o in ops], k
            continue
        missing = [o for o in SM100_GEMM_WANTED if not ops.get(o)]
        assert not missing, (k, missing)
        assert bool(ops.get("UTMASTG")) == (not k.endswith("_acc")), (k, "TMA stores")
        if mx and k in MX_GEMMS:
            assert ops.get("UTCQMMA") and ops.get("UTCCP") and "UTCHMMA" not in ops, (k, ops)
            mma = [line for line in text.splitlines() if re.search(r"\bUTCQMMA\b", line)]
            bad = [line.strip() for line in mma if not _BLOCK_SCALED_RE.search(line)]
            assert not bad, (k, "UTCQMMA without TMEM scale operands", bad[:2])
        else:
            assert ops.get("UTCHMMA") and "UTCQMMA" not in ops and "UTCCP" not in ops, (k, ops)


def check_sm90_sass(texts: dict[str, str]) -> None:
    """``texts`` of an sm_90a entry: every GEMM issues HGMMA (wgmma) and TMA loads (``UTMALDG``, as on sm_100a)
    with mbarriers; no kernel has a tcgen05 / TMEM / CLC instruction."""
    assert set(texts) >= set(GEMMS), sorted(set(GEMMS) - set(texts))
    for k, text in texts.items():
        ops = build.sass_opcodes(text)
        assert not [o for o in SM100_ONLY if o in ops], (k, [o for o in SM100_ONLY if o in ops])
        if k in GEMMS:
            assert ops.get("HGMMA") and ops.get("UTMALDG") and ops.get("SYNCS"), (k, ops)


# ---- the checkers on short texts (nvdisasm's lines as observed): each fails without what it wants -------------
def _line(i: int, insn: str) -> str:
    return f"        /*{i * 16:04x}*/                   {insn} ;"


_SM100_COMMON = ["UTCATOMSWS.FIND_AND_SET.ALIGN UP0, UR5, UR5", "@!P0 SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R0+URZ+0x30], R5",
                 "UTMALDG.3D [UR48], [UR20], desc[URZ]", "UTCBAR [UR5], URZ", "LDTM.x32 R4, tmem[UR4]",
                 "UGETNEXTWORKID.SELFCAST [UR8], [UR9]", "UTCATOMSWS.AND URZ, UR8"]
_STORE = "UTMASTG.2D [UR16], [UR10], desc[URZ]"
_HMMA = "UTCHMMA gdesc[UR18], gdesc[UR16], tmem[UR6], tmem[UR56], idesc[UR57], UR8, UP1"
_QMMA = "UTCQMMA gdesc[UR58], gdesc[UR60], tmem[UR16], tmem[UR30], idesc[UR31], tmem[UR10], UPT"
_CP = "UTCCP.T.S.4x32dp128bit tmem[UR25+0x110], gdesc[UR62]"


def _text(insns) -> str:
    head = "\t.target\tsm_100a\n.text.k:\n"
    return head + "\n".join(_line(i, s) for i, s in enumerate(insns)) + "\n"


def _sm100_texts(mx: bool) -> dict[str, list[str]]:
    out = {}
    for k in GEMMS:
        body = _SM100_COMMON + ([] if k.endswith("_acc") else [_STORE])
        out[k] = body + ([_CP, _QMMA] if mx and k in MX_GEMMS else [_HMMA])
    out["routing"] = ["LDG.E R2, desc[UR4][R2.64]", "STG.E desc[UR4][R4.64], R2", "EXIT"]
    return out


def test_sass_opcodes_reads_nvdisasm_lines():
    text = _text(["@!P0 NANOSLEEP.SYNCS 0x989680", "@P0 SYNCS.ARRIVE.TRANS64 RZ, [UR13], R0", _QMMA, _QMMA,
                  "@!UP0 BRA `(.L_x_3)", "HGMMA.64x8x16.F32.BF16 R24, gdesc[UR4], R24, gsb0"])
    text += ".L_x_3:\n        .size k,(.L_x_7 - k)\n"
    assert build.sass_opcodes(text) == {"NANOSLEEP": 1, "SYNCS": 1, "UTCQMMA": 2, "BRA": 1, "HGMMA": 1}


@pytest.mark.parametrize("mx", [False, True])
def test_sm100_check_fails_without_each_instruction(mx):
    """The sm_100a check passes on texts that hold what it wants and fails on each mutation: a wanted instruction
    dropped from one GEMM, a TMA store dropped, the MMA of the other kind, UTCQMMA without its TMEM scale operand,
    a Hopper HGMMA added, a tcgen05 MMA in a non-GEMM kernel; and the sm_90a check fails on them."""
    base = _sm100_texts(mx)
    check_sm100_sass({k: _text(v) for k, v in base.items()}, mx=mx)
    mutations = []
    for k in ("gemm1", "wgrad2_acc"):
        for op in {re.match(r"(?:@\S+\s+)?([A-Z0-9_]+)", i).group(1) for i in base[k]}:   # each mnemonic dropped
            mutations.append({**base, k: [i for i in base[k] if not re.match(rf"(?:@\S+\s+)?{op}\b", i)]})
    other = {_HMMA: _QMMA, _QMMA: _HMMA}
    mutations.append({**base, "dgrad1": [other.get(i, i) for i in base["dgrad1"]]})   # the other MMA kind
    mutations.append({**base, "gemm2": base["gemm2"] + ["HGMMA.64x8x16.F32.BF16 R24, gdesc[UR4], R24, gsb0"]})
    mutations.append({**base, "routing": base["routing"] + [_HMMA]})
    mutations.append({**base, "wgrad1_acc": base["wgrad1_acc"] + [_STORE]})
    if mx:
        mutations.append({**base, "gemm2": [i.replace("tmem[UR10]", "UR8") for i in base["gemm2"]]})
    for m in mutations:
        with pytest.raises(AssertionError):
            check_sm100_sass({k: _text(v) for k, v in m.items()}, mx=mx)
    with pytest.raises(AssertionError):
        check_sm90_sass({k: _text(v) for k, v in base.items()})


def test_sm90_check_fails_on_tcgen05():
    hop = {k: _text(["UTMALDG.2D [UR8], [UR4]", "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3", "WARPGROUP.ARRIVE",
                     "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24, gsb0"]) for k in GEMMS}
    check_sm90_sass(hop)
    for k in ("gemm1", "wgrad2_acc"):
        with pytest.raises(AssertionError):
            check_sm90_sass({**hop, k: hop[k].replace("HGMMA", "HFMA2")})
    with pytest.raises(AssertionError):
        check_sm90_sass({**hop, "combine": _text(["LDTM.x32 R4, tmem[UR4]"])})
    with pytest.raises(AssertionError):
        check_sm100_sass(hop)


# ---- the tools -------------------------------------------------------------------------------------------------
def test_find_nvdisasm(monkeypatch, tmp_path):
    """``$MOKGEN_NVDISASM`` first (None when it is not an executable), else PATH, else the wheel's binary under
    the ``nvidia`` namespace package (nvidia/cu13/bin/nvdisasm)."""
    monkeypatch.setenv("MOKGEN_NVDISASM", str(tmp_path / "missing"))
    assert build.find_nvdisasm() is None
    assert build.sass_of_ptx(".version 8.0\n", "sm_90a") is None
    assert build.sass_report(tmp_path) is None and build.sass_texts(tmp_path) is None
    monkeypatch.delenv("MOKGEN_NVDISASM")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    fake = tmp_path / "site" / "nvidia" / "cu13" / "bin" / "nvdisasm"
    fake.parent.mkdir(parents=True)
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    import types

    monkeypatch.setitem(sys.modules, "nvidia", types.SimpleNamespace(__path__=[str(tmp_path / "site" / "nvidia")]))
    assert build.find_nvdisasm() == str(fake)
    fake.chmod(0o644)   # not executable: not taken
    assert build.find_nvdisasm() is None
    onpath = tmp_path / "bin" / "nvdisasm"
    onpath.parent.mkdir()
    onpath.write_text("#!/bin/sh\n")
    onpath.chmod(0o755)
    monkeypatch.setenv("PATH", str(onpath.parent))
    assert build.find_nvdisasm() == str(onpath)


@needs_sass
def test_hopper_wgmma_disassembles_to_hgmma():
    """A hand-written sm_90a wgmma loop (tests/test_ptxas.py's) assembled and disassembled: HGMMA behind
    WARPGROUP.ARRIVE, no tcgen05 mnemonic; ptxas's refusal is a BuildError."""
    from test_ptxas import _PTX

    sass = build.sass_of_ptx(_PTX.replace("SKIP_BRANCH", ""), "sm_90a")
    ops = build.sass_opcodes(sass)
    assert ops.get("HGMMA", 0) >= 1 and ops.get("WARPGROUP") and not [o for o in SM100_ONLY if o in ops], ops
    assert re.search(r"\bHGMMA\.64x8x16\.F32\.BF16\b", sass)
    with pytest.raises(build.BuildError, match="ptxas rejected"):
        build.sass_of_ptx(_PTX.replace("SKIP_BRANCH", "  not.an.instruction;"), "sm_90a")


@pytest.mark.slow
@needs_sass
def test_sm90a_preset_sass(tmp_path):
    """The contrast: qwen3-30b-a3b's sm_90a training entry (the kernels tests/test_emit.py builds: CI's object
    cache shares them) disassembled: HGMMA and TMA in every GEMM, no tcgen05 / TMEM / CLC instruction anywhere; the
    sm_100a check refuses it."""
    pytest.importorskip("cutlass")
    from mokgen.emit import emit
    from mokgen.plan import solve
    from mokgen.spec import load_spec

    art = build.build(emit(solve(load_spec("qwen3-30b-a3b"), "sm_90a")), "sm_90a", tmp_path, progress=False)
    texts = build.sass_texts(art)
    assert sorted(texts) == sorted(art.kernels) and all(Path(art.dir, f"{k}.ptx").exists() for k in texts)
    check_sm90_sass(texts)
    with pytest.raises(AssertionError):
        check_sm100_sass(texts)

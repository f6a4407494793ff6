"""The GPU suites' arch / SM-count helpers of tests/conftest.py, on the CPU: the (half, full) CTA counts of the
num_ctas determinism checks, the ep_kernels skip (decided by emitting an EP spec for the arch) and the mxfp8 skip,
and the collection hook applying them to items of a (pretended) visible GPU."""
from __future__ import annotations

import pytest

import conftest
from conftest import CtaCounts, arch_skip_reason, cta_counts, ep_kernels_missing


def test_cta_counts_half_and_full():
    assert cta_counts(132) == CtaCounts(66, 132)     # H200
    assert cta_counts(148) == CtaCounts(74, 148)     # B200
    assert cta_counts(1) == (1, 1) and cta_counts(3) == (1, 3)
    for bad in (0, -4, True, 1.5, "132"):
        with pytest.raises(ValueError):
            cta_counts(bad)


def test_ep_kernels_decided_from_the_emitted_entry():
    assert ep_kernels_missing("sm_90a") is None
    why = ep_kernels_missing("sm_100a")
    assert why is not None and "sm_100a" in why and "ep_routing" in why


def test_arch_skip_reasons():
    assert arch_skip_reason("mxfp8", "sm_100a") is None
    assert "sm_100a only" in arch_skip_reason("mxfp8", "sm_90a")
    assert arch_skip_reason("mxfp8", None) is not None          # a GPU mokgen has no arch for
    assert arch_skip_reason("ep_kernels", "sm_90a") is None
    assert "ep_routing" in arch_skip_reason("ep_kernels", "sm_100a")
    assert arch_skip_reason("ep_kernels", None) is None
    assert arch_skip_reason("training", "sm_100a") is None      # only the two new markers are decided here


class _Item:
    def __init__(self, *markers: str):
        self.keywords = {m: True for m in markers}
        self.skips: list[str] = []

    def get_closest_marker(self, name):
        return True if name in self.keywords else None

    def add_marker(self, mark):
        self.skips.append(mark.kwargs["reason"])


class _Config:
    def getoption(self, name):
        return False


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_collection_hook_skips_by_visible_arch(monkeypatch, arch):
    monkeypatch.setattr(conftest, "_cuda_available", lambda: True)
    monkeypatch.setattr(conftest, "_visible_arch", lambda: arch)
    monkeypatch.delenv("MOKGEN_SKIP_SLOW", raising=False)
    mx, ep, plain, fp8 = _Item("gpu", "mxfp8"), _Item("gpu", "ep_kernels"), _Item("gpu"), _Item("gpu", "fp8")
    conftest.pytest_collection_modifyitems(_Config(), [mx, ep, plain, fp8])
    assert plain.skips == []
    if arch == "sm_90a":
        assert mx.skips and not ep.skips and not fp8.skips
    else:
        assert not mx.skips and ep.skips and fp8.skips
        assert "ep_dispatch" in ep.skips[0]


def test_collection_hook_without_a_gpu(monkeypatch):
    monkeypatch.setattr(conftest, "_cuda_available", lambda: False)
    monkeypatch.delenv("MOKGEN_SKIP_SLOW", raising=False)
    mx, ep = _Item("gpu", "mxfp8"), _Item("gpu", "ep_kernels")
    conftest.pytest_collection_modifyitems(_Config(), [mx, ep])
    assert mx.skips == ep.skips == ["needs a CUDA GPU (torch.cuda.is_available() is False)"]

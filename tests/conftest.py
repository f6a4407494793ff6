"""Shared pytest setup for mokgen.

- ``@pytest.mark.gpu`` tests are skipped when ``torch.cuda.is_available()`` is False (or torch is missing).
- ``@pytest.mark.slow`` tests (they compile kernels) run by default; ``--skip-slow`` or ``MOKGEN_SKIP_SLOW=1``
  skips them.
- ``mokgen_cache``: a fixture pointing ``$MOKGEN_CACHE_DIR`` at a fresh directory for one test.
- ``ctas``: the (half, full) persistent-CTA counts of the visible GPU for the ``num_ctas`` determinism checks
  (66 / 132 on an H200, 74 / 148 on a B200): :func:`cta_counts`.
- markers ``mxfp8`` (needs an sm_100a GPU) and ``ep_kernels`` (needs an arch for which mokgen emits the ep_*
  kernels: :func:`ep_kernels_missing`), next to ``training`` / ``fp8``.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `import mokgen` from a plain checkout, installed or not
    sys.path.insert(0, str(REPO))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--skip-slow", action="store_true", default=False,
                     help="skip tests marked slow (kernel compiles)")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "slow: compiles kernels (minutes on 2 cores); run by default")
    config.addinivalue_line("markers", "training: needs the visible GPU's arch to have backward kernels "
                            "(mokgen.arch: Arch.training); skipped on an arch that has the forward only")
    config.addinivalue_line("markers", "fp8: needs the visible GPU's arch to plan dtype fp8 (sm_90a)")
    config.addinivalue_line("markers", "mxfp8: needs the visible GPU's arch to plan dtype mxfp8 (sm_100a)")
    config.addinivalue_line("markers", "ep_kernels: needs the visible GPU's arch to have the expert-parallel "
                            "kernels (ep_routing, ep_dispatch, ep_push) emitted for it")


def _cuda_available() -> bool:
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def _visible_arch() -> str | None:
    """The mokgen arch of the visible GPU (None: no GPU, or one mokgen has no arch for)."""
    try:
        import torch

        from mokgen.arch import arch_by_capability

        return arch_by_capability(tuple(torch.cuda.get_device_capability()))
    except Exception:
        return None


class CtaCounts(NamedTuple):
    half: int
    full: int


def cta_counts(sm_count: int) -> CtaCounts:
    """The two persistent-CTA counts the ``num_ctas`` determinism checks compare: half the SMs and all of them
    (the runtime's default). 66 / 132 on an H200, 74 / 148 on a B200."""
    if isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1:
        raise ValueError(f"sm_count must be a positive int, got {sm_count!r}")
    return CtaCounts(max(1, sm_count // 2), sm_count)


@pytest.fixture(scope="session")
def ctas() -> CtaCounts:
    """:func:`cta_counts` of the visible GPU (device 0), from torch's multi_processor_count."""
    import torch

    return cta_counts(torch.cuda.get_device_properties(0).multi_processor_count)


@functools.lru_cache(maxsize=None)
def ep_kernels_missing(arch: str) -> str | None:
    """None when mokgen emits the expert-parallel kernels (``mokgen.kernels.EP_KERNELS``) for ``arch``, else why
    not (a skip reason). Decided by planning and emitting a small ep=2 spec for the arch (templates only, no
    compiler: about a second), not from a GPU name."""
    from mokgen.emit import emit
    from mokgen.kernels import EP_KERNELS
    from mokgen.plan import solve
    from mokgen.spec import load_spec

    spec = load_spec({"name": "ep-probe", "hidden": 256, "ffn": 128, "experts": 4, "topk": 2, "ep": 2,
                      "tokens": 64, "shared_experts": 1, "archs": [arch]})
    try:
        files = emit(solve(spec, arch)).files
    except Exception as e:  # noqa: BLE001 - any refusal means: no EP entry for this arch
        return f"an ep=2 spec does not plan / emit for {arch} ({type(e).__name__}: {e})"
    missing = [k for k in EP_KERNELS if f"{k}.py" not in files]
    if missing:
        return f"mokgen emits no {', '.join(missing)} kernel(s) for {arch}: its entries have no expert parallelism"
    return None


def arch_skip_reason(marker: str, arch: str | None) -> str | None:
    """Why a gpu test carrying ``marker`` (mxfp8 / ep_kernels) cannot run on a visible GPU of mokgen arch ``arch``
    (None: a GPU mokgen has no arch for); None when it can."""
    if marker == "mxfp8" and arch != "sm_100a":
        return f"dtype mxfp8 is planned for sm_100a only, the visible GPU is {arch or 'not a mokgen arch'}"
    if marker == "ep_kernels" and arch is not None:
        return ep_kernels_missing(arch)
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = config.getoption("--skip-slow") or os.environ.get("MOKGEN_SKIP_SLOW", "") not in ("", "0")
    gpu_items = [it for it in items if "gpu" in it.keywords]
    no_gpu = bool(gpu_items) and not _cuda_available()
    arch = None if no_gpu or not gpu_items else _visible_arch()
    for it in items:
        if no_gpu and "gpu" in it.keywords:
            it.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))
        elif arch is not None and "gpu" in it.keywords:
            from mokgen.arch import ARCHS

            if "training" in it.keywords and not ARCHS[arch].training:
                it.add_marker(pytest.mark.skip(reason=f"the visible GPU's arch {arch} has no backward kernels yet"))
            if "fp8" in it.keywords and arch != "sm_90a":
                it.add_marker(pytest.mark.skip(reason=f"dtype fp8 is planned for sm_90a only, the GPU is {arch}"))
        if not no_gpu and "gpu" in it.keywords:
            for marker in ("mxfp8", "ep_kernels"):
                why = arch_skip_reason(marker, arch) if it.get_closest_marker(marker) else None
                if why is not None:
                    it.add_marker(pytest.mark.skip(reason=why))
        if skip_slow and "slow" in it.keywords:
            it.add_marker(pytest.mark.skip(reason="slow tests skipped (--skip-slow / MOKGEN_SKIP_SLOW)"))


@pytest.fixture
def mokgen_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty mokgen cache directory for this test (``$MOKGEN_CACHE_DIR``)."""
    root = tmp_path / "mokgen-cache"
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(root))
    return root

"""Shared pytest setup for mokgen.

- ``@pytest.mark.gpu`` tests are skipped when ``torch.cuda.is_available()`` is False (or torch is missing).
- ``@pytest.mark.slow`` tests (they compile kernels) run by default; ``--skip-slow`` or ``MOKGEN_SKIP_SLOW=1``
  skips them.
- ``mokgen_cache``: a fixture pointing ``$MOKGEN_CACHE_DIR`` at a fresh directory for one test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
        if skip_slow and "slow" in it.keywords:
            it.add_marker(pytest.mark.skip(reason="slow tests skipped (--skip-slow / MOKGEN_SKIP_SLOW)"))


@pytest.fixture
def mokgen_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty mokgen cache directory for this test (``$MOKGEN_CACHE_DIR``)."""
    root = tmp_path / "mokgen-cache"
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(root))
    return root

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


def _cuda_available() -> bool:
    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torch
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_slow = config.getoption("--skip-slow") or os.environ.get("MOKGEN_SKIP_SLOW", "") not in ("", "0")
    gpu_items = [it for it in items if "gpu" in it.keywords]
    no_gpu = bool(gpu_items) and not _cuda_available()
    for it in items:
        if no_gpu and "gpu" in it.keywords:
            it.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)"))
        if skip_slow and "slow" in it.keywords:
            it.add_marker(pytest.mark.skip(reason="slow tests skipped (--skip-slow / MOKGEN_SKIP_SLOW)"))


@pytest.fixture
def mokgen_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh, empty mokgen cache directory for this test (``$MOKGEN_CACHE_DIR``)."""
    root = tmp_path / "mokgen-cache"
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(root))
    return root

"""mokgen: compiles MoE layer specs into CuTe DSL kernels and exposes them to torch.

``import mokgen`` stays light: torch, the spec module and the runtime are imported on first use.

    >>> import mokgen
    >>> moe = mokgen.compile("qwen3-30b-a3b")          # spec -> plan -> emit -> cache/build -> CompiledMoE
    >>> y = moe(x, topk_idx, topk_weight, w1, w2)      # y [T, H] bf16 on the current stream
    >>> layer = mokgen.MoE("qwen3-30b-a3b", device="cuda")   # nn.Module owning w1 / w2
"""

from __future__ import annotations

import importlib
from typing import Any

try:
    from importlib.metadata import PackageNotFoundError, version as _version

    try:
        __version__ = _version("mokgen")
    except PackageNotFoundError:
        __version__ = "0.1.0"
except ImportError:  # pragma: no cover
    __version__ = "0.1.0"

# name -> (module, attribute or None for the module itself)
_LAZY = {
    "load_spec": ("mokgen.spec", "load_spec"),
    "Spec": ("mokgen.spec", "Spec"),
    "SpecError": ("mokgen.spec", "SpecError"),
    "list_presets": ("mokgen.spec", "list_presets"),
    "MoE": ("mokgen.module", "MoE"),
    "CompiledMoE": ("mokgen.ops", "CompiledMoE"),
    "RoutingError": ("mokgen.ops", "RoutingError"),
    "MoEInputError": ("mokgen.ops", "MoEInputError"),
    "KernelTimeoutError": ("mokgen.ops", "KernelTimeoutError"),
    "ArchMismatchError": ("mokgen.ops", "ArchMismatchError"),
    "moe_forward": ("mokgen.ops", "moe_forward"),
    "load_entry": ("mokgen.driver", "load_entry"),
    "driver": ("mokgen.driver", None),
    "reference": ("mokgen.reference", None),
    "ops": ("mokgen.ops", None),
}

__all__ = ["__version__", "compile", *_LAZY]


def compile(spec: Any, arch: str | None = None, force: bool = False, overrides: Any = None):
    """Compile (or load from the cache) the kernels of ``spec`` for ``arch`` and return a
    :class:`mokgen.ops.CompiledMoE`. See :func:`mokgen.driver.compile`."""
    from .driver import compile as _compile

    return _compile(spec, arch=arch, force=force, overrides=overrides)


def __getattr__(name: str) -> Any:
    try:
        mod_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'mokgen' has no attribute {name!r}") from None
    mod = importlib.import_module(mod_name)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

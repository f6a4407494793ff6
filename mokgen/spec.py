"""The spec stage: a YAML file, a preset name or a mapping -> a validated, frozen `Spec`.

A spec describes one rank's share of an MoE layer (see docs/contract.md). Every field is checked when a
`Spec` is built; a bad value raises `SpecError` with a one-line message that starts with the field path,
e.g. ``spec.hidden: must be a positive multiple of 64, got 100``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .arch import ARCH_NAMES, ARCHS

__all__ = ["Spec", "SpecError", "load_spec", "list_presets", "KNOWN_ARCHS", "K_BLOCK", "MAX_TOKENS"]

KNOWN_ARCHS = ARCH_NAMES  # mokgen.arch is the one arch table
DTYPES = ("bf16", "fp8", "mxfp8")
# fp8: the blockwise e4m3 recipe (1x128 activation tiles, 128x128 weight blocks, fp32 scales; mokgen/fp8.py) on
# Hopper; mxfp8 (e4m3 with one e8m0 scale per 32 elements along K) is Blackwell's block-scaled MMA format
# (tcgen05.mma kind::mxf8f6f4.block_scale), sm_100a only: its specs name archs: [sm_100a]
RESERVED_DTYPES: tuple[str, ...] = ()
MXFP8_ARCHS = tuple(a.name for a in ARCHS.values() if a.has_tcgen05)   # the block-scaled tcgen05 MMA
# dtype mxfp8 keeps bf16's rule too (hidden, ffn multiples of 64, so of the 32-element scale blocks): the
# block-scaled GEMMs' K tile is 128 (one 512-byte scale-factor atom: 4 scales of 32 along K for 128 rows,
# mokgen.fp8.pack_mx_scales) and their weights' scale atoms cover 128 rows of N; where hidden or ffn is not a
# multiple of 128 (gpt-oss-120b's 2880 = 22.5 x 128) the last K tile and the last N tile are partial: the e4m3 data
# past the end is read as zeros (TMA out of bounds), the scale tensors are padded to whole atoms whose extra codes
# the quantizers write as 127 (scale 1), and the output's columns past N are not stored (mokgen/sm100/plan.py)
# dtype fp8 keeps bf16's rule (hidden, ffn multiples of 64): where they are not multiples of the 128-wide
# quantization blocks (gpt-oss-120b's 2880) the last block along K / N is partial, as if zero-padded (mokgen/fp8.py)
FP8_ARCHS = ("sm_90a",)
ACTIVATIONS = ("swiglu", "swiglu_oai")
GATE_UP_LAYOUTS = ("concat", "interleaved")
OAI_SWIGLU_LIMIT = 7.0
K_BLOCK = 64  # the kernels' K tile: hidden and ffn must be multiples of it
MAX_TOKENS = 1 << 20
MAX_SHARED_EXPERTS = 4
# Upper bounds, each from what the kernels or the device support (the error message says which):
# the combine (and gather) kernels give each of their 128 threads hidden/1024 16-byte vectors, unrolled at
# compile time, and combine keeps hidden/128 fp32 sums per thread in registers: 16384 -> 128 of a thread's 255
# registers. Above that they spill and their compile time grows without bound (hidden 67108864 never finished).
MAX_HIDDEN = 16384
# combine and the fused kernel unroll a token's K + S slots at compile time.
MAX_TOPK = 64
# topk_idx holds int32 expert ids.
MAX_EXPERTS = (1 << 31) - 1
MAX_NAME = 64  # the name is written into file headers, cache metadata and tables
# bf16's largest finite value: a larger clamp never clamps
MAX_SWIGLU_LIMIT = 3.3895313892515355e38
# The routing kernel keeps per-CTA int32 counters in shared memory: count[G], start[G+1], before[E],
# wcount[32 warps * E], bad[1] = 35 E + 2 S + 2 words (templates/sm90/routing.py.j2), plus alignment slack.
_ROUTING_SMEM_WORDS_PER_EXPERT = 35
_ROUTING_SMEM_SLACK_WORDS = 64
_WORKSPACE_BM = 128  # the routing tile the device-memory estimate pads groups to
REQUIRED = ("hidden", "ffn", "experts", "topk", "tokens")
DEFAULT_NAME = "custom"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_PRESETS_DIR = Path(__file__).with_name("presets")


class SpecError(ValueError):
    """A spec that cannot be used; the message is one line starting with the field path."""


@dataclass(frozen=True, kw_only=True)
class Spec:
    name: str
    hidden: int
    ffn: int
    experts: int
    topk: int
    ep: int = 1
    tokens: int
    dtype: str = "bf16"
    shared_experts: int = 0
    activation: str = "swiglu"
    swiglu_limit: float | None = None
    gate_up_layout: str = "concat"
    bias: bool = False
    archs: tuple[str, ...] = ("sm_90a",)

    def __post_init__(self) -> None:
        _check(self)

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    @property
    def groups(self) -> int:
        return self.local_experts + self.shared_experts

    @property
    def routed_rows(self) -> int:
        return self.tokens * self.topk

    @property
    def rows(self) -> int:
        return self.tokens * (self.topk + self.shared_experts)

    @property
    def flops_forward(self) -> int:
        return 2 * self.rows * 3 * self.hidden * self.ffn

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["archs"] = list(self.archs)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Spec:
        return _from_mapping(data, DEFAULT_NAME)

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))


FIELDS = tuple(f.name for f in dataclasses.fields(Spec))


def load_spec(src: str | os.PathLike | Mapping[str, Any]) -> Spec:
    """A `Spec` from a preset name (``"kimi-k2"``), a path to a .yaml/.yml file, or a mapping."""
    if isinstance(src, Mapping):
        return _from_mapping(src, DEFAULT_NAME)
    return _load_file(spec_file(src))


def spec_file(src: str | os.PathLike) -> Path:
    """The YAML file :func:`load_spec` reads for ``src`` (a preset name or a path; not read here). The warm-start
    index (``mokgen.index``) keys a spec given by name or path by this file's path and bytes."""
    if isinstance(src, os.PathLike) or (isinstance(src, str) and _looks_like_path(src)):
        return Path(src)
    if isinstance(src, str):
        path = _PRESETS_DIR / f"{src}.yaml"
        if not path.is_file():
            names = _preset_names()
            close = difflib.get_close_matches(src, names, n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise SpecError(
                f"spec: unknown preset '{src}'; {hint}presets: {', '.join(names)} (or pass a path to a .yaml file)"
            )
        return path
    raise SpecError(f"spec: expected a preset name, a .yaml path or a mapping, got {type(src).__name__}")


def list_presets() -> list[Spec]:
    """Every preset shipped in mokgen/presets, sorted by name."""
    return [_load_file(_PRESETS_DIR / f"{name}.yaml") for name in _preset_names()]


def _preset_names() -> list[str]:
    return sorted(p.stem for p in _PRESETS_DIR.glob("*.yaml"))


def _looks_like_path(s: str) -> bool:
    return s.endswith((".yaml", ".yml")) or os.sep in s or "/" in s


@functools.lru_cache(maxsize=None)
def _unique_key_loader() -> type:
    """yaml.SafeLoader that refuses a mapping with the same key twice (YAML says keys are unique; PyYAML
    would silently keep the last one). yaml is imported here, when a file is read: ``Spec.from_dict`` (a
    spec from a cache entry's meta.json) needs none of it."""
    import yaml

    class _UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen: dict[Any, int] = {}
            for key_node, _value in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    continue  # reported by the base class
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first at line {seen[key] + 1})", key_node.start_mark)
                seen[key] = key_node.start_mark.line
            return super().construct_mapping(node, deep=deep)

    return _UniqueKeyLoader


def _load_file(path: Path) -> Spec:
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise SpecError(f"spec: {path} is a directory; expected a .yaml file") from None
    except OSError as e:
        raise SpecError(f"spec: cannot read {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(f"spec: {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                        "save it as UTF-8") from None
    import yaml

    try:
        data = yaml.load(text, Loader=_unique_key_loader())
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise SpecError(f"spec: invalid YAML in {path}{at}: {getattr(e, 'problem', None) or e}") from None
    if data is None:
        raise SpecError(f"spec: {path} is empty; expected a mapping of field names to values")
    return _from_mapping(data, path.stem)


def _from_mapping(data: Any, default_name: str) -> Spec:
    if not isinstance(data, Mapping):
        raise SpecError(f"spec: must be a mapping of field names to values, got {_describe(data)}")
    for key in data:
        if key not in FIELDS:
            close = difflib.get_close_matches(str(key), FIELDS, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(FIELDS)}"
            raise SpecError(f"spec.{key}: unknown key; {hint}")
    for key in REQUIRED:
        if key not in data:
            raise SpecError(f"spec.{key}: required key is missing")
    fields = dict(data)
    fields.setdefault("name", default_name)
    if "bias" not in fields:
        fields["bias"] = fields.get("activation") == "swiglu_oai"
    return Spec(**fields)


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return f"str {value!r}"
    if isinstance(value, (list, tuple, dict)):
        return type(value).__name__
    return f"{type(value).__name__} {value!r}"


def _fail(field: str, message: str) -> SpecError:
    return SpecError(f"spec.{field}: {message}")


def _int(spec: Spec, field: str) -> int:
    value = getattr(spec, field)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(field, f"must be an integer, got {_describe(value)}")
    return value


def _choice(spec: Spec, field: str, allowed: tuple[str, ...]) -> str:
    value = getattr(spec, field)
    if value not in allowed:
        close = difflib.get_close_matches(str(value), allowed, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close and isinstance(value, str) else ""
        raise _fail(field, f"must be one of {', '.join(allowed)}, got {_describe(value)}{hint}")
    return value


def _check(spec: Spec) -> None:
    """Validate every field of `spec` and normalize archs / swiglu_limit in place (frozen: via object.__setattr__)."""
    if not isinstance(spec.name, str) or not _NAME_RE.fullmatch(spec.name):
        raise _fail("name", f"must be a non-empty string of letters, digits, '.', '_', '-', got {_describe(spec.name)}")
    if len(spec.name) > MAX_NAME:
        raise _fail("name", f"must be at most {MAX_NAME} characters (it goes into file headers and cache "
                            f"metadata), got {len(spec.name)}")

    for field in ("hidden", "ffn"):
        value = _int(spec, field)
        if value <= 0 or value % K_BLOCK:
            raise _fail(field, f"must be a positive multiple of {K_BLOCK}, got {value}")
    if spec.hidden > MAX_HIDDEN:
        raise _fail("hidden", f"must be at most {MAX_HIDDEN}, got {spec.hidden}: the combine and gather kernels "
                              f"unroll hidden/1024 16-byte loads per thread and combine keeps hidden/128 fp32 sums "
                              f"per thread in registers ({MAX_HIDDEN // 128} at {MAX_HIDDEN}, of 255)")
    if _int(spec, "experts") < 1:
        raise _fail("experts", f"must be >= 1, got {spec.experts}")
    if spec.experts > MAX_EXPERTS:
        raise _fail("experts", f"must be at most {MAX_EXPERTS} (topk_idx holds int32 expert ids), got {spec.experts}")
    if _int(spec, "ep") < 1:
        raise _fail("ep", f"must be >= 1, got {spec.ep}")
    if spec.experts % spec.ep:
        raise _fail("ep", f"must divide experts ({spec.experts}), got {spec.ep}")
    topk = _int(spec, "topk")
    if not 1 <= topk <= spec.experts:
        raise _fail("topk", f"must be in [1, experts={spec.experts}], got {topk}")
    if topk > MAX_TOPK:
        raise _fail("topk", f"must be at most {MAX_TOPK} (combine and the fused kernel unroll a token's slots at "
                            f"compile time), got {topk}")
    tokens = _int(spec, "tokens")
    if not 1 <= tokens <= MAX_TOKENS:
        raise _fail("tokens", f"must be in [1, {MAX_TOKENS}], got {tokens}")
    shared = _int(spec, "shared_experts")
    if not 0 <= shared <= MAX_SHARED_EXPERTS:
        raise _fail("shared_experts", f"must be in [0, {MAX_SHARED_EXPERTS}], got {shared}")

    _choice(spec, "dtype", DTYPES)
    activation = _choice(spec, "activation", ACTIVATIONS)
    _choice(spec, "gate_up_layout", GATE_UP_LAYOUTS)
    if not isinstance(spec.bias, bool):
        raise _fail("bias", f"must be true or false, got {_describe(spec.bias)}")

    limit = spec.swiglu_limit
    if limit is not None:
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise _fail("swiglu_limit", f"must be a number > 0 or null, got {_describe(limit)}")
        if not (math.isfinite(limit) and limit > 0):
            raise _fail("swiglu_limit", f"must be a finite number > 0, got {limit}")
        if limit > MAX_SWIGLU_LIMIT:
            raise _fail("swiglu_limit", f"must be at most {MAX_SWIGLU_LIMIT:.6g} (bf16's largest value: a larger "
                                        f"clamp never clamps), got {limit:g}")
        limit = float(limit)
    if activation == "swiglu_oai":
        if limit is not None and limit != OAI_SWIGLU_LIMIT:
            raise _fail("swiglu_limit", f"swiglu_oai clamps at {OAI_SWIGLU_LIMIT:g}; omit it or set 7, got {limit:g}")
        limit = OAI_SWIGLU_LIMIT
    object.__setattr__(spec, "swiglu_limit", limit)

    archs = spec.archs
    if isinstance(archs, str) or not isinstance(archs, (list, tuple)):
        raise _fail("archs", f"must be a list of archs from {', '.join(KNOWN_ARCHS)}, got {_describe(archs)}")
    if not archs:
        raise _fail("archs", f"must name at least one arch from {', '.join(KNOWN_ARCHS)}")
    for i, arch in enumerate(archs):
        if arch not in KNOWN_ARCHS:
            close = difflib.get_close_matches(str(arch), KNOWN_ARCHS, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close and isinstance(arch, str) else ""
            raise _fail(f"archs[{i}]", f"unknown arch {arch!r}; allowed: {', '.join(KNOWN_ARCHS)}{hint}")
        if arch in archs[:i]:
            raise _fail(f"archs[{i}]", f"duplicate arch '{arch}'")
    object.__setattr__(spec, "archs", tuple(archs))
    if spec.dtype == "fp8":
        for i, arch in enumerate(archs):
            if arch not in FP8_ARCHS:
                raise _fail(f"archs[{i}]", f"dtype fp8 (blockwise e4m3, fp32 block scales) targets "
                                           f"{', '.join(FP8_ARCHS)} (Hopper), got {arch!r}")
    if spec.dtype == "mxfp8":
        for i, arch in enumerate(archs):
            if arch not in MXFP8_ARCHS:
                raise _fail(f"archs[{i}]", f"dtype mxfp8 (e4m3 with e8m0 scales per 32 elements, Blackwell's "
                                           f"block-scaled MMA) targets {', '.join(MXFP8_ARCHS)}, got {arch!r} (set "
                                           f"archs: [sm_100a]; Hopper's FP8 is dtype fp8)")
    _check_device_bounds(spec)


def device_bytes(spec: Spec) -> tuple[int, int]:
    """(expert weights, forward workspace + x + y at ``spec.tokens``) in bytes, groups padded to 128 rows."""
    H, I, G = spec.hidden, spec.ffn, spec.groups
    weights = G * 3 * H * I * 2 + (G * (2 * I + H) * 4 if spec.bias else 0)
    rows = spec.tokens * (spec.topk + spec.shared_experts) + G * (_WORKSPACE_BM - 1)
    rows = (rows + _WORKSPACE_BM - 1) // _WORKSPACE_BM * _WORKSPACE_BM
    work = rows * (2 * H + 2 * I + 8) + spec.tokens * (4 * H + 4 * (spec.topk + spec.shared_experts))
    return weights, work


def _check_device_bounds(spec: Spec) -> None:
    """Bounds that depend on the target GPUs: the routing kernel's shared memory bounds the local experts, and
    one rank's weights plus the forward workspace must fit in the memory of the largest GPU of each arch."""
    for name in spec.archs:
        a = ARCHS[name]
        words = a.smem_per_cta // 4 - 2 * spec.shared_experts - 2 - _ROUTING_SMEM_SLACK_WORDS
        most = words // _ROUTING_SMEM_WORDS_PER_EXPERT
        if spec.local_experts > most:
            raise _fail("ep", f"experts per rank (experts/ep = {spec.local_experts}) must be at most {most} on "
                              f"{name}: the routing kernel keeps {_ROUTING_SMEM_WORDS_PER_EXPERT} int32 counters per "
                              f"local expert in its {a.smem_per_cta} bytes of shared memory; raise ep")
        weights, work = device_bytes(spec)
        if weights + work > a.device_bytes:
            per_ffn = weights / spec.ffn
            fit = int(max(0, a.device_bytes - work) // per_ffn) // K_BLOCK * K_BLOCK
            gb = 1e9
            raise _fail("ffn" if weights >= work else "tokens",
                        f"the layer needs {weights / gb:.1f} GB of expert weights and {work / gb:.1f} GB of "
                        f"workspace at tokens={spec.tokens}, more than the {a.device_bytes / gb:.0f} GB of the "
                        f"largest {name} GPU" + (f"; at most ffn={fit} fits" if weights >= work and fit else "")
                        + "; reduce ffn, hidden, tokens or the experts per rank (raise ep)")

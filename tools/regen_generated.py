"""Regenerate generated/<preset>/ (the emitted sm_90a sources of every shipped preset) and generated/sm_100a/<preset>/.

    python tools/regen_generated.py          # rewrite generated/
    python tools/regen_generated.py --check  # exit 1 if generated/ differs from what emit produces now

tests/test_emit.py runs the check: a template or plan change that alters the kernels shows up as a diff to review
and commit.
"""
from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mokgen.emit import emit  # noqa: E402
from mokgen.plan import solve  # noqa: E402
from mokgen.spec import list_presets  # noqa: E402

GENERATED = ROOT / "generated"
ARCH = "sm_90a"
# other archs' sources go to generated/<arch>/<preset>/, for the presets their plans cover
OTHER_ARCHS = ("sm_100a",)
# spec files (not presets) whose sources are golden too, per arch: generated/<arch>/<spec name>/ (MXFP8 is
# sm_100a-only, so no preset carries it)
EXTRA_SPECS = {"sm_100a": ("tools/specs/kimi-k2-mxfp8.yaml", "tools/specs/gpt-oss-120b-mxfp8.yaml")}


def expected() -> dict[str, dict[str, str]]:
    """{directory under generated/: {file: text}}: generated/<preset>/ for sm_90a, generated/<arch>/<preset>/ for
    the other archs (the presets they plan: sm_100a has no blockwise FP8), and EXTRA_SPECS."""
    from mokgen.plan import PlanError
    from mokgen.spec import load_spec

    out = {spec.name: emit(solve(spec, ARCH)).files for spec in list_presets()}
    for arch in OTHER_ARCHS:
        for spec in list_presets():
            try:
                plan = solve(spec, arch)
            except PlanError:
                continue
            out[f"{arch}/{spec.name}"] = emit(plan).files
    for arch, paths in EXTRA_SPECS.items():
        for path in paths:
            spec = load_spec(ROOT / path)
            out[f"{arch}/{spec.name}"] = emit(solve(spec, arch)).files
    return out


def _leaf_dirs() -> set[str]:
    if not GENERATED.is_dir():
        return set()
    return {str(p.parent.relative_to(GENERATED)) for p in GENERATED.rglob("*.py")}


def differences(want: dict[str, dict[str, str]]) -> list[str]:
    out = []
    have_dirs = _leaf_dirs()
    for name in sorted(have_dirs - set(want)):
        out.append(f"generated/{name}/: no such preset any more")
    for name, files in sorted(want.items()):
        d = GENERATED / name
        have = {p.name for p in d.glob("*")} if d.is_dir() else set()
        for f in sorted(have - set(files)):
            out.append(f"generated/{name}/{f}: not emitted any more")
        for f, text in sorted(files.items()):
            p = d / f
            if not p.is_file():
                out.append(f"generated/{name}/{f}: missing")
            elif p.read_text() != text:
                out.append(f"generated/{name}/{f}: differs from emit()")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    want = expected()
    if a.check:
        diffs = differences(want)
        for line in diffs:
            print(line)
        return 1 if diffs else 0
    if GENERATED.is_dir():
        shutil.rmtree(GENERATED)
    for name, files in want.items():
        d = GENERATED / name
        d.mkdir(parents=True)
        for f, text in files.items():
            (d / f).write_text(text)
    print(f"wrote {sum(len(f) for f in want.values())} files for {len(want)} preset/arch pairs into {GENERATED}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

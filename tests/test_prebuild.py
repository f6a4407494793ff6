"""tools/prebuild.py's spec list: the FP8 / BF16 twins it builds are the specs the benches compile."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import bench_fp8  # noqa: E402
import prebuild  # noqa: E402
from mokgen.spec import load_spec  # noqa: E402


def test_parse_items():
    assert prebuild.parse_items("kimi-k2:fp8, glm-5,tools/specs/dbrx-like.yaml:bf16") == [
        ("kimi-k2", "fp8"), ("glm-5", None), ("tools/specs/dbrx-like.yaml", "bf16")]
    assert prebuild.parse_items("tools/specs/dbrx-like.yaml") == [("tools/specs/dbrx-like.yaml", None)]
    with pytest.raises(ValueError, match="must be one of bf16, fp8"):
        prebuild.parse_items("kimi-k2:fp4")
    with pytest.raises(ValueError, match="no spec"):
        prebuild.parse_items(" , ")


@pytest.mark.parametrize("name", ["kimi-k2", "qwen3-30b-a3b", "kimi-k2-fp8"])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_twins_are_the_benches_specs(name, dtype):
    spec = load_spec(name)
    twin = prebuild.spec_for(name, dtype)
    assert twin == bench_fp8.spec_as(spec, dtype)
    assert twin["dtype"] == dtype and twin["name"] == spec.name   # the benches' name: kimi-k2:fp8 is not kimi-k2-fp8
    assert {k: v for k, v in twin.items() if k != "dtype"} == {k: v for k, v in spec.to_dict().items() if k != "dtype"}
    assert prebuild.spec_for(name, None) == spec


def test_usage_and_bad_dtype_exit_2(capsys):
    assert prebuild.main(["out.tar.xz"]) == 2
    assert prebuild.main(["out.tar.xz", "kimi-k2:int4"]) == 2
    assert "must be one of" in capsys.readouterr().err

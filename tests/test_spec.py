import dataclasses

import pytest

from mokgen.spec import Spec, SpecError, list_presets, load_spec

PRESETS = {
    # name: (hidden, ffn, experts, topk, shared_experts, ep, tokens)
    "kimi-k2": (7168, 2048, 384, 8, 1, 64, 2048),
    "deepseek-v3": (7168, 2048, 256, 8, 1, 64, 2048),
    "deepseek-v4-pro": (7168, 3072, 384, 6, 1, 64, 2048),
    "glm-5": (6144, 2048, 256, 8, 1, 64, 2048),
    "qwen3.5-397b-a17b": (4096, 1024, 512, 10, 1, 64, 2048),
    "qwen3-235b-a22b": (4096, 1536, 128, 8, 0, 64, 2048),
    "qwen3-30b-a3b": (2048, 768, 128, 8, 0, 1, 4096),
    "gpt-oss-120b": (2880, 2880, 128, 4, 0, 1, 4096),
    "kimi-k2-fp8": (7168, 2048, 384, 8, 1, 64, 2048),        # dtype fp8
    "qwen3-30b-a3b-fp8": (2048, 768, 128, 8, 0, 1, 4096),    # dtype fp8
    "gpt-oss-120b-fp8": (2880, 2880, 128, 4, 0, 1, 4096),    # dtype fp8 (partial 128-blocks)
}

BASE = {"hidden": 1024, "ffn": 512, "experts": 8, "topk": 2, "tokens": 256}
DELETE = object()


def test_list_presets_names():
    assert sorted(s.name for s in list_presets()) == sorted(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_loads_and_round_trips(name):
    spec = load_spec(name)
    hidden, ffn, experts, topk, shared, ep, tokens = PRESETS[name]
    assert (spec.name, spec.hidden, spec.ffn, spec.experts, spec.topk) == (name, hidden, ffn, experts, topk)
    assert (spec.shared_experts, spec.ep, spec.tokens, spec.dtype) == (shared, ep, tokens,
                                                                   "fp8" if name.endswith("-fp8") else "bf16")
    assert Spec.from_dict(spec.to_dict()) == spec
    assert load_spec(spec.to_dict()) == spec
    assert Spec.from_dict(spec.to_dict()).canonical_json() == spec.canonical_json()


def test_preset_specifics():
    oss = load_spec("gpt-oss-120b")
    assert (oss.activation, oss.swiglu_limit, oss.gate_up_layout, oss.bias) == ("swiglu_oai", 7.0, "interleaved", True)
    assert load_spec("deepseek-v4-pro").swiglu_limit == 10.0
    kimi = load_spec("kimi-k2")
    assert (kimi.activation, kimi.swiglu_limit, kimi.gate_up_layout, kimi.bias, kimi.archs) == (
        "swiglu", None, "concat", False, ("sm_90a",))


def test_defaults():
    spec = load_spec(BASE)
    assert spec.name == "custom"
    assert (spec.ep, spec.dtype, spec.shared_experts, spec.activation) == (1, "bf16", 0, "swiglu")
    assert (spec.swiglu_limit, spec.gate_up_layout, spec.bias, spec.archs) == (None, "concat", False, ("sm_90a",))
    oai = load_spec({**BASE, "activation": "swiglu_oai"})
    assert (oai.swiglu_limit, oai.bias) == (7.0, True)
    assert load_spec({**BASE, "activation": "swiglu_oai", "swiglu_limit": 7, "bias": False}).bias is False


def test_derived_properties():
    spec = load_spec("kimi-k2")
    assert spec.local_experts == 6
    assert spec.groups == 7
    assert spec.routed_rows == 2048 * 8
    assert spec.rows == 2048 * 9
    assert spec.flops_forward == 2 * 2048 * 9 * 3 * 7168 * 2048
    oss = load_spec("gpt-oss-120b")
    assert (oss.local_experts, oss.groups, oss.rows) == (128, 128, 4096 * 4)


def test_canonical_json_is_sorted_and_compact():
    text = load_spec("glm-5").canonical_json()
    assert text.startswith('{"activation":"swiglu","archs":["sm_90a"]') and " " not in text


def test_spec_is_frozen_and_validated_on_construction():
    spec = load_spec("glm-5")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.hidden = 64
    with pytest.raises(SpecError, match=r"^spec\.ffn:"):
        dataclasses.replace(spec, ffn=100)
    assert dataclasses.replace(spec, archs=["sm_100a", "sm_90a"]).archs == ("sm_100a", "sm_90a")


BAD = [
    # (changes to BASE, field path, fragment of the message)
    ({"hidden": 100}, "spec.hidden", "positive multiple of 64"),
    ({"hidden": 0}, "spec.hidden", "positive multiple of 64"),
    ({"hidden": -64}, "spec.hidden", "positive multiple of 64"),
    ({"hidden": "7168"}, "spec.hidden", "must be an integer"),
    ({"hidden": True}, "spec.hidden", "must be an integer"),
    ({"hidden": 1024.0}, "spec.hidden", "must be an integer"),
    ({"ffn": 96}, "spec.ffn", "positive multiple of 64"),
    ({"ffn": None}, "spec.ffn", "must be an integer"),
    ({"experts": 0}, "spec.experts", ">= 1"),
    ({"experts": "many"}, "spec.experts", "must be an integer"),
    ({"topk": 0}, "spec.topk", "[1, experts=8]"),
    ({"topk": 9}, "spec.topk", "[1, experts=8]"),
    ({"topk": False}, "spec.topk", "must be an integer"),
    ({"ep": 0}, "spec.ep", ">= 1"),
    ({"ep": 3}, "spec.ep", "must divide experts"),
    ({"tokens": 0}, "spec.tokens", "[1, 1048576]"),
    ({"tokens": (1 << 20) + 1}, "spec.tokens", "[1, 1048576]"),
    ({"tokens": 2.5}, "spec.tokens", "must be an integer"),
    ({"shared_experts": 5}, "spec.shared_experts", "[0, 4]"),
    ({"shared_experts": -1}, "spec.shared_experts", "[0, 4]"),
    ({"dtype": "mxfp8"}, "spec.archs[0]", "dtype mxfp8 (e4m3 with e8m0 scales per 32 elements, Blackwell's "
     "block-scaled MMA) targets sm_100a, got 'sm_90a'"),
    # mxfp8 keeps bf16's rule too (multiples of 64: 320 and 192, not multiples of 128, are taken: partial tiles)
    ({"dtype": "mxfp8", "archs": ["sm_100a"], "hidden": 288}, "spec.hidden", "positive multiple of 64"),
    ({"dtype": "mxfp8", "archs": ["sm_100a"], "ffn": 160}, "spec.ffn", "positive multiple of 64"),
    ({"dtype": "fp8", "hidden": 200}, "spec.hidden", "positive multiple of 64"),   # fp8 keeps bf16's rule
    ({"dtype": "fp8", "archs": ["sm_90a", "sm_100a"]}, "spec.archs[1]", "targets sm_90a"),
    ({"dtype": "fp16"}, "spec.dtype", "bf16"),
    ({"activation": "gelu"}, "spec.activation", "swiglu, swiglu_oai"),
    ({"activation": "swiglu-oai"}, "spec.activation", "did you mean 'swiglu_oai'"),
    ({"swiglu_limit": 0}, "spec.swiglu_limit", "> 0"),
    ({"swiglu_limit": -1.5}, "spec.swiglu_limit", "> 0"),
    ({"swiglu_limit": "7"}, "spec.swiglu_limit", "number"),
    ({"swiglu_limit": True}, "spec.swiglu_limit", "number"),
    ({"swiglu_limit": float("inf")}, "spec.swiglu_limit", "finite"),
    ({"activation": "swiglu_oai", "swiglu_limit": 8}, "spec.swiglu_limit", "swiglu_oai clamps at 7"),
    ({"gate_up_layout": "split"}, "spec.gate_up_layout", "concat, interleaved"),
    ({"bias": "yes"}, "spec.bias", "true or false"),
    ({"bias": 1}, "spec.bias", "true or false"),
    ({"archs": ["sm_80"]}, "spec.archs[0]", "sm_90a, sm_100a"),
    ({"archs": ["sm_90a", "sm_90"]}, "spec.archs[1]", "did you mean 'sm_90a'"),
    ({"archs": ["sm_90a", "sm_90a"]}, "spec.archs[1]", "duplicate"),
    ({"archs": []}, "spec.archs", "at least one"),
    ({"archs": "sm_90a"}, "spec.archs", "must be a list"),
    ({"name": ""}, "spec.name", "non-empty"),
    ({"name": "a b"}, "spec.name", "letters, digits"),
    ({"name": 3}, "spec.name", "string"),
    ({"hiden": 1024}, "spec.hiden", "did you mean 'hidden'"),
    ({"tokns": 8}, "spec.tokns", "did you mean 'tokens'"),
    ({"zzz": 1}, "spec.zzz", "known keys: name, hidden"),
    ({"topk": DELETE}, "spec.topk", "required key is missing"),
    ({"hidden": DELETE}, "spec.hidden", "required key is missing"),
]


@pytest.mark.parametrize("changes,path,fragment", BAD, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(BAD)])
def test_bad_spec(changes, path, fragment):
    data = {**BASE, **changes}
    data = {k: v for k, v in data.items() if v is not DELETE}
    with pytest.raises(SpecError) as info:
        load_spec(data)
    message = str(info.value)
    assert message.startswith(path + ":"), message
    assert fragment in message
    assert "\n" not in message


def test_yaml_file(tmp_path):
    path = tmp_path / "my-moe.yaml"
    path.write_text("# a test layer\nhidden: 1024\nffn: 512\nexperts: 8\ntopk: 2\ntokens: 256\n"
                    "archs: [sm_90a, sm_100a]\n")
    spec = load_spec(path)
    assert spec.name == "my-moe" and spec.archs == ("sm_90a", "sm_100a")
    assert load_spec(str(path)) == spec
    named = tmp_path / "other.yml"
    named.write_text("name: layer7\nhidden: 1024\nffn: 512\nexperts: 8\ntopk: 2\ntokens: 256\n")
    assert load_spec(named).name == "layer7"


@pytest.mark.parametrize("text,fragment", [
    ("- 1\n- 2\n", "must be a mapping"),
    ("just a string\n", "must be a mapping"),
    ("", "is empty"),
    ("hidden: [1, 2\n", "invalid YAML"),
])
def test_bad_yaml_file(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=r"^spec: ") as info:
        load_spec(path)
    assert fragment in str(info.value) and "\n" not in str(info.value)


def test_yaml_field_error_names_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("hidden: 1000\nffn: 512\nexperts: 8\ntopk: 2\ntokens: 256\n")
    with pytest.raises(SpecError, match=r"^spec\.hidden: must be a positive multiple of 64, got 1000$"):
        load_spec(path)


def test_missing_file_and_unknown_preset(tmp_path):
    with pytest.raises(SpecError, match=r"^spec: cannot read"):
        load_spec(tmp_path / "nope.yaml")
    with pytest.raises(SpecError, match=r"^spec: unknown preset 'kimi'; did you mean 'kimi-k2'\?"):
        load_spec("kimi")
    with pytest.raises(SpecError, match=r"^spec: expected a preset name"):
        load_spec(42)


def test_spec_error_is_value_error():
    assert issubclass(SpecError, ValueError)

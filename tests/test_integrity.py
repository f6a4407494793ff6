"""Issue 11, points 1 and 2: every artifact is hashed in meta.json and verified on load; `cache verify` /
`cache list` mark damage; a pack installs all or nothing. No kernel compiles here."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from helpers11 import failing_build, fake_build, make_sources, tree
from mokgen import cache, packs
from mokgen.cache import CacheError, DamagedEntryError


def _flip(p: Path, offset: int = 3) -> None:
    b = bytearray(p.read_bytes())
    b[offset] ^= 0x01
    p.write_bytes(bytes(b))


# ------------------------------------------------------------------------------------------- point 1


def test_meta_records_every_file_with_sha256(mokgen_cache: Path, tmp_path: Path) -> None:
    entry = cache.store(fake_build(make_sources(), "sm_90a", tmp_path / "b"))
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["format"] == cache.META_FORMAT
    on_disk = {str(p.relative_to(entry)) for p in entry.rglob("*") if p.is_file() and p.name != "meta.json"}
    assert set(meta["files"]) == on_disk
    for rel, rec in meta["files"].items():
        assert rec == {"size": (entry / rel).stat().st_size, "sha256": cache.sha256_file(entry / rel)}


@pytest.mark.parametrize("damage", ["flip_lib", "flip_ptx", "swap_same_size", "symlink", "format1"])
def test_damaged_content_is_never_loaded(mokgen_cache: Path, tmp_path: Path, damage: str) -> None:
    s = make_sources()
    art = fake_build(s, "sm_90a", tmp_path / "a")
    entry = cache.store(art)
    other = cache.store(fake_build(make_sources(template_hash="o" * 16), "sm_90a", tmp_path / "o",
                                   lib=b"\x7fELF fake librarz"))  # same size, other bytes
    if damage == "flip_lib":
        _flip(entry / "libmokgen.so")
    elif damage == "flip_ptx":
        _flip(entry / "k1.ptx")
    elif damage == "swap_same_size":
        shutil.copy2(other / "libmokgen.so", entry / "libmokgen.so")
    elif damage == "symlink":
        (entry / "libmokgen.so").unlink()
        (entry / "libmokgen.so").symlink_to(other / "libmokgen.so")
    else:
        m = json.loads((entry / "meta.json").read_text())
        m["format"] = 1
        m["files"] = {k: v["size"] for k, v in m["files"].items()}
        (entry / "meta.json").write_text(json.dumps(m))
    d, why = cache.probe(art.key, "sm_90a")
    assert d == entry and why
    assert cache.lookup(art.key, "sm_90a") is None
    with pytest.raises(DamagedEntryError):
        cache.load_artifacts(entry)
    assert [e.path for e in cache.list_entries()] == [other]
    # where the compiler is: rebuilt, and said so
    rebuilt = cache.get_or_build(s, "sm_90a", lambda *a: fake_build(*a), progress=False)
    assert rebuilt.status == "rebuilt" and rebuilt.dir == entry
    assert cache.lookup(art.key, "sm_90a") == entry


def test_without_compiler_a_damaged_entry_is_refused(mokgen_cache: Path, tmp_path: Path) -> None:
    s = make_sources()
    entry = cache.store(fake_build(s, "sm_90a", tmp_path / "a"))
    _flip(entry / "libmokgen.so")
    assert cache.find(s, "sm_90a", compiler=True) is None  # a miss: the caller rebuilds
    with pytest.raises(DamagedEntryError, match=r"damaged and will not be loaded .*sha256.*compiler is not installed"):
        cache.find(s, "sm_90a", compiler=False)


def test_cli_verify_and_list_mark_damage(mokgen_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mokgen.cli import main

    good = cache.store(fake_build(make_sources(), "sm_90a", tmp_path / "a"))
    assert main(["cache", "verify"]) == 0
    assert "all intact" in capsys.readouterr().out
    bad = cache.store(fake_build(make_sources(template_hash="b" * 16), "sm_90a", tmp_path / "b"))
    _flip(bad / "k2.o")
    misfiled = mokgen_cache / "sm_100a" / good.name
    shutil.copytree(good, misfiled)
    assert main(["cache", "verify"]) == 2
    cap = capsys.readouterr()
    assert f"DAMAGED   {bad}" in cap.out and f"MISFILED  {misfiled}" in cap.out and f"ok        {good}" in cap.out
    assert cap.err.startswith("mokgen: error: 2 of 3 checked") and len(cap.err.strip().splitlines()) == 1
    assert main(["cache", "verify", "--arch", "sm_90a"]) == 2
    capsys.readouterr()
    assert main(["cache", "list"]) == 0
    cap = capsys.readouterr()
    rows = {(line.split()[0], line.split()[1]): line.split()[6] for line in cap.out.splitlines()[2:]}
    assert rows == {("sm_90a", good.name): "ok", ("sm_90a", bad.name): "DAMAGED", ("sm_100a", good.name): "MISFILED"}
    assert "k2.o does not match its sha256" in cap.err
    # an extra, unlisted file: verify (strict) reports it, loading does not care
    shutil.rmtree(misfiled)
    shutil.rmtree(bad)
    (good / "planted.so").write_bytes(b"x")
    assert main(["cache", "verify"]) == 2
    assert "planted.so is not listed in meta.json" in capsys.readouterr().out


def test_cli_verify_checks_the_unpacked_runtime(mokgen_cache: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture) -> None:
    from mokgen.cli import main

    src = tmp_path / "rt.so"
    src.write_bytes(b"\x7fELF runtime" * 10)
    rt = cache.install_runtime(src, {"nvidia-cutlass-dsl": "4.8.1"})
    meta = json.loads((rt.parent / "meta.json").read_text())
    assert meta["sha256"] == cache.sha256_file(src) and meta["dsl_versions"] == {"nvidia-cutlass-dsl": "4.8.1"}
    assert cache.check_runtime() == ""
    assert main(["cache", "verify"]) == 0
    capsys.readouterr()
    _flip(rt)
    assert "does not match its sha256" in cache.check_runtime()
    assert main(["cache", "verify"]) == 2
    assert f"DAMAGED   {rt.parent}" in capsys.readouterr().out


def test_verify_cost_is_small(mokgen_cache: Path, tmp_path: Path) -> None:
    """A real entry is ~0.5 MB (kimi-k2: 15 files); hashing it all must stay far below the warm-load budget."""
    import time

    art = fake_build(make_sources(), "sm_90a", tmp_path / "a", lib=os.urandom(600_000))
    entry = cache.store(art)
    t0 = time.perf_counter()
    for _ in range(10):
        assert cache.load_artifacts(entry)
    assert (time.perf_counter() - t0) / 10 < 0.05


# ------------------------------------------------------------------------------------------- point 2


@pytest.fixture
def packed(mokgen_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    rt = tmp_path / "rt" / cache.RUNTIME_LIB
    rt.parent.mkdir()
    rt.write_bytes(b"\x7fELF fake runtime" * 100)
    monkeypatch.setattr(packs, "_dsl_runtime_for_pack", lambda: rt)
    s = make_sources()
    art = fake_build(s, "sm_90a", tmp_path / "a")
    cache.store(art)
    tar = packs.pack(tmp_path / "good.tar.xz")
    return {"tar": tar, "art": art, "rt": rt, "sources": s}


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy pack ``src`` to ``dst`` member by member, ``edit(info, data) -> (info, data) | None`` on each."""
    with tarfile.open(src) as tin, tarfile.open(dst, "w:xz") as tout:
        for m in tin.getmembers():
            data = tin.extractfile(m).read() if m.isfile() else None
            res = edit(m, data)
            if res is None:
                continue
            info, data = res
            if data is not None:
                info.size = len(data)
                tout.addfile(info, io.BytesIO(data))
            else:
                tout.addfile(info)
    return dst


def _fresh_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packed: dict) -> Path:
    """Another host's cache with the good pack installed (its runtime in place)."""
    other = tmp_path / "gpu-host"
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(other))
    res = packs.unpack(packed["tar"])
    assert len(res["installed"]) == 1 and res["runtime_status"] == "installed"
    assert cache.check_runtime() == ""
    return other


def _flip_member(name_end: str):
    def edit(m, data):
        if m.name.endswith(name_end):
            b = bytearray(data)
            b[-1] ^= 1
            return m, bytes(b)
        return m, data
    return edit


@pytest.mark.parametrize("case", ["flip_lib", "flip_runtime", "extra_file", "symlink", "missing_file",
                                  "old_format", "unlisted_entry"])
def test_refused_pack_changes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packed: dict, case: str) -> None:
    other = _fresh_host(tmp_path, monkeypatch, packed)
    cache.clear()  # the entry goes, the runtime stays: a working compiler-less host
    before = tree(other)
    key16 = packed["art"].key[:16]
    bad = tmp_path / f"{case}.tar.xz"
    if case == "flip_lib":
        _rewrite(packed["tar"], bad, _flip_member("libmokgen.so"))
        want = "libmokgen.so does not match its size and sha256"
    elif case == "flip_runtime":
        _rewrite(packed["tar"], bad, _flip_member(cache.RUNTIME_LIB))
        want = "runtime/libcute_dsl_runtime.so does not match its size and sha256 in MANIFEST.json"
    elif case == "extra_file":
        _rewrite(packed["tar"], bad, lambda m, data: (m, data))   # a plain copy: the extra member is added below
        with tarfile.open(bad) as t:
            members = [(m, t.extractfile(m).read() if m.isfile() else None) for m in t.getmembers()]
        with tarfile.open(bad, "w:xz") as t:
            for m, data in members:
                t.addfile(m, io.BytesIO(data) if data is not None else None)
            info = tarfile.TarInfo(f"sm_90a/{key16}/evil.so")
            info.size = 3
            t.addfile(info, io.BytesIO(b"bad"))
        want = "evil.so is not listed in meta.json"
    elif case == "symlink":
        def edit(m, data):
            if m.name.endswith("/k1.ptx"):
                info = tarfile.TarInfo(m.name)
                info.type = tarfile.SYMTYPE
                info.linkname = "/etc/passwd"
                return info, None
            return m, data
        _rewrite(packed["tar"], bad, edit)
        want = "is not a regular file"
    elif case == "missing_file":
        _rewrite(packed["tar"], bad, lambda m, d: None if m.name.endswith("/k2.o") else (m, d))
        want = "k2.o is listed in meta.json but not in the pack"
    elif case == "old_format":
        def edit(m, data):
            if m.name == "MANIFEST.json":
                doc = json.loads(data)
                doc["format"] = 1
                return m, json.dumps(doc).encode()
            return m, data
        _rewrite(packed["tar"], bad, edit)
        want = "format 1"
    else:
        def edit(m, data):
            if m.name == "MANIFEST.json":
                doc = json.loads(data)
                doc["entries"] = []
                return m, json.dumps(doc).encode()
            return m, data
        _rewrite(packed["tar"], bad, edit)
        want = "is not listed in MANIFEST.json"
    with pytest.raises(CacheError, match="refused, nothing installed") as ei:
        packs.unpack(bad)
    assert want in str(ei.value)
    assert tree(other) == before  # not one byte changed: the runtime there still works
    assert cache.check_runtime() == ""


def test_refused_pack_on_a_fresh_host_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     packed: dict) -> None:
    bad = _rewrite(packed["tar"], tmp_path / "bad.tar.xz", _flip_member("libmokgen.so"))
    fresh = tmp_path / "fresh"
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(fresh))
    with pytest.raises(CacheError, match="refused"):
        packs.unpack(bad)
    assert not fresh.exists()


def test_cli_unpack_refusal_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, packed: dict,
                                        capsys: pytest.CaptureFixture) -> None:
    from mokgen.cli import main

    bad = _rewrite(packed["tar"], tmp_path / "bad.tar.xz", _flip_member("libmokgen.so"))
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "fresh"))
    assert main(["cache", "unpack", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mokgen: error: ") and "refused, nothing installed" in err and len(err.splitlines()) == 1
    assert main(["cache", "unpack", str(packed["tar"])]) == 0
    out = capsys.readouterr().out
    assert "installed" in out and "runtime" in out


def test_runtime_is_versioned_and_a_conflicting_pack_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             packed: dict) -> None:
    other = _fresh_host(tmp_path, monkeypatch, packed)
    have = cache.runtime_versions()
    assert have and all(k.startswith("nvidia-cutlass-dsl") for k in have)
    # a pack whose runtime (and entries) come from another DSL version would break the installed entries
    def edit(m, data):
        if m.name == "MANIFEST.json":
            doc = json.loads(data)
            doc["runtime"]["dsl_versions"] = {"nvidia-cutlass-dsl": "9.9.9"}
            return m, json.dumps(doc).encode()
        if m.name.endswith("/meta.json"):
            doc = json.loads(data)
            doc["dsl_versions"] = {"nvidia-cutlass-dsl": "9.9.9"}
            return m, json.dumps(doc).encode()
        return m, data
    newer = _rewrite(packed["tar"], tmp_path / "newer.tar.xz", edit)
    before = tree(other)
    with pytest.raises(CacheError, match=r"runtime library is CuTe DSL 9\.9\.9 but 1 cached entry need"):
        packs.unpack(newer)
    assert tree(other) == before


def test_pack_leaves_out_damaged_entries(mokgen_cache: Path, tmp_path: Path, packed: dict,
                                         capsys: pytest.CaptureFixture) -> None:
    bad = cache.store(fake_build(make_sources(template_hash="d" * 16), "sm_90a", tmp_path / "d"))
    _flip(bad / "libmokgen.so")
    tar = packs.pack(tmp_path / "p.tar.xz")
    assert f"not packing {bad}" in capsys.readouterr().err
    with tarfile.open(tar) as tf:
        assert not any(bad.name in n for n in tf.getnames())
        man = json.loads(tf.extractfile("MANIFEST.json").read())
    assert man["format"] == cache.META_FORMAT and man["runtime"]["sha256"] == cache.sha256_file(packed["rt"])


def test_pack_carries_only_listed_files(mokgen_cache: Path, tmp_path: Path, packed: dict,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    entry = cache.entry_dir(packed["art"].key, "sm_90a")
    (entry / "stray.txt").write_text("not an artifact")
    tar = packs.pack(tmp_path / "p2.tar.xz")
    with tarfile.open(tar) as tf:
        assert not any(n.endswith("stray.txt") for n in tf.getnames())
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "other"))
    assert len(packs.unpack(tar)["installed"]) == 1


def test_cache_hit_needs_no_write(mokgen_cache: Path, tmp_path: Path) -> None:
    s = make_sources()
    entry = cache.store(fake_build(s, "sm_90a", tmp_path / "a"))
    art = cache.get_or_build(s, "sm_90a", failing_build)
    assert art.dir == entry and art.status == "cached"

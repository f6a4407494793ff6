"""mokgen.cache: keys, atomic entries, locks, races, wrong-arch refusal, pack/unpack. No kernel compiles here:
the build function is a fake that writes the files a build would."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import shutil
import tarfile
import time
from pathlib import Path
from typing import Any

import pytest

from mokgen import cache, packs
from mokgen.build import Artifacts
from mokgen.cache import CacheError


@dataclasses.dataclass(frozen=True)
class FakeSources:
    spec: Any
    plan: Any
    template_hash: str
    files: dict


def make_sources(**over: Any) -> FakeSources:
    d = dict(
        spec={"name": "toy", "hidden": 256, "ffn": 128},
        plan={"bm": 128, "bn": 256, "stages": 4},
        template_hash="t" * 16,
        files={"k1.py": 'KERNEL_NAME = "k1"\n', "k2.py": 'KERNEL_NAME = "k2"\n'},
    )
    d.update(over)
    return FakeSources(**d)


def fake_build(sources: Any, arch: str, out_dir: Path, delay: float = 0.0) -> Artifacts:
    """Writes what build() would (library, objects, PTX, sources); records each call in $FAKE_BUILD_LOG."""
    log = os.environ.get("FAKE_BUILD_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
    if delay:
        time.sleep(delay)
    out = Path(out_dir)
    (out / "sources").mkdir(parents=True, exist_ok=True)
    kernels = sorted(n[:-3] for n in sources.files)
    for fname, text in sources.files.items():
        (out / "sources" / fname).write_text(text)
    for k in kernels:
        (out / f"{k}.o").write_bytes(b"\x7fELF fake object " + k.encode())
        (out / f"{k}.ptx").write_text(f"//\n.version 8.0\n.target {arch}\n.address_size 64\n// {k}\n"
                                      "mbarrier.init wgmma.mma_async\n")
    (out / "libmokgen.so").write_bytes(b"\x7fELF fake library")
    key = cache.key_for(sources, arch)
    meta = {"arch": arch, "key": key, "spec_name": sources.spec["name"], "kernels": kernels,
            "content_key": cache.content_key_for(sources, arch)}
    return Artifacts(dir=out, lib=out / "libmokgen.so", kernels=tuple(kernels), arch=arch, key=key, meta=meta)


def slow_fake_build(sources: Any, arch: str, out_dir: Path) -> Artifacts:
    return fake_build(sources, arch, out_dir, delay=0.5)


def failing_build(sources: Any, arch: str, out_dir: Path) -> Artifacts:
    raise AssertionError("must not build: the entry is cached")


def builds(log: Path) -> int:
    return len(log.read_text().split()) if log.exists() else 0


@pytest.fixture
def build_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    p = tmp_path / "builds.log"
    monkeypatch.setenv("FAKE_BUILD_LOG", str(p))
    return p


# ---------------------------------------------------------------------------------------------------- keys


def test_cache_root_env(mokgen_cache: Path) -> None:
    assert cache.cache_root() == mokgen_cache.resolve()
    k = cache.key_for(make_sources(), "sm_90a")
    assert cache.entry_dir(k, "sm_90a") == mokgen_cache.resolve() / "sm_90a" / k[:16]


def test_key_changes_with_each_input(monkeypatch: pytest.MonkeyPatch) -> None:
    base = make_sources()
    k0 = cache.key_for(base, "sm_90a")
    assert len(k0) == 64 and k0 == cache.key_for(make_sources(), "sm_90a")  # deterministic
    variants = [
        cache.key_for(base, "sm_100a"),
        cache.key_for(make_sources(template_hash="u" * 16), "sm_90a"),
        cache.key_for(make_sources(spec={"name": "toy", "hidden": 512, "ffn": 128}), "sm_90a"),
        cache.key_for(make_sources(plan={"bm": 128, "bn": 128, "stages": 4}), "sm_90a"),
        cache.key_for(make_sources(files={"k1.py": 'KERNEL_NAME = "k1"\n# changed\n'}), "sm_90a"),
    ]
    real = cache.dsl_versions()
    assert any(k.startswith("nvidia-cutlass-dsl") for k in real) and "apache-tvm-ffi" in real
    for name in real:
        bumped = dict(real, **{name: real[name] + ".post99"})
        monkeypatch.setattr(cache, "dsl_versions", lambda b=bumped: b)
        variants.append(cache.key_for(base, "sm_90a"))
    monkeypatch.setattr(cache, "dsl_versions", lambda: real)
    assert cache.key_for(base, "sm_90a") == k0
    assert len(set(variants)) == len(variants) and k0 not in variants


def test_key_is_order_independent() -> None:
    a = make_sources(spec={"name": "toy", "hidden": 256, "ffn": 128})
    b = make_sources(spec={"ffn": 128, "hidden": 256, "name": "toy"})
    assert cache.key_for(a, "sm_90a") == cache.key_for(b, "sm_90a")


def test_content_key_ignores_compiler_version(monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_sources()
    real = cache.dsl_versions()
    c0 = cache.content_key_for(s, "sm_90a")
    monkeypatch.setattr(cache, "dsl_versions", lambda: {k: v for k, v in real.items() if k == "apache-tvm-ffi"})
    assert cache.content_key_for(s, "sm_90a") == c0  # no DSL installed: same content key


# -------------------------------------------------------------------------------------------- store/lookup


def test_store_and_lookup(mokgen_cache: Path, tmp_path: Path) -> None:
    s = make_sources()
    art = fake_build(s, "sm_90a", tmp_path / "b")
    assert cache.lookup(art.key, "sm_90a") is None
    entry = cache.store(art)
    assert entry == cache.entry_dir(art.key, "sm_90a")
    assert cache.lookup(art.key, "sm_90a") == entry
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["arch"] == "sm_90a" and meta["key"] == art.key and meta["kernels"] == ["k1", "k2"]
    for f in ("libmokgen.so", "k1.o", "k1.ptx", "k2.ptx", "sources/k1.py"):
        assert (entry / f).is_file() and meta["files"][f]["size"] == (entry / f).stat().st_size
        assert meta["files"][f]["sha256"] == cache.sha256_file(entry / f)
    assert meta["format"] == cache.META_FORMAT
    assert not list(entry.parent.glob("*.tmp.*"))
    loaded = cache.load_artifacts(entry)
    assert loaded.lib == entry / "libmokgen.so" and loaded.kernels == ("k1", "k2") and loaded.key == art.key
    # storing again keeps the complete entry
    assert cache.store(art) == entry


def test_partial_entry_is_ignored_and_rebuilt(mokgen_cache: Path, build_log: Path) -> None:
    s = make_sources()
    key = cache.key_for(s, "sm_90a")
    d = cache.entry_dir(key, "sm_90a")
    d.mkdir(parents=True)
    (d / "libmokgen.so").write_bytes(b"half written")  # a crash before meta.json
    assert cache.lookup(key, "sm_90a") is None
    assert cache.list_entries() == []
    art = cache.get_or_build(s, "sm_90a", fake_build)
    assert builds(build_log) == 1
    assert art.dir == d and cache.lookup(key, "sm_90a") == d
    assert (d / "libmokgen.so").read_bytes() == b"\x7fELF fake library"
    # a second call is a hit
    assert cache.get_or_build(s, "sm_90a", failing_build).dir == d
    assert builds(build_log) == 1


@pytest.mark.parametrize("damage", ["bad_json", "missing_file", "truncated_file", "no_files"])
def test_damaged_entry_is_not_trusted(mokgen_cache: Path, tmp_path: Path, damage: str) -> None:
    art = fake_build(make_sources(), "sm_90a", tmp_path / "b")
    entry = cache.store(art)
    meta_p = entry / "meta.json"
    if damage == "bad_json":
        meta_p.write_text(meta_p.read_text()[:-20])
    elif damage == "missing_file":
        (entry / "k1.ptx").unlink()
    elif damage == "truncated_file":
        (entry / "libmokgen.so").write_bytes(b"x")
    else:
        m = json.loads(meta_p.read_text())
        del m["files"]
        meta_p.write_text(json.dumps(m))
    assert cache.lookup(art.key, "sm_90a") is None
    assert cache.list_entries() == []
    with pytest.raises(CacheError):
        cache.load_artifacts(entry)
    # store replaces the damaged entry
    assert cache.store(art) == entry and cache.lookup(art.key, "sm_90a") == entry


def test_leftover_temp_dir_is_ignored(mokgen_cache: Path, tmp_path: Path) -> None:
    art = fake_build(make_sources(), "sm_90a", tmp_path / "b")
    tmp = cache.entry_dir(art.key, "sm_90a").with_name(cache.entry_dir(art.key, "sm_90a").name + ".tmp.99999")
    shutil.copytree(art.dir, tmp)
    assert cache.lookup(art.key, "sm_90a") is None and cache.list_entries() == []
    entry = cache.store(art)
    assert [e.path for e in cache.list_entries()] == [entry]


def test_force_rebuilds(mokgen_cache: Path, build_log: Path) -> None:
    s = make_sources()
    a1 = cache.get_or_build(s, "sm_90a", fake_build)
    a2 = cache.get_or_build(s, "sm_90a", fake_build, force=True)
    assert builds(build_log) == 2 and a1.dir == a2.dir and cache.lookup(a1.key, "sm_90a") == a1.dir


def test_failed_build_leaves_no_entry(mokgen_cache: Path) -> None:
    s = make_sources()

    def boom(sources: Any, arch: str, out_dir: Path) -> Artifacts:
        (Path(out_dir) / "libmokgen.so").write_bytes(b"partial")
        raise RuntimeError("compiler exploded")

    with pytest.raises(RuntimeError, match="exploded"):
        cache.get_or_build(s, "sm_90a", boom)
    key = cache.key_for(s, "sm_90a")
    assert cache.lookup(key, "sm_90a") is None and not cache.entry_dir(key, "sm_90a").exists()


# ------------------------------------------------------------------------------------------ wrong arch


def test_wrong_arch_entry_raises(mokgen_cache: Path, tmp_path: Path) -> None:
    s = make_sources()
    art = fake_build(s, "sm_90a", tmp_path / "b")
    entry = cache.store(art)
    # asked for sm_100a with the sm_90a key: found under the other arch -> refused, saying so
    with pytest.raises(CacheError, match=r"built for sm_90a, not sm_100a"):
        cache.lookup(art.key, "sm_100a")
    # an sm_90a entry copied into the sm_100a tree is refused too
    fake = cache.entry_dir(art.key, "sm_100a")
    shutil.copytree(entry, fake)
    with pytest.raises(CacheError, match=r"built for sm_90a, not sm_100a"):
        cache.lookup(art.key, "sm_100a")
    # ... and never listed as an sm_100a entry
    assert [e.arch for e in cache.list_entries()] == ["sm_90a"]
    # the right key for sm_100a is a different key: simply absent
    assert cache.lookup(cache.key_for(s, "sm_100a"), "sm_100a") is None


# ----------------------------------------------------------------------------------------------- locks


def _hold_lock(key: str, root: str, ready: Any, release: Any) -> None:
    os.environ["MOKGEN_CACHE_DIR"] = root
    with cache.lock(key, timeout=10):
        ready.set()
        release.wait(20)


def _hold_lock_and_die(key: str, root: str, ready: Any) -> None:
    os.environ["MOKGEN_CACHE_DIR"] = root
    cm = cache.lock(key, timeout=10)
    cm.__enter__()
    ready.set()
    time.sleep(0.3)
    os._exit(0)  # no release: the kernel drops flock locks of dead processes


def test_lock_timeout_names_path_and_holder(mokgen_cache: Path) -> None:
    key = cache.key_for(make_sources(), "sm_90a")
    ctx = mp.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold_lock, args=(key, str(mokgen_cache), ready, release))
    p.start()
    try:
        assert ready.wait(20)
        t0 = time.monotonic()
        with pytest.raises(CacheError) as ei:
            with cache.lock(key, timeout=0.4):
                pass
        assert 0.3 < time.monotonic() - t0 < 5
        msg = str(ei.value)
        assert str(cache.lock_path(key)) in msg and f"pid {p.pid}" in msg
    finally:
        release.set()
        p.join(20)
    with cache.lock(key, timeout=5) as path:  # free again
        assert path == cache.lock_path(key)
        assert f"pid={os.getpid()}" in path.read_text()


def test_lock_of_dead_holder_is_free(mokgen_cache: Path) -> None:
    key = cache.key_for(make_sources(), "sm_90a")
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_hold_lock_and_die, args=(key, str(mokgen_cache), ready))
    p.start()
    assert ready.wait(20)
    p.join(20)
    t0 = time.monotonic()
    with cache.lock(key, timeout=5):
        pass
    assert time.monotonic() - t0 < 2


def test_lock_survives_clear(mokgen_cache: Path, tmp_path: Path) -> None:
    """clear() unlinks lock files it can take; a lock taken after that is still exclusive."""
    s = make_sources()
    cache.store(fake_build(s, "sm_90a", tmp_path / "b"))
    key = cache.key_for(s, "sm_90a")
    with cache.lock(key):
        pass
    assert cache.clear() == 1
    with cache.lock(key):
        with pytest.raises(CacheError):
            with cache.lock(key, timeout=0.1):
                pass


def _race(key_sources: Any, root: str, start: Any, out: Any) -> None:
    os.environ["MOKGEN_CACHE_DIR"] = root
    start.wait(20)
    art = cache.get_or_build(key_sources, "sm_90a", slow_fake_build)
    out.put(str(art.dir))


def test_racing_processes_build_once(mokgen_cache: Path, build_log: Path) -> None:
    s = make_sources()
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(s, str(mokgen_cache), start, out)) for _ in range(4)]
    for p in procs:
        p.start()
    start.set()
    dirs = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(20)
        assert p.exitcode == 0
    assert builds(build_log) == 1
    assert len(set(dirs)) == 1 and cache.lookup(cache.key_for(s, "sm_90a"), "sm_90a") == Path(dirs[0])


# --------------------------------------------------------------------------------------- list / clear


def test_list_and_clear_per_arch(mokgen_cache: Path, tmp_path: Path) -> None:
    s = make_sources()
    e90 = cache.store(fake_build(s, "sm_90a", tmp_path / "a"))
    e100 = cache.store(fake_build(s, "sm_100a", tmp_path / "b"))
    entries = cache.list_entries()
    assert {(e.arch, e.path) for e in entries} == {("sm_90a", e90), ("sm_100a", e100)}
    assert entries[0].spec_name == "toy" and entries[0].size > 0
    assert [e.path for e in cache.list_entries("sm_100a")] == [e100]
    assert cache.clear("sm_100a") == 1
    assert [e.path for e in cache.list_entries()] == [e90] and not e100.exists()
    assert cache.clear() == 1 and cache.list_entries() == []


def test_clear_skips_entries_being_built(mokgen_cache: Path, tmp_path: Path) -> None:
    s = make_sources()
    art = fake_build(s, "sm_90a", tmp_path / "a")
    entry = cache.store(art)
    with cache.lock(art.key):
        assert cache.clear() == 0
        assert entry.exists()
    assert cache.clear() == 1


# ------------------------------------------------------------------------------------------ pack/unpack


@pytest.fixture
def fake_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for libcute_dsl_runtime.so (the real one is 43 MB: xz-ing it takes a while)."""
    p = tmp_path / "rt" / cache.RUNTIME_LIB
    p.parent.mkdir()
    p.write_bytes(b"\x7fELF fake runtime" * 100)
    monkeypatch.setattr(packs, "_dsl_runtime_for_pack", lambda: p)
    return p


def test_pack_unpack_round_trip(mokgen_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                fake_runtime: Path) -> None:
    s = make_sources()
    a90 = fake_build(s, "sm_90a", tmp_path / "a")
    a100 = fake_build(s, "sm_100a", tmp_path / "b")
    cache.store(a90)
    cache.store(a100)
    tar = packs.pack(tmp_path / "out" / "kernels.tar.xz")
    with tarfile.open(tar) as tf:
        names = tf.getnames()
    assert f"runtime/{cache.RUNTIME_LIB}" in names and "MANIFEST.json" in names
    assert f"sm_90a/{a90.key[:16]}/meta.json" in names and f"sm_100a/{a100.key[:16]}/libmokgen.so" in names
    only90 = packs.pack(tmp_path / "out" / "sm90.tar.xz", arch="sm_90a")
    with tarfile.open(only90) as tf:
        assert not any(n.startswith("sm_100a") for n in tf.getnames())

    # a fresh host
    other = tmp_path / "gpu-host-cache"
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(other))
    assert cache.list_entries() == []
    res = packs.unpack(tar)
    assert len(res["installed"]) == 2 and res["present"] == [] and res["runtime_status"] == "installed"
    assert cache.lookup(a90.key, "sm_90a") == other.resolve() / "sm_90a" / a90.key[:16]
    assert cache.lookup(a100.key, "sm_100a") is not None
    assert (other / "sm_90a" / a90.key[:16] / "libmokgen.so").read_bytes() == b"\x7fELF fake library"
    assert res["runtime"] == other.resolve() / "runtime" / cache.RUNTIME_LIB
    assert res["runtime"].read_bytes() == fake_runtime.read_bytes()
    assert not [p for p in other.iterdir() if p.name.startswith(".unpack")]
    # again: nothing new
    res2 = packs.unpack(tar)
    assert res2["installed"] == [] and len(res2["present"]) == 2 and res2["runtime_status"] == "present"


def test_unpack_refuses_bad_entries(mokgen_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_sources()
    good = fake_build(s, "sm_90a", tmp_path / "a")
    cache.store(good)
    bad = fake_build(make_sources(template_hash="x" * 16), "sm_90a", tmp_path / "b")
    bad_entry = cache.store(bad)
    (bad_entry / "libmokgen.so").write_bytes(b"tampered, other size")
    wrong = fake_build(make_sources(template_hash="y" * 16), "sm_100a", tmp_path / "c")
    wrong_entry = cache.store(wrong)
    # filed under sm_90a but built for sm_100a
    moved = mokgen_cache / "stage" / "sm_90a" / wrong_entry.name
    moved.parent.mkdir(parents=True)
    shutil.copytree(wrong_entry, moved)
    tar = tmp_path / "bad.tar.xz"
    with tarfile.open(tar, "w:xz") as tf:
        tf.add(cache.entry_dir(good.key, "sm_90a"), arcname=f"sm_90a/{good.key[:16]}")
        tf.add(bad_entry, arcname=f"sm_90a/{bad.key[:16]}")
        tf.add(moved, arcname=f"sm_90a/{wrong_entry.name}")
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "fresh"))
    # all or nothing: the good entry is not installed either, and nothing is written
    with pytest.raises(CacheError, match=r"refused, nothing installed") as ei:
        packs.unpack(tar)
    msg = str(ei.value)
    assert "no MANIFEST.json" in msg and f"sm_90a/{bad.key[:16]}/libmokgen.so does not match" in msg
    assert "says arch sm_100a" in msg
    assert not (tmp_path / "fresh").exists()


def test_unpack_rejects_unsafe_and_garbage(mokgen_cache: Path, tmp_path: Path) -> None:
    evil = tmp_path / "evil.tar.xz"
    payload = tmp_path / "payload"
    payload.write_text("x")
    with tarfile.open(evil, "w:xz") as tf:
        tf.add(payload, arcname="../escape.txt")
    with pytest.raises(CacheError, match="unsafe"):
        packs.unpack(evil)
    assert not (mokgen_cache.parent / "escape.txt").exists()
    junk = tmp_path / "junk.tar.xz"
    junk.write_bytes(b"not a tar")
    with pytest.raises(CacheError, match="not a readable"):
        packs.unpack(junk)
    with pytest.raises(CacheError, match="no such pack"):
        packs.unpack(tmp_path / "missing.tar.xz")


def test_pack_empty_cache_errors(mokgen_cache: Path, fake_runtime: Path, tmp_path: Path) -> None:
    with pytest.raises(CacheError, match="nothing to pack"):
        packs.pack(tmp_path / "x.tar.xz")


def test_find_falls_back_to_content_key_without_compiler(mokgen_cache: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    s = make_sources()
    entry = cache.store(fake_build(s, "sm_90a", tmp_path / "a"))
    assert cache.find(s, "sm_90a") == entry
    # a GPU host without the CuTe DSL: other DSL versions (none), same tvm-ffi -> found by content
    real = cache.dsl_versions()
    monkeypatch.setattr(cache, "dsl_versions", lambda: {"apache-tvm-ffi": real["apache-tvm-ffi"]})
    import importlib.util as iu

    orig = iu.find_spec
    monkeypatch.setattr(iu, "find_spec", lambda name, *a: None if name == "cutlass" else orig(name, *a))
    assert cache.find(s, "sm_90a") == entry
    assert cache.find(s, "sm_100a") is None


# --------------------------------------------------------------------------------------------- CLI


def test_cli_cache_commands(mokgen_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture,
                            fake_runtime: Path) -> None:
    from mokgen.cli import main

    assert main(["cache", "path"]) == 0
    assert capsys.readouterr().out.strip() == str(mokgen_cache.resolve())
    art = fake_build(make_sources(), "sm_90a", tmp_path / "a")
    cache.store(art)
    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert art.key[:16] in out and "toy" in out and "sm_90a" in out
    assert main(["cache", "pack", str(tmp_path / "p.tar.xz")]) == 0
    assert "packed 1 entry" in capsys.readouterr().out
    assert main(["cache", "clear"]) == 0
    assert "removed 1 entry" in capsys.readouterr().out
    assert main(["cache", "unpack", str(tmp_path / "p.tar.xz")]) == 0
    assert "installed" in capsys.readouterr().out
    assert main(["cache", "unpack", str(tmp_path / "nope.tar.xz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mokgen: error: no such pack") and len(err.strip().splitlines()) == 1


def test_pack_without_the_runtime(mokgen_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # no runtime library is looked for (this host may have none), none travels and the manifest names none
    monkeypatch.setattr(packs, "_dsl_runtime_for_pack", lambda: pytest.fail("the runtime was looked for"))
    s = make_sources()
    a90 = fake_build(s, "sm_90a", tmp_path / "a")
    cache.store(a90)
    tar = packs.pack(tmp_path / "out" / "entries.tar.xz", runtime=False)
    with tarfile.open(tar) as tf:
        names = tf.getnames()
        manifest = json.load(tf.extractfile("MANIFEST.json"))
    assert not any(n.startswith("runtime") for n in names) and "runtime" not in manifest
    assert f"sm_90a/{a90.key[:16]}/libmokgen.so" in names
    other = tmp_path / "gpu-host-cache"
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(other))
    res = packs.unpack(tar)
    assert len(res["installed"]) == 1 and res["runtime"] is None and res["runtime_status"] is None
    assert cache.lookup(a90.key, "sm_90a") == other.resolve() / "sm_90a" / a90.key[:16]

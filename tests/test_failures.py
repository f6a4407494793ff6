"""Issue 11, points 3, 4 and 6: every failure is one `mokgen: error:` line with exit 2 naming the path and a
remedy; spec bounds; honest status lines, process groups, stale temp dirs, lock timeout, --version."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers11 import failing_build, fake_build, make_sources, mounted_tmpfs, remount_ro
from mokgen import cache
from mokgen.cache import CacheError

REPO = Path(__file__).resolve().parents[1]


def _one_error_line(err: str, *fragments: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mokgen: error: "), err
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.fixture
def no_real_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CLI's compile goes down the build path (as where the compiler is) but must never compile."""
    from mokgen import build, driver

    monkeypatch.setattr(driver, "_dsl_available", lambda: True)
    monkeypatch.setattr(build, "build", failing_build)


# ------------------------------------------------------------------------------------------- point 3


def test_read_only_cache_miss(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                              no_real_build: None) -> None:
    from mokgen.cli import main

    with mounted_tmpfs(tmp_path / "ro", ro=True) as ro:
        monkeypatch.setenv("MOKGEN_CACHE_DIR", str(ro))
        assert main(["compile", "qwen3-30b-a3b", "--arch", "sm_90a"]) == 2
        _one_error_line(capsys.readouterr().err, str(ro), "read-only", "set MOKGEN_CACHE_DIR to a writable")
        monkeypatch.setenv("MOKGEN_CACHE_DIR", str(ro / "sub"))  # a missing directory on it
        assert main(["compile", "qwen3-30b-a3b", "--arch", "sm_90a"]) == 2
        _one_error_line(capsys.readouterr().err, str(ro / "sub"), "read-only")


def test_read_only_cache_with_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture) -> None:
    from mokgen.cli import main

    with mounted_tmpfs(tmp_path / "c", size="4m") as root:
        monkeypatch.setenv("MOKGEN_CACHE_DIR", str(root))
        s = make_sources()
        entry = cache.store(fake_build(s, "sm_90a", tmp_path / "b"))
        remount_ro(root)
        # a hit needs no write
        assert cache.get_or_build(s, "sm_90a", failing_build).dir == entry
        # clear says what it could not remove, and fails
        assert main(["cache", "clear"]) == 2
        cap = capsys.readouterr()
        assert "removed 0 entries" in cap.out
        assert f"not removed: {entry}: the file system is read-only" in cap.err
        assert cap.err.strip().splitlines()[-1].startswith("mokgen: error: 1 directory not removed")
        assert entry.is_dir()


def test_disk_full(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from mokgen.cli import main

    with mounted_tmpfs(tmp_path / "tiny", size="64k") as tiny:
        monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tiny / "cache"))
        art = fake_build(make_sources(), "sm_90a", tmp_path / "b", lib=os.urandom(256 * 1024))
        with pytest.raises(CacheError, match=r"cannot store the cache entry .*no space left on the device; free "
                                             r"space on that file system, or set MOKGEN_CACHE_DIR"):
            cache.store(art)
        leftovers = [p for p in (tiny / "cache" / "sm_90a").iterdir()]
        assert leftovers == []  # the temp dir went with the failure
        filler = tiny / "filler"
        with open(filler, "wb") as f:  # leave less room than the emitted sources need
            try:
                f.write(os.urandom(60 * 1024))
            except OSError:
                pass
        assert main(["emit", "kimi-k2", "--arch", "sm_90a", "--out", str(tiny / "src")]) == 2
        _one_error_line(capsys.readouterr().err, "no space left on the device", str(tiny / "src"))
        assert not [p for p in (tiny / "src").iterdir() if ".tmp." in p.name]


def test_cache_dir_not_a_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                                   no_real_build: None) -> None:
    from mokgen.cli import main

    f = tmp_path / "afile"
    f.write_text("x")
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(f))
    for argv in (["compile", "qwen3-30b-a3b", "--arch", "sm_90a"], ["cache", "list"], ["cache", "clear"],
                 ["cache", "verify"]):
        assert main(argv) == 2, argv
        _one_error_line(capsys.readouterr().err, f"the cache directory {f}", "is not a directory",
                        "set MOKGEN_CACHE_DIR")
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(f / "below"))  # a parent that is a file
    assert main(["compile", "qwen3-30b-a3b", "--arch", "sm_90a"]) == 2
    _one_error_line(capsys.readouterr().err, str(f / "below"), "not a directory", "MOKGEN_CACHE_DIR")


def test_permission_denied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "c"))
    (tmp_path / "c").mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m, *a, **k: False if str(p) == str(tmp_path / "c") else real(p, m))
    with pytest.raises(CacheError, match=r"cannot write to the cache directory .*permission denied; set "
                                         r"MOKGEN_CACHE_DIR to a writable directory"):
        cache.get_or_build(make_sources(), "sm_90a", failing_build)

    def denied(*a, **k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "c" / "sm_90a"))

    monkeypatch.setattr(os, "access", real)
    art = fake_build(make_sources(), "sm_90a", tmp_path / "b")
    monkeypatch.setattr(Path, "mkdir", denied)
    with pytest.raises(CacheError, match=r"cannot create the cache directory .*permission denied"):
        cache.store(art)


def test_output_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    from mokgen.cli import main

    f = tmp_path / "file"
    f.write_text("x")
    assert main(["emit", "kimi-k2", "--arch", "sm_90a", "--out", str(f)]) == 2
    _one_error_line(capsys.readouterr().err, f"--out {f} is not a directory")
    assert main(["emit", "kimi-k2", "--arch", "sm_90a", "--out", str(f / "sub")]) == 2
    _one_error_line(capsys.readouterr().err, "not a directory")
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "c"))
    assert main(["cache", "pack", str(tmp_path)]) == 2
    _one_error_line(capsys.readouterr().err, f"cannot write the pack {tmp_path}: it is a directory")
    assert main(["cache", "unpack", str(tmp_path)]) == 2
    _one_error_line(capsys.readouterr().err, "no such pack", "it is a directory")


def test_spec_file_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mokgen.cli import main

    latin = tmp_path / "latin.yaml"
    latin.write_bytes(b"name: caf\xe9\nhidden: 1024\n")
    assert main(["plan", str(latin), "--arch", "sm_90a"]) == 2
    _one_error_line(capsys.readouterr().err, f"{latin} is not UTF-8 text (byte 0xe9 at offset 9)")
    dup = tmp_path / "dup.yaml"
    dup.write_text("hidden: 1024\nffn: 512\nexperts: 8\ntopk: 2\ntokens: 256\nhidden: 2048\n")
    assert main(["plan", str(dup), "--arch", "sm_90a"]) == 2
    _one_error_line(capsys.readouterr().err, "line 6", "duplicate key 'hidden' (first at line 1)")
    d = tmp_path / "dir.yaml"
    d.mkdir()
    assert main(["plan", str(d), "--arch", "sm_90a"]) == 2
    _one_error_line(capsys.readouterr().err, "is a directory")


@pytest.mark.parametrize("jobs", ["-3", "0", "x", "1.5"])
def test_bad_jobs(jobs: str, capsys: pytest.CaptureFixture) -> None:
    from mokgen import build
    from mokgen.cli import main

    assert main(["compile", "kimi-k2", "--arch", "sm_90a", f"--jobs={jobs}"]) == 2
    _one_error_line(capsys.readouterr().err, "--jobs", "must be a positive integer", repr(jobs))
    with pytest.raises(build.BuildError, match="jobs must be a positive integer"):
        build.check_jobs(-3)


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture) -> None:
    from mokgen.cli import main

    assert main(["compile"]) == 2
    _one_error_line(capsys.readouterr().err, "SPEC")
    assert main(["cache", "nope"]) == 2
    _one_error_line(capsys.readouterr().err, "invalid choice")


def test_clear_reports_what_it_kept(mokgen_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from mokgen.cli import main

    a = cache.store(fake_build(make_sources(), "sm_90a", tmp_path / "a"))
    b = cache.store(fake_build(make_sources(template_hash="b" * 16), "sm_90a", tmp_path / "b"))
    key_a = cache.load_artifacts(a).key
    with cache.lock(key_a):
        assert main(["cache", "clear"]) == 2
    cap = capsys.readouterr()
    assert "removed 1 entry" in cap.out
    assert f"not removed: {a}: in use (lock" in cap.err and f"held by pid {os.getpid()}" in cap.err
    assert a.is_dir() and not b.exists()


def test_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOKGEN_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache.cache_root() == (tmp_path / "xdg" / "mokgen").resolve()
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored, as the spec says
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.cache_root() == (tmp_path / "home" / ".cache" / "mokgen").resolve()
    monkeypatch.setenv("MOKGEN_CACHE_DIR", str(tmp_path / "m"))  # wins
    assert cache.cache_root() == (tmp_path / "m").resolve()


# ------------------------------------------------------------------------------------------- point 4


@pytest.mark.parametrize("fields, path, fragment", [
    ({"hidden": 67108864}, "spec.hidden", "at most 16384"),
    ({"hidden": 16448}, "spec.hidden", "registers"),
    ({"topk": 65, "experts": 128}, "spec.topk", "at most 64"),
    ({"experts": 4096, "topk": 2}, "spec.ep", "at most 1651 on sm_90a: the routing kernel"),
    ({"ffn": 1048576, "hidden": 7168}, "spec.ffn", "GB of the largest sm_90a GPU; at most ffn="),
    ({"experts": 1 << 31}, "spec.experts", "int32 expert ids"),
    ({"name": "n" * 65}, "spec.name", "at most 64 characters"),
    ({"swiglu_limit": 1e39}, "spec.swiglu_limit", "bf16's largest value"),
])
def test_spec_upper_bounds(fields: dict, path: str, fragment: str) -> None:
    from mokgen.spec import SpecError, load_spec

    base = {"hidden": 1024, "ffn": 512, "experts": 8, "topk": 2, "tokens": 256}
    t0 = time.monotonic()
    with pytest.raises(SpecError) as ei:
        load_spec({**base, **fields})
    assert time.monotonic() - t0 < 1.0
    msg = str(ei.value)
    assert msg.startswith(path + ":") and fragment in msg and "\n" not in msg


def test_every_preset_is_within_bounds() -> None:
    from mokgen.spec import MAX_HIDDEN, device_bytes, list_presets

    for s in list_presets():
        assert s.hidden <= MAX_HIDDEN
        w, work = device_bytes(s)
        assert w + work < 141e9


def test_huge_hidden_is_refused_by_the_cli_quickly(tmp_path: Path) -> None:
    p = tmp_path / "huge.yaml"
    p.write_text("hidden: 67108864\nffn: 512\nexperts: 8\ntopk: 2\ntokens: 256\n")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mokgen", "compile", str(p), "--arch", "sm_90a"], capture_output=True,
                       text=True, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=60)
    assert r.returncode == 2 and time.monotonic() - t0 < 30
    _one_error_line(r.stderr, "spec.hidden: must be at most 16384")


# ------------------------------------------------------------------------------------------- point 6


def test_version(capsys: pytest.CaptureFixture) -> None:
    import mokgen
    from mokgen.cli import main

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"mokgen {mokgen.__version__}"


def test_waiting_process_says_it_loaded_the_other_build(mokgen_cache: Path) -> None:
    s = make_sources()
    key = cache.key_for(s, "sm_90a")
    started = threading.Event()
    res: dict = {}

    def slow(src, arch, out):
        started.set()
        time.sleep(0.6)
        return fake_build(src, arch, out)

    t = threading.Thread(target=lambda: res.setdefault("a", cache.get_or_build(s, "sm_90a", slow, progress=False)))
    t.start()
    assert started.wait(10)
    b = cache.get_or_build(s, "sm_90a", failing_build, progress=False)
    t.join()
    assert res["a"].status == "built"
    assert b.status == "waited" and b.dir == res["a"].dir
    assert f"loaded the build of pid {os.getpid()} (waited" in b.note
    assert cache.lookup(key, "sm_90a") == b.dir


def test_cli_compile_status_line(mokgen_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 capsys: pytest.CaptureFixture) -> None:
    from mokgen import cache as c, driver
    from mokgen.cli import main

    def fake_resolve(sources, arch, **kw):
        art = fake_build(sources, arch, tmp_path / "b")
        entry = c.store(art)
        return c.load_artifacts(entry, status="waited", note="loaded the build of pid 4242 (waited 3.0 s on its lock)")

    monkeypatch.setattr(driver, "resolve", fake_resolve)
    assert main(["compile", "qwen3-30b-a3b", "--arch", "sm_90a"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.endswith("kernel(s), loaded the build of pid 4242 (waited 3.0 s on its lock)")


def test_lock_timeout_env(mokgen_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = cache.key_for(make_sources(), "sm_90a")
    monkeypatch.setenv("MOKGEN_LOCK_TIMEOUT", "0.3")
    assert cache.lock_timeout() == 0.3
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from mokgen import cache\n"
        f"with cache.lock({key!r}):\n    print('held', flush=True); time.sleep(30)\n")],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert holder.stdout.readline().strip() == "held"
        t0 = time.monotonic()
        with pytest.raises(CacheError, match=rf"timed out after 0.3 s .*held by pid {holder.pid}.*MOKGEN_LOCK_TIMEOUT"):
            with cache.lock(key):
                pass
        assert time.monotonic() - t0 < 5
    finally:
        holder.kill()
        holder.wait()
    for bad in ("soon", "-1", "0", "inf"):
        monkeypatch.setenv("MOKGEN_LOCK_TIMEOUT", bad)
        with pytest.raises(CacheError, match="MOKGEN_LOCK_TIMEOUT"):
            cache.lock_timeout()


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_temp_dirs_of_dead_processes_are_removed(mokgen_cache: Path, tmp_path: Path) -> None:
    s = make_sources()
    other = make_sources(template_hash="o" * 16)
    dead = _dead_pid()
    arch_dir = mokgen_cache / "sm_90a"
    arch_dir.mkdir(parents=True)
    k_other = cache.key_for(other, "sm_90a")[:16]
    stale = [arch_dir / f"{k_other}.tmp.{dead}", arch_dir / f"{k_other}.del.{dead}.123",
             mokgen_cache / f".unpack.{dead}.abc"]
    live = arch_dir / f"{k_other}.tmp.{os.getppid()}"  # a live process's: kept
    for d in stale + [live]:
        (d / "sub").mkdir(parents=True)
        (d / "sub" / "f").write_text("x")
    art = cache.get_or_build(s, "sm_90a", lambda *a: fake_build(*a), progress=False)
    assert art.status == "built"
    assert [d for d in stale if d.exists()] == [] and live.is_dir()
    assert [e.path.name for e in cache.scan_entries()] == [art.dir.name]


def test_killed_build_stops_its_compilers(tmp_path: Path) -> None:
    """kill -9 of the process running ninja: ninja and the compile-one processes die with it."""
    out = tmp_path / "b"
    (out / "sources").mkdir(parents=True)
    pidfile = tmp_path / "pids"
    (out / "sources" / "k.py").write_text(
        "import os, time\n"
        f"open({str(pidfile)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "time.sleep(120)\n"
        'KERNEL_NAME = "k"\n')
    code = (
        "import sys; from pathlib import Path; from mokgen import build\n"
        f"out = Path({str(out)!r})\n"
        "build.write_ninja(out, {'k': 'k.py'}, [], 'sm_90a', [])\n"
        "build.run_ninja(out, 1, False, {'k': 'k.py'}, 'sm_90a')\n")
    driver = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        t0 = time.monotonic()
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() - t0 < 60, "compile-one never started"
            assert driver.poll() is None
            time.sleep(0.1)
        child = int(pidfile.read_text().split()[0])
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait()
        t0 = time.monotonic()
        while True:
            try:
                os.kill(child, 0)
                state = Path(f"/proc/{child}/stat").read_text().split()[2] if Path(f"/proc/{child}").exists() else "X"
            except ProcessLookupError:
                break
            if state == "Z":
                break  # dead, waiting for its (re)parent to reap it
            assert time.monotonic() - t0 < 10, "the compiler outlived the killed build"
            time.sleep(0.1)
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in (int(x) for x in (pidfile.read_text().split() if pidfile.exists() else [])):
            try:
                os.kill(pid, signal.SIGKILL)  # only if the test failed: the compiler we started
            except ProcessLookupError:
                pass

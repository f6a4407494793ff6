"""tools/ncu_summary.py and tools/ncu_source.py on small Nsight Compute exports written here (no GPU, no ncu):
each column in its own unit whatever unit ncu chose for the report, and the per-instruction stall summary."""

import csv
import gzip
import importlib.util
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"tool_{name}", TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _raw(path: Path, time_unit: str, times: list[str], write_unit: str = "Mbyte") -> None:
    hdr = ["ID", "Kernel Name", "gpu__time_duration.sum", "dram__bytes_write.sum", "gpc__cycles_elapsed.avg.per_second"]
    units = ["", "", time_unit, write_unit, "Ghz"]
    rows = [[str(i), f"kernel_cutlass_{i}", t, "2", "1.5"] for i, t in enumerate(times)]
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows([hdr, units, *rows])


def test_ncu_summary_converts_each_column_to_its_unit(tmp_path):
    S = _tool("ncu_summary")
    labels = tmp_path / "labels.txt"
    labels.write_text("label kimi-k2 gemm1_train\nlabel kimi-k2 gemm2\n")
    _raw(tmp_path / "us.csv", "us", ["653.4", "12.5"], write_unit="Gbyte")
    _raw(tmp_path / "ms.csv", "ms", ["0.6534", "0.0125"])
    us, ms = S.load(tmp_path / "us.csv", labels), S.load(tmp_path / "ms.csv", labels)
    for a, b in zip(us, ms):
        assert a["ms"] == pytest.approx(b["ms"]) and a["units"]["ms"] == b["units"]["ms"] == "ms"
    assert us[0]["dram_write_mb"] == pytest.approx(2000.0) and us[0]["units"]["dram_write_mb"] == "MB"
    assert ms[0]["dram_write_mb"] == pytest.approx(2.0) and ms[0]["sm_ghz"] == pytest.approx(1.5)
    _raw(tmp_path / "bad.csv", "furlong", ["1", "2"])
    with pytest.raises(SystemExit, match="column ms needs a time unit, ncu gave 'furlong'"):
        S.load(tmp_path / "bad.csv", labels)


def _source(path: Path, kernels: list[list[tuple[str, int, dict]]]) -> None:
    reasons = ["stall_long_sb", "stall_barrier", "stall_wait"]
    hdr = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"] + reasons
    with gzip.open(path, "wt", newline="") as f:
        w = csv.writer(f)
        for i, lines in enumerate(kernels):
            w.writerow(["Kernel Name", f"kernel_cutlass_{i}"])
            w.writerow(hdr)
            for n, (sass, samples, why) in enumerate(lines):
                w.writerow([hex(n * 16), f"  {sass}", samples, 100] + [why.get(r[6:], 0) for r in reasons])


def test_ncu_source_summarizes_stalls_per_instruction(tmp_path):
    S = _tool("ncu_source")
    _source(tmp_path / "src.csv.gz", [
        [("QGMMA.64x128x32", 30, {"wait": 5}), ("FMUL R1, R2, R3", 60, {"long_sb": 60}), ("FFMA", 10, {"wait": 10})],
        [("HGMMA.64x256x16", 10, {"wait": 10})],
    ])
    labels = tmp_path / "labels.txt"
    labels.write_text("label kimi-k2-fp8 gemm1_train\nlabel kimi-k2-fp8 gemm2\n")
    ks = S.kernels(tmp_path / "src.csv.gz", labels)
    assert [k["label"] for k in ks] == ["kimi-k2-fp8/gemm1_train", "kimi-k2-fp8/gemm2"]
    s = S.summarize(ks[0], top=2)
    assert s["samples"] == 100 and s["stall_pct"] == {"long_sb": 60.0, "other": 25.0, "wait": 15.0}
    assert [(t["line"], t["sass"], t["samples_pct"]) for t in s["top_lines"]] == [
        (0, "QGMMA.64x128x32", 30.0), (1, "FMUL R1, R2, R3", 60.0)]
    assert s["top_lines"][0]["reasons"] == {"other": 25, "wait": 5}
    labels.write_text("label kimi-k2-fp8 gemm1_train\n")
    with pytest.raises(SystemExit, match="2 kernels in .* but 1 labels"):
        S.kernels(tmp_path / "src.csv.gz", labels)

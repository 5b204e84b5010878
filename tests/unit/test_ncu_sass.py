"""benchmarks/ncu_sass.py on a small export in the layout `ncu --page source --csv
--print-source sass` writes: totals per stall reason, the unexplained samples as "other", the
top instructions and the windows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","# Samples","stall_long_sb",'
          '"stall_wait","stall_long_sb (Not Issued)"')
CSV = '''"Kernel Name","_k",
''' + HEADER + '''
"0x0","      SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R1+0x10], R2","10","10","0","10","0"
"0x10","      @!P0  BRA 0x0","900","900","880","20","880"
"0x20","      HGMMA.64x32x16.F32.BF16 R152, gdesc[UR4], R152","300","300","0","20","0"
'''


def test_ncu_sass_summary(tmp_path, monkeypatch, capsys):
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "ncu_sass.py"
    spec = importlib.util.spec_from_file_location("ncu_sass", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    export = tmp_path / "sass.csv"
    export.write_text(CSV)
    monkeypatch.setattr(sys, "argv", ["ncu_sass.py", str(export), "--top", "2", "--window", "2"])
    tool.main()
    out = capsys.readouterr().out
    assert "1210 samples over 3 instructions" in out
    assert "long_sb" in out and "880" in out
    assert "other 280" in out  # the HGMMA's samples without a reason column
    assert "SYNCS" not in out.split("top 2")[1].split("per window")[0]  # only the 2 largest
    windows = out.split("per window")[1].strip().splitlines()[1:]
    assert [w.split()[:2] for w in windows] == [["0", "910"], ["2", "300"]]

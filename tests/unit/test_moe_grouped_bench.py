"""benchmarks/moe_grouped.py on a CPU machine: its --smoke run (tiny shapes, the Triton kernels
interpreted, every variant checked against its reference, the table printed), --help, and a
clear refusal of a real run without a GPU."""

from __future__ import annotations

import pytest
import torch
from triton_interp import FP8_KERNELS, interpreted


@pytest.fixture(scope="module")
def fl():
    yield from interpreted(*FP8_KERNELS)


def test_smoke_run_prints_the_table(fl, load_benchmark, capsys, tmp_path):
    bench = load_benchmark("moe_grouped")
    out = tmp_path / "table.md"
    argv = ["--smoke", "--sweep", "bf16,fp8,w8a8", "--pairs", "2,8,512", "--out", str(out)]
    assert bench.main(argv) == 0
    table = out.read_text()
    assert "| pairs | proj | kernel |" in table
    for pairs in (2, 8):  # 512 is dropped from a smoke run (the interpreter is slow)
        for proj in ("w13", "w13+act", "w2"):
            for kernel in ("torch._grouped_mm", "triton bf16 16×32×128", "triton fp8"):
                assert f"| {pairs} | {proj} | {kernel}" in table
            for kind in ("bf16", "fp8") + (("w8a8",) if proj != "w13+act" else ()):
                assert f"| {pairs} | {proj} | triton {kind} sweep best" in table
    assert "| 512 |" not in table and "CHECK FAILED" not in table
    assert table in capsys.readouterr().out


def test_smoke_split_sweep(fl, load_benchmark, tmp_path):
    """--sweep split: the default bf16 and FP8 tiles with their K range split, each checked."""
    bench = load_benchmark("moe_grouped")
    out = tmp_path / "table.md"
    assert bench.main(["--smoke", "--sweep", "split", "--pairs", "2", "--out", str(out)]) == 0
    table = out.read_text()
    for proj in ("w13", "w13+act", "w2"):
        for kind in ("bf16", "fp8"):
            assert f"| 2 | {proj} | triton {kind} sweep best" in table
    assert "w8a8 sweep best" not in table and "CHECK FAILED" not in table


def test_help_and_errors(load_benchmark, capsys):
    bench = load_benchmark("moe_grouped")
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--help"])
    assert e.value.code == 0 and "--sweep" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--smoke", "--copies", "0"])
    assert e.value.code == 2 and "--copies" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--smoke", "--sweep", "bf16,int4"])
    assert e.value.code == 2 and "--sweep" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            bench.main([])
        assert e.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err

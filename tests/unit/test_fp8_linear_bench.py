"""benchmarks/fp8_linear.py on a CPU machine: its GLM-5.3 shapes, --help, and a clear refusal
without a GPU (the timing itself runs on the device machine)."""

from __future__ import annotations

import pytest
import torch

from dsaserve.model.presets import GLM_5_3


def test_projection_shapes(load_benchmark):
    bench = load_benchmark("fp8_linear")
    shapes = {p.name: (p.n, p.k) for p in bench.projections(GLM_5_3)}
    assert shapes["q_a"] == (2048, 6144) and shapes["q_b"] == (64 * 256, 2048)
    assert shapes["kv_a"] == (576, 6144) and shapes["o_proj"] == (6144, 64 * 256)
    assert shapes["routed_w13"] == (4096, 6144) and shapes["routed_w2"] == (6144, 2048)


def test_help_and_errors(load_benchmark, capsys):
    bench = load_benchmark("fp8_linear")
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--help"])
    assert e.value.code == 0 and "--sweep" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bench.parse_args(["--only", "q_a,nope"])
    assert e.value.code == 2 and "unknown projection" in capsys.readouterr().err
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as e:
            bench.main(["--m", "1"])
        assert e.value.code == 2 and "needs a CUDA device" in capsys.readouterr().err

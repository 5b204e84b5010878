"""benchmarks/long_prefill.py runs end to end on the CPU at tiny size (so the H200 command cannot
rot), and its pure helpers (lengths, kernel categories, busy time, floor) do what the tables
claim."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from dsaserve.bench import profile
from dsaserve.config import ModelConfig, ParallelConfig
from dsaserve.model.make_model import build_config
from dsaserve.model.presets import glm53_shaped
from dsaserve.plan.costmodel import prefill_flops

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "long_prefill.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("long_prefill", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["long_prefill"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("long_prefill", None)


def test_lengths_and_categories(bench):
    assert [bench.parse_length(x) for x in ("4096", "4K", "128k", "1M")] == \
        [4096, 4096, 131072, 1 << 20]
    with pytest.raises(ValueError, match="--lengths"):
        bench.parse_length("1G")
    assert bench.human(1 << 20) == "1M" and bench.human(131072) == "128K"
    # GLM-5.3 has 2^20 positions: a "1M" prompt leaves its output token room
    assert bench.fit_lengths([4096, 1 << 20, 1 << 21], 1 << 20) == [4096, (1 << 20) - 1]
    names = {
        "_indexer_logits_kernel": "indexer logits", "indexer_logits_kernel<2, 4>": "indexer logits",
        "topk_rows_kernel": "top-k", "_threshold_kernel": "top-k",
        "_sparse_mla_gluon_kernel": "sparse MLA", "_merge_splits_kernel": "sparse MLA",
        "_dequantize_pages_kernel": "workspace dequant", "_rms_norm_kernel": "norms + rotary",
        "_rotary_kernel": "norms + rotary", "Memcpy HtoD (Pageable -> Device)": "copies",
        "_write_mla_fp8_kernel": "copies",
        "nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT": "MoE + GEMMs",
        "sm90_xmma_gemm_bf16bf16_bf16f32": "MoE + GEMMs", "aten::mm": "MoE + GEMMs",
        "_sparse_mla_pingpong_kernel": "sparse MLA",
        # PyTorch's grouped GEMM (the routed experts): a CUTLASS Pingpong kernel
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel"
        "13GemmUniversalINS_5tupleIJiiiEEENS_4gemm10collective13CollectiveMmaINS_10"
        "KernelTmaWarpSpecializedPingpong": "MoE + GEMMs",
        # ... whose epilogue's template arguments name a copy type
        "_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel"
        "13GemmUniversalIN4cute40AutoVectorizingCopyWithAssumedAlignmentILi128EEE": "MoE + GEMMs",
        "void cutlass::Kernel2<cutlass_80_simt_sgemm_64x64_8x5_tn_align1>": "MoE + GEMMs",
        "void at::native::vectorized_elementwise_kernel<4>": "other",
        # W8A8 (kernels/triton/fp8_w8a8.py): the quantization goes with its GEMMs
        "_w8a8_kernel": "MoE + GEMMs", "_grouped_w8a8_kernel": "MoE + GEMMs",
        "_act_quant_kernel": "MoE + GEMMs",
    }
    assert {n: profile.classify(n) for n in names} == names
    # Overlapping and nested spans count once: [0, 3] ∪ [1, 2] ∪ [5, 6] = 4.
    assert profile.union_length([(5.0, 6.0), (0.0, 3.0), (1.0, 2.0)]) == 4.0


def test_floor_is_the_issue_table(bench):
    """The floor of a GLM-5.3-shaped 2-layer model at the measured rates: 0.31 s at 128K and
    11.4 s at 1M on one H200 (issue 34's table)."""
    module = bench
    config = build_config("glm-5.3", with_mtp=False, overrides=glm53_shaped(2))
    flops = prefill_flops(ModelConfig.from_hf(config), ParallelConfig())
    floor = [module.floor_seconds(flops, 0, n, module.INDEXER_TFLOPS, module.MLA_TFLOPS)
             for n in (131072, 1 << 20)]
    assert floor[0] == pytest.approx(0.31, abs=0.01) and floor[1] == pytest.approx(11.4, abs=0.1)
    # chunks add up to the whole prompt
    halves = sum(module.floor_seconds(flops, a, b, 887.0, 480.0)
                 for a, b in ((0, 65536), (65536, 131072)))
    assert halves == pytest.approx(floor[0])


def test_smoke_on_cpu(bench, tmp_path):
    out = tmp_path / "table.md"
    assert bench.main(["--smoke", "--lengths", "128,384", "--max-num-batched-tokens", "128",
                       "--gaps", "3", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| 128 |" in text and "| 384 |" in text
    assert "CPU operator time by category" in text
    # --gaps: no device work on a CPU, so every step is one gap (three chunks → three), each
    # instant under the engine's step
    section = text.split("exposed host time of the 384 prompt", 1)[1]
    assert "mid 0.000 ms, tail 0.000 ms in 3 gaps" in section
    assert "| engine.step > " in section
    # the per-chunk table of the longest prompt: three chunks of 128 at positions 0, 128, 256
    for i, first in enumerate((0, 128, 256)):
        assert f"| {i} | {first} | 128 |" in text


def test_smoke_async_scheduling_same_tokens(bench, tmp_path):
    """--async-scheduling pipelines the chunks; the prompts' tokens are the synchronised run's,
    and every chunk is still listed once."""
    tokens = []
    for extra in ([], ["--async-scheduling"]):
        out = tmp_path / f"table{len(extra)}.md"
        assert bench.main(["--smoke", "--lengths", "128,384", "--max-num-batched-tokens", "128",
                           "--no-profile", "--out", str(out), *extra]) == 0
        rows = [line.split("|") for line in out.read_text().splitlines()
                if line.startswith(("| 128 |", "| 384 |"))]
        tokens.append([r[-2].strip() for r in rows])
        assert "exposed host time" not in out.read_text()  # --gaps is off by default
        if extra:
            assert "async scheduling" in out.read_text()
            for i, first in enumerate((0, 128, 256)):
                assert f"| {i} | {first} | 128 |" in out.read_text()
    assert tokens[0] == tokens[1] and len(tokens[0]) == 2


def test_bad_flags(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--smoke", "--max-num-batched-tokens", "0"])
    with pytest.raises(SystemExit):  # the reference backend has no indexer config to fix
        bench.parse_args(["--smoke", "--logits-split", "keys"])


@pytest.mark.parametrize(("argv", "first_col", "time_col"), [
    (["--chunk", "64", "--at", "0,4096"], ["0", "4096"], 2),  # docs/long_prefill.md's table
    (["--decode", "2,3", "--at", "100"], ["2", "3"], 3),  # docs/decode.md's block-table table
], ids=["prefill", "decode"])
def test_prepare_host_time_runs(capsys, argv, first_col, time_col):
    """benchmarks/prepare_host_time.py, tiny: a row per point, each with a time."""
    path = _PATH.parent / "prepare_host_time.py"
    spec = importlib.util.spec_from_file_location("prepare_host_time", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main([*argv, "--repeats", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == first_col
    assert all(float(r.split("|")[time_col]) > 0 for r in rows[1:])

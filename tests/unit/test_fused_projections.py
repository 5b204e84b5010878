"""model/fused.py: projections of one input merged into one matrix after loading."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dsaserve.kernels.fp8_weights import quantize_blocks
from dsaserve.model import fp8, fused


def _linear(n_in: int, n_out: int, seed: int) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    layer.weight.requires_grad_(False)
    layer.weight.copy_(torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(seed)))
    return layer


def _fp8(n_in: int, n_out: int, seed: int) -> fp8.Fp8Linear:
    g = torch.Generator().manual_seed(seed)
    layer = fp8.Fp8Linear(n_in, n_out)
    wq, scale = quantize_blocks(torch.randn(n_out, n_in, generator=g))
    layer.weight.data, layer.weight_scale_inv.data = wq, scale
    return layer


def _inside(view: torch.Tensor, whole: torch.Tensor) -> bool:
    start = whole.data_ptr()
    end = start + whole.numel() * whole.element_size()
    return start <= view.data_ptr() < end


def _assert_members(group, layers, x, want) -> None:
    """Each member's columns of the group's product are its own output, and its weight (an FP8
    one's scale too) is a view of the merged matrix."""
    for w, g, m in zip(want, group(x), layers, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
        assert _inside(m.weight, group.merged.weight)
        if isinstance(m, fp8.Fp8Linear):
            assert _inside(m.weight_scale_inv, group.merged.weight_scale_inv)


def test_linear_group_gives_each_members_output_and_shares_its_storage():
    layers = [_linear(32, n, seed) for seed, n in enumerate((48, 16, 24))]
    x = torch.randn(5, 32)
    want = [m(x) for m in layers]
    group = fused.fuse(layers)
    assert group is not None
    _assert_members(group, layers, x, want)
    # a weight loaded again in place is what the merged product uses
    layers[1].weight.copy_(torch.zeros(16, 32))
    assert group(x)[1].abs().max() == 0
    torch.testing.assert_close(group(x)[0], want[0], rtol=1e-6, atol=1e-6)


def test_fp8_group_puts_the_partial_block_member_last_and_stacks_the_scales():
    # call order q_a (256 rows), kv_a (200: ends inside a block), wk (128): stored q_a, wk, kv_a
    layers = [_fp8(256, n, seed) for seed, n in enumerate((256, 200, 128))]
    x = torch.randn(4, 256)
    want = [m(x) for m in layers]
    group = fused.fuse(layers)
    assert group is not None
    assert group.bounds == ((0, 256), (384, 584), (256, 384))
    assert group.merged.weight_scale_inv.shape == (2 + 1 + 2, 2)
    _assert_members(group, layers, x, want)
    for w, m in zip(want, layers, strict=True):
        torch.testing.assert_close(m(x), w, rtol=0, atol=0)  # the members still work alone


def test_fp8_group_in_whole_blocks_pads_zero_rows_and_drops_their_columns():
    """whole_blocks: the same group's 584 rows padded to 640 (five whole blocks, the shape
    cuBLAS's block-scaled GEMM takes: fp8_w8a8.cublas_takes on a CUDA device), the padding
    zero bytes under the partial member's last scale; each member's output as before, the
    padding's columns never returned; a group already in whole blocks is not padded."""
    from dsaserve.kernels.triton import fp8_w8a8

    layers = [_fp8(512, n, seed) for seed, n in enumerate((256, 200, 128))]
    x = torch.randn(4, 512)
    want = [m(x) for m in layers]
    group = fused.fuse(layers, whole_blocks=True)
    assert group is not None
    assert group.merged.weight.shape == (640, 512)
    assert group.merged.weight_scale_inv.shape == (5, 4)
    assert not group.merged.weight[584:].view(torch.uint8).any()
    assert fp8_w8a8.cublas_takes(640, 512, 0, 0, torch.device("cuda"))
    outs = group(x)
    assert [o.shape[1] for o in outs] == [256, 200, 128]
    _assert_members(group, layers, x, want)
    for w, m in zip(want, layers, strict=True):
        torch.testing.assert_close(m(x), w, rtol=0, atol=0)
    whole = fused.fuse([_fp8(512, 256, 7), _fp8(512, 128, 8)], whole_blocks=True)
    assert whole.merged.weight.shape == (384, 512)


@pytest.mark.parametrize("case", ["two partial blocks", "a shard inside a block", "mixed kinds",
                                  "other inputs", "one member"])
def test_groups_that_cannot_be_fused_are_left_apart(case):
    if case == "two partial blocks":
        layers = [_fp8(128, 200, 0), _fp8(128, 72, 1)]
    elif case == "a shard inside a block":
        layers = [_fp8(128, 256, 0), _fp8(128, 256, 1)]
        layers[1].shard_(rows=(64, 192))  # starts 64 rows into its first block
    elif case == "mixed kinds":
        layers = [_fp8(128, 128, 0), _linear(128, 64, 1)]
    elif case == "other inputs":
        layers = [_linear(32, 16, 0), _linear(48, 16, 1)]
    else:
        layers = [_linear(32, 16, 0)]
    before = [m.weight.data_ptr() for m in layers]
    assert fused.fuse(layers) is None
    assert [m.weight.data_ptr() for m in layers] == before


@pytest.mark.parametrize("preset", ["tiny-glm5", "tiny-dsv32"])
def test_engine_fuses_every_group_and_computes_what_it_did_apart(preset, model_dirs,
                                                                  engine_config, monkeypatch):
    from test_model_vs_hf import _prompt, run_chunks

    from dsaserve.engine import runner as runner_mod
    from dsaserve.model.dsa import MLP, MLAAttention

    config = engine_config(model_dirs[preset], block_size=16, num_blocks=8)
    ids = _prompt(config.model.vocab_size)
    fused_runner = runner_mod.ModelRunner(config)
    attention = [m for m in fused_runner.model.modules() if isinstance(m, MLAAttention)]
    mlps = [m for m in fused_runner.model.modules() if isinstance(m, MLP)]
    assert attention and mlps
    assert all(m.x_proj is not None for m in attention)
    # q_b with the indexer's wq_b: layers that share another layer's selection have no indexer
    assert all((m.qr_proj is not None) == (m.indexer is not None) for m in attention)
    assert all(m.gate_up is not None for m in mlps)
    monkeypatch.setattr(runner_mod, "fuse_model", lambda model: 0)
    apart = runner_mod.ModelRunner(config)
    assert all(m.x_proj is None for m in apart.model.modules() if isinstance(m, MLAAttention))
    for chunks in ([48], [40] + [1] * 8):
        torch.testing.assert_close(run_chunks(fused_runner, ids, chunks, 16),
                                   run_chunks(apart, ids, chunks, 16), rtol=1e-5, atol=1e-5)

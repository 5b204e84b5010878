"""CUDA-graph sizes, padding and flags (engine/cudagraph.py, --compilation-config,
--enforce-eager): everything that does not need a GPU; replay against eager is in
tests/gpu/test_cudagraph_gpu.py."""

from __future__ import annotations

import argparse

import pytest
import torch

from dsaserve.config import CompilationConfig, ConfigError
from dsaserve.engine import cudagraph
from dsaserve.engine.args import add_engine_args


def test_default_sizes_are_vllms_buckets_up_to_the_largest_decode_batch():
    assert cudagraph.default_capture_sizes(1) == (1,)
    assert cudagraph.default_capture_sizes(6) == (1, 2, 4, 6)
    assert cudagraph.default_capture_sizes(16) == (1, 2, 4, 8, 16)
    sizes = cudagraph.default_capture_sizes(64, num_speculative_tokens=3)  # 256 tokens
    assert sizes[:5] == (1, 2, 4, 8, 16) and sizes[-2:] == (248, 256)
    sizes = cudagraph.default_capture_sizes(100, num_speculative_tokens=3)  # 400 tokens
    assert sizes == (1, 2, 4, *range(8, 256, 8), *range(256, 401, 16))
    assert cudagraph.default_capture_sizes(35)[-3:] == (24, 32, 35)  # the largest batch ends it


@pytest.mark.parametrize("n,want", [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (16, 16), (17, None)])
def test_padded_size_is_the_next_capture_size(n, want):
    assert cudagraph.padded_size(n, (1, 2, 4, 8, 16)) == want


def test_pad_to_fills_the_tail():
    t = torch.tensor([3, 4, 5])
    assert cudagraph.pad_to(t, 5, -1).tolist() == [3, 4, 5, -1, -1]
    assert cudagraph.pad_to(t, 3, -1) is t


def test_no_graphs_on_the_cpu_or_when_eager():
    on = CompilationConfig()
    assert cudagraph.capture_sizes(on, torch.device("cpu"), 8) == ()
    assert cudagraph.capture_sizes(CompilationConfig(enforce_eager=True),
                                   torch.device("cuda"), 8) == ()
    assert cudagraph.capture_sizes(on, torch.device("cuda"), 8) == (1, 2, 4, 8)
    given = CompilationConfig.from_json('{"cudagraph_capture_sizes": [8, 1, 2, 8]}')
    assert cudagraph.capture_sizes(given, torch.device("cuda"), 64) == (1, 2, 8)


def _parse(*argv):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_args(parser)
    return parser.parse_args(argv)


def test_flags_parse_and_bad_input_names_the_flag():
    args = _parse("--compilation-config", '{"cudagraph_capture_sizes": [1, 4]}', "--enforce-eager")
    c = CompilationConfig.from_json(args.compilation_config, args.enforce_eager)
    assert c == CompilationConfig(cudagraph_capture_sizes=(1, 4), enforce_eager=True)
    for bad, needle in [('{"cudagraph_capture_sizes": [0]}', "cudagraph_capture_sizes"),
                        ('{"cudagraph_capture_sizes": "1,2"}', "cudagraph_capture_sizes"),
                        ('{"level": 3}', "unknown keys")]:
        with pytest.raises(ConfigError, match=f"--compilation-config: .*{needle}"):
            CompilationConfig.from_json(bad)
        with pytest.raises(argparse.ArgumentError, match=needle):
            _parse("--compilation-config", bad)


def test_graph_pool_refuses_cpu_tensors():
    pool = cudagraph.GraphPool(lambda x: x * 2)
    with pytest.raises(RuntimeError, match="CUDA"):
        pool.capture(1, {"x": torch.zeros(1)})

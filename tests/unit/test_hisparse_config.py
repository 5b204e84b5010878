"""HiSparse flags (vLLM's spellings) and the start-up errors that name them."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from dsaserve.config import ConfigError, HiSparseConfig, ParallelConfig, SpecConfig
from dsaserve.engine.args import add_engine_args, engine_config_from_args
from dsaserve.engine.engine import LLMEngine

HS = ('{"kv_connector":"HiSparseConnector","kv_role":"kv_both",'
      '"kv_connector_extra_config":{"host_pool_gib":0.01}}')
OFF = ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
       '"kv_connector_extra_config":{"cpu_bytes_to_use":8388608}}')


@pytest.fixture
def parse(model_dirs):
    def run(argv: list[str]):
        parser = add_engine_args(argparse.ArgumentParser())
        return engine_config_from_args(parser.parse_args(argv), str(model_dirs["tiny-glm5"]))

    return run


def test_connector_alone_and_defaults(parse):
    cfg = parse(["--kv-transfer-config", HS])
    assert cfg.hisparse == HiSparseConfig(host_pool_bytes=int(0.01 * 2**30))
    assert not cfg.offload.enabled
    topk = cfg.model.index_topk
    assert cfg.hisparse_buffer_rows == 2 * topk  # (1 query row + 1) × top-k
    mtp = parse(["--kv-transfer-config", HS,
                 "--speculative-config", '{"method":"mtp","num_speculative_tokens":3}'])
    assert mtp.hisparse_buffer_rows == 5 * topk  # vLLM: (4 + 1) × top-k with MTP3
    sized = parse(["--kv-transfer-config", HS,
                   "--attention-config", '{"hisparse_config":{"device_buffer_size":40}}'])
    assert sized.hisparse_buffer_rows == 40
    assert parse([]).hisparse is None
    assert sized.attention.hisparse_device_mla_pages is None  # no spilling unless asked
    spill = parse(["--kv-transfer-config", HS, "--attention-config",
                   '{"hisparse_config":{"device_mla_pages":300}}'])
    assert spill.attention.hisparse_device_mla_pages == 300
    auto = parse(["--kv-transfer-config", HS, "--attention-config",
                  '{"hisparse_config":{"device_mla_pages":"auto"}}'])
    assert auto.attention.hisparse_device_mla_pages == "auto"


def test_multi_connector_with_offload(parse):
    multi = ('{"kv_connector":"MultiConnector","kv_role":"kv_both",'
             f'"kv_connector_extra_config":{{"connectors":[{OFF},{HS}]}}}}')
    cfg = parse(["--kv-transfer-config", multi])
    assert cfg.hisparse is not None and cfg.offload.cpu_bytes_to_use == 8388608


@pytest.mark.parametrize("argv,flag", [
    (["--attention-config", '{"hisparse_config":{"device_buffer_size":8}}',
      "--kv-transfer-config", HS], "--attention-config"),  # below query rows × top-k
    (["--attention-config", '{"hisparse_config":{"device_buffer_size":40000}}'],
     "--attention-config"),  # above 32768
    (["--attention-config", '{"hisparse_config":{"device_buffer_size":64}}'],
     "--attention-config"),  # without the connector
    (["--attention-config", '{"hisparse_config":{"size":64}}'], "--attention-config"),
    (["--attention-config", '{"hisparse_config":{"device_mla_pages":0}}',
      "--kv-transfer-config", HS], "--attention-config"),
    (["--attention-config", '{"hisparse_config":{"device_mla_pages":"many"}}',
      "--kv-transfer-config", HS], "--attention-config"),
    (["--attention-config", '{"hisparse_config":{"device_mla_pages":64}}',
      "--kv-transfer-config", HS, "--kv-offloading-size", "1"], "--attention-config"),
    (["--attention-config", '{"hisparse_config":{"device_mla_pages":"auto"}}',
      "--kv-transfer-config", HS, "--kv-offloading-size", "1"], "--attention-config"),
    (["--kv-transfer-config", HS.replace("0.01", "0")], "--kv-transfer-config"),
    (["--kv-transfer-config", '{"kv_connector":"MultiConnector"}'], "--kv-transfer-config"),
    (["--kv-transfer-config", '{"kv_connector":"MultiConnector","kv_connector_extra_config":'
      f'{{"connectors":[{HS},{HS}]}}}}'], "--kv-transfer-config"),
    (["--kv-transfer-config", HS, "--speculative-config",
      '{"method":"mtp","num_speculative_tokens":3}', "--attention-config",
      '{"hisparse_config":{"device_buffer_size":32}}'], "--attention-config"),  # MTP3: 4 × 16
])
def test_bad_flags_name_themselves(parse, argv, flag):
    with pytest.raises((ConfigError, SystemExit)) as e:
        parse(argv)
    if e.type is ConfigError:
        assert str(e.value).startswith(flag), str(e.value)


def _base(engine_config, model_dirs):
    cfg = engine_config(model_dirs["tiny-glm5"], max_model_len=160)
    return replace(cfg, hisparse=HiSparseConfig(host_pool_bytes=16 << 20))


def test_model_without_indexer(engine_config, model_dirs):
    cfg = _base(engine_config, model_dirs)
    with pytest.raises(ConfigError, match="--kv-transfer-config: .*indexer"):
        replace(cfg, model=replace(cfg.model, index_topk=0))


def test_dcp_refused(engine_config, model_dirs):
    cfg = _base(engine_config, model_dirs)
    par = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)
    with pytest.raises(ConfigError, match="--kv-transfer-config: .*decode-context-parallel"):
        replace(cfg, parallel=par)


def test_host_pool_below_one_request(engine_config, model_dirs):
    cfg = replace(_base(engine_config, model_dirs), hisparse=HiSparseConfig(host_pool_bytes=4096))
    with pytest.raises(ConfigError, match="--kv-transfer-config: host_pool_gib .* less than one"):
        LLMEngine.from_config(cfg)


def test_mtp_needs_room_for_verify_rows(engine_config, model_dirs):
    cfg = _base(engine_config, model_dirs)
    with pytest.raises(ConfigError, match="smaller than the top-k union"):
        replace(cfg, speculative=SpecConfig(num_speculative_tokens=3),
                attention=replace(cfg.attention, hisparse_device_buffer_size=32,
                                  hisparse_config_given=True))

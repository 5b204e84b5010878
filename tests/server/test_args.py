"""Engine and server flags: vLLM's names and defaults, rejections that name the flag, and model
resolution (directories, presets built once and atomically, unknown names)."""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import pytest

from dsaserve import cli as top_cli
from dsaserve.config import ConfigError, ModelConfig
from dsaserve.engine.args import (
    CACHE_DIR_ENV,
    add_engine_args,
    engine_config_from_args,
    models_cache_dir,
    resolve_model,
)
from dsaserve.engine.engine import check_device
from dsaserve.model.presets import DEFAULT_MODEL, preset_config
from dsaserve.serve import cli as serve_cli


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsaserve")
    serve_cli.add_parser(parser.add_subparsers(dest="command"))
    return parser


def parse_serve(*argv: str) -> argparse.Namespace:
    return serve_parser().parse_args(["serve", *argv])


@pytest.fixture(scope="module")
def model_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["tiny-glm5"]


def test_defaults_are_vllm_defaults(model_dir: Path) -> None:
    args = parse_serve()
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert serve_cli.model_from_args(args) == DEFAULT_MODEL
    config = engine_config_from_args(args, str(model_dir))
    assert config.model_path == str(model_dir)
    assert (config.scheduler.max_model_len, config.scheduler.max_num_seqs,
            config.scheduler.max_num_batched_tokens) == (4096, 64, 2048)
    assert (config.cache.block_size, config.cache.kv_cache_dtype,
            config.cache.gpu_memory_utilization, config.cache.enable_prefix_caching,
            config.cache.num_gpu_blocks) == (64, "auto", 0.9, True, None)
    # --attention-backend auto: triton on a CUDA device, reference on the CPU (as vLLM picks)
    backend = "triton" if config.device.startswith("cuda") else "reference"
    assert (config.dtype, config.seed, config.attention.backend) == ("auto", 0, backend)
    assert config.speculative is None and config.num_speculative_tokens == 0
    assert config.step_log is None
    assert config.attention.sparse_mla_force_mqa is False
    assert config.device in ("cpu", "cuda")
    assert config.parallel.world_size == 1


def test_every_flag_reaches_the_config(model_dir: Path, tmp_path: Path) -> None:
    args = parse_serve(
        str(model_dir), "--served-model-name", "glm", "--host", "0.0.0.0", "--port", "9001",
        "--api-key", "k", "--max-model-len", "1024", "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256", "--block-size", "32", "--kv-cache-dtype", "fp8_ds_mla",
        "--gpu-memory-utilization", "0.5", "--num-gpu-blocks-override", "99",
        "--no-enable-prefix-caching", "--seed", "3", "--dtype", "bfloat16", "--attention-config",
        '{"sparse_mla_force_mqa": true}', "--attention-backend", "triton", "--device", "cuda:1",
        # 2 x 2 ranks per replica x 2 replicas = 8 EP ranks: the tiny model's 8 experts
        "-tp", "2", "-pcp", "2", "-dcp", "2", "-dp", "2", "--enable-expert-parallel",
        "--dcp-comm-backend", "ag_rs", "--cp-kv-cache-interleave-size", "32",
        "--step-log", str(tmp_path / "steps.jsonl"))
    model = serve_cli.model_from_args(args)
    server = serve_cli.server_config_from_args(args, model)
    assert (server.served_model_name, server.host, server.port, server.api_key) == (
        "glm", "0.0.0.0", 9001, "k")
    assert server.timeout_keep_alive_s > 300  # long agent sessions keep their connection
    c = engine_config_from_args(args, model)
    assert (c.scheduler.max_model_len, c.scheduler.max_num_seqs,
            c.scheduler.max_num_batched_tokens) == (1024, 8, 256)
    assert (c.cache.block_size, c.cache.kv_cache_dtype, c.cache.gpu_memory_utilization,
            c.cache.num_gpu_blocks, c.cache.enable_prefix_caching) == (
        32, "fp8_ds_mla", 0.5, 99, False)
    assert (c.seed, c.dtype, c.device) == (3, "bfloat16", "cuda:1")
    assert c.step_log == str(tmp_path / "steps.jsonl")
    assert (c.attention.backend, c.attention.sparse_mla_force_mqa) == ("triton", True)
    p = c.parallel
    assert (p.tensor_parallel_size, p.prefill_context_parallel_size,
            p.decode_context_parallel_size, p.data_parallel_size, p.enable_expert_parallel,
            p.dcp_comm_backend, p.cp_kv_cache_interleave_size) == (2, 2, 2, 2, True, "ag_rs", 32)
    assert p.expert_parallel_size == 8


@pytest.mark.parametrize("argv, message", [
    (["--max-num-seqs", "0"], "argument --max-num-seqs: expected an integer >= 1, got '0'"),
    (["--max-model-len", "4k"], "argument --max-model-len: expected an integer >= 1, got '4k'"),
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: expected a number"),
    (["--kv-cache-dtype", "fp16"], "argument --kv-cache-dtype: invalid choice: 'fp16'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice"),
    (["--attention-config", "{bad"], "argument --attention-config: invalid JSON"),
    (["--attention-config", '{"force": 1}'], "argument --attention-config: unknown keys ['force']"),
    (["--attention-config", '{"sparse_mla_force_mqa": 1}'],
     "argument --attention-config: sparse_mla_force_mqa must be true or false"),
    (["--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    # `--api-key "$KEY"` with KEY unset: it served without a key
    (["--api-key", ""], "argument --api-key: expected a non-empty key"),
    (["--seed", str(2**64)], "argument --seed: expected an integer in [0, 2**64)"),  # traceback
    (["--port", "70000"], "argument --port: expected a port in [0, 65535], got '70000'"),
    (["-tp", "0"], "argument -tp/--tensor-parallel-size: expected an integer >= 1"),
    (["--dcp-comm-backend", "nccl"], "argument --dcp-comm-backend: invalid choice"),
    (["--speculative-config", "{bad"], "argument --speculative-config: invalid JSON"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 0}'],
     "argument --speculative-config: num_speculative_tokens must be an integer >= 1, got 0"),
    (["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3, '
      '"rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.99, '
      '"synthetic_acceptance_rates": [1, 1, 0]}'],
     "argument --speculative-config: give synthetic_acceptance_length or "
     "synthetic_acceptance_rates, not both"),
    (["--attention-backend", "cuda"], "argument --attention-backend: invalid choice: 'cuda'"),
    (["--tool-call-parser", "hermes"], "argument --tool-call-parser: invalid choice: 'hermes'"),
    (["--reasoning-parser", "qwen3"], "argument --reasoning-parser: invalid choice: 'qwen3'"),
    (["--step-log", "/no/such/dir/steps.jsonl"],
     "argument --step-log: cannot write '/no/such/dir/steps.jsonl': no directory '/no/such/dir'"),
    (["--step-log", "/"], "argument --step-log: '/' is a directory, expected a file"),
    # --kv-events-config: a string for a bool, a port past 65535 were accepted
    (["--kv-events-config", '{"enable_kv_cache_events": "yes"}'],
     "argument --kv-events-config: enable_kv_cache_events must be true or false, got 'yes'"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq", '
      '"endpoint": "tcp://127.0.0.1:99999"}'],
     "argument --kv-events-config: endpoint's port must be in [1, 65535], got "
     "'tcp://127.0.0.1:99999'"),
    (["--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq", '
      '"endpoint": "tcp://127.0.0.1"}'],
     "argument --kv-events-config: endpoint must be tcp://HOST:PORT"),
    (["--kv-events-config", '{"max_queue_size": true}'],
     "argument --kv-events-config: max_queue_size must be an integer, got True"),
    (["--kv-events-config", '{"max_queue_size": 0}'],
     "argument --kv-events-config: max_queue_size must be >= 1, got 0"),
    (["--kv-events-config", '{"topic": 5}'], "argument --kv-events-config: topic must be a string"),
    (["--kv-events-config", "[1]"], "argument --kv-events-config: expected a JSON object"),
    (["--kv-events-config", '{"port": 1}'], "argument --kv-events-config: unknown keys ['port']"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
    (["--max-model", "10"], "unrecognized arguments: --max-model"),  # no abbreviations
])
def test_bad_flags_exit_naming_the_flag(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        parse_serve(*argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--block-size", "48"], "--block-size: must be a positive power of two, got 48"),
        (
            ["--max-model-len", "99999"],
            "--max-model-len: 99999 exceeds the model's max_position_embeddings 4096",
        ),
        (
            ["-pcp", "2", "-dcp", "3"],
            "--decode-context-parallel-size: with PCP the DCP group is the PCP",
        ),
        (
            ["-tp", "2", "-dcp", "2", "--dcp-comm-backend", "a2a", "-pcp", "2"],
            "--dcp-comm-backend: PCP × DCP supports only 'ag_rs'",
        ),
        (["-tp", "4", "-dcp", "2"], "without PCP, DCP reuses the TP ranks"),
    ],
)
def test_bad_combinations_name_the_flag(model_dir: Path, argv, message, capsys) -> None:
    with pytest.raises(ConfigError, match=message):
        engine_config_from_args(parse_serve(*argv), str(model_dir))
    # The sub-command's entry point turns it into a usage error (exit 2), before any engine.
    with pytest.raises(SystemExit) as e:
        serve_cli.main([str(model_dir), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_a_device_this_machine_lacks_is_a_usage_error(model_dir: Path, capsys) -> None:
    """Was a traceback from deep inside the model's build (AssertionError: Torch not compiled
    with CUDA enabled); now a usage error naming --device, before any engine is built."""
    with pytest.raises(ConfigError, match="--device: cuda:99 is not available"):
        check_device("cuda:99")
    check_device("cpu")
    with pytest.raises(SystemExit) as e:
        serve_cli.main([str(model_dir), "--device", "cuda:99"])
    assert e.value.code == 2 and "--device: cuda:99 is not available" in capsys.readouterr().err


def test_no_room_for_one_request_is_a_usage_error(model_dir: Path, capsys) -> None:
    """A block too large for the KV budget was a ValueError traceback from the model runner."""
    with pytest.raises(SystemExit) as e:
        serve_cli.main([str(model_dir), "--device", "cpu", "--block-size", str(2**40)])
    assert e.value.code == 2
    assert "--gpu-memory-utilization: room for 0 KV blocks" in capsys.readouterr().err


def test_a_listen_address_this_machine_lacks_is_a_usage_error(model_dir: Path, monkeypatch,
                                                              capsys) -> None:
    """--host 999.1.1.1 failed only once the engine was built, with uvicorn's message naming no
    flag; now a usage error naming --host (or --port: a port in use), before any engine."""
    from dsaserve.engine.engine import LLMEngine

    def no_engine(*_: object) -> None:
        raise AssertionError("the engine was built before the address was checked")

    monkeypatch.setattr(LLMEngine, "from_config", no_engine)
    with pytest.raises(SystemExit) as e:
        serve_cli.main([str(model_dir), "--host", "999.1.1.1"])
    assert e.value.code == 2 and "--host: cannot resolve '999.1.1.1'" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--host: cannot resolve"):
        serve_cli.check_listen_address("no-such-host.invalid", 8000)
    with pytest.raises(ConfigError, match="--host: 192.0.2.1 is not an address of this machine"):
        serve_cli.check_listen_address("192.0.2.1", 0)  # TEST-NET-1: never a local address
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--port: cannot listen on 127.0.0.1:{port} "
                                              r"\(Address already in use"):
            serve_cli.check_listen_address("127.0.0.1", port)
    serve_cli.check_listen_address("127.0.0.1", 0)
    serve_cli.check_listen_address("localhost", 0)


@pytest.mark.parametrize("argv, message", [
    # each was an out-of-memory traceback from the cache's or the block table's allocation
    (["--num-gpu-blocks-override", str(10**12)],
     "--num-gpu-blocks-override: 1000000000000 KV blocks need "),
    (["--max-num-seqs", str(10**12)], "--max-num-seqs: 1000000000000 requests' block-table rows "
     "of 64 block ids (each running request also holds at least one of the "),
])
def test_impossible_memory_requests_are_usage_errors(model_dir: Path, argv, message,
                                                     capsys) -> None:
    with pytest.raises(SystemExit) as e:
        serve_cli.main([str(model_dir), "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "GiB of RAM" in err
    assert "Traceback" not in err


def test_speculative_config_reaches_the_engine_config(model_dir: Path) -> None:
    c = engine_config_from_args(parse_serve(
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 3}'), str(model_dir))
    assert c.speculative is not None and c.num_speculative_tokens == 3
    assert not c.speculative.synthetic
    c = engine_config_from_args(parse_serve("--speculative-config", json.dumps(
        {"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": "synthetic",
         "synthetic_acceptance_length": 2.99})), str(model_dir))
    assert c.speculative.synthetic_acceptance_rates == (1.0, 0.99, 0.0)


def test_speculative_config_needs_an_mtp_layer(tmp_path: Path, capsys) -> None:
    from dsaserve.model.make_model import make_model

    no_mtp = make_model("tiny-glm5", tmp_path / "no-mtp", with_mtp=False)
    argv = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 1}']
    with pytest.raises(ConfigError, match="--speculative-config: the checkpoint .* has no MTP"):
        engine_config_from_args(parse_serve(*argv), str(no_mtp))
    with pytest.raises(SystemExit) as e:
        serve_cli.main([str(no_mtp), *argv])
    assert e.value.code == 2 and "--speculative-config" in capsys.readouterr().err


def test_generate_reports_the_acceptance_length(model_dir: Path, capsys) -> None:
    """`generate --report-timing` with synthetic acceptance 2.99 (k = 3): 1 + 2 tokens per step
    once the drafts run (the last steps verify fewer drafts as max_tokens nears)."""
    spec = ('{"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": '
            '"synthetic", "synthetic_acceptance_length": 2.99}')
    rc = top_cli.main(["generate", "--model", str(model_dir), "--prompt", "The ferry",
                       "--max-tokens", "14", "--ignore-eos", "--device", "cpu", "--block-size",
                       "16", "--num-gpu-blocks-override", "64", "--max-model-len", "256",
                       "--speculative-config", spec, "--report-timing"])
    assert rc == 0
    err = capsys.readouterr().err
    length = float(err.split("mean acceptance length ")[1].split()[0])
    assert 2.5 <= length <= 3.0 and "with 3 MTP drafts" in err


def test_generate_writes_the_step_log(model_dir: Path, tmp_path: Path, capsys) -> None:
    """`generate --step-log`: a line per step; 1 + accepted drafts tokens per verifying step,
    their sum the tokens generated."""
    spec = ('{"method": "mtp", "num_speculative_tokens": 3, "rejection_sample_method": '
            '"synthetic", "synthetic_acceptance_length": 2.99}')
    log = tmp_path / "steps.jsonl"
    rc = top_cli.main(["generate", "--model", str(model_dir), "--prompt", "The ferry",
                       "--max-tokens", "14", "--ignore-eos", "--device", "cpu", "--block-size",
                       "16", "--num-gpu-blocks-override", "64", "--max-model-len", "256",
                       "--speculative-config", spec, "--step-log", str(log)])
    assert rc == 0
    lines = [json.loads(t) for t in log.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(len(lines)))
    assert lines[0]["num_prefill_rows"] > 0 and lines[0]["num_drafts"] == 0
    assert sum(line["num_sampled"] for line in lines) == 14
    for line in lines[1:]:
        assert line["num_reqs"] == line["num_sampling_reqs"] == 1
        assert line["num_sampled"] == 1 + line["num_accepted"] <= 1 + line["num_drafts"]


@pytest.mark.parametrize("device, flag, backend", [
    ("cpu", "auto", "reference"), ("cuda", "auto", "triton"), ("cuda:1", "auto", "triton"),
    ("cuda", "reference", "reference"), ("cpu", "triton", "triton"),
])
def test_attention_backend_auto_follows_the_device(model_dir: Path, device, flag, backend) -> None:
    args = parse_serve("--device", device, "--attention-backend", flag)
    assert engine_config_from_args(args, str(model_dir)).attention.backend == backend


def test_top_level_cli_routes_serve(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        top_cli.main(["serve", "--max-num-seqs", "-3"])
    assert e.value.code == 2
    assert "--max-num-seqs" in capsys.readouterr().err


def test_tool_flags_reach_the_server_config(model_dir: Path, capsys) -> None:
    args = parse_serve("--enable-auto-tool-choice", "--tool-call-parser", "glm47",
                       "--reasoning-parser", "glm45")
    c = serve_cli.server_config_from_args(args, "m")
    assert (c.enable_auto_tool_choice, c.tool_call_parser, c.reasoning_parser) == (
        True, "glm47", "glm45")
    c = serve_cli.server_config_from_args(parse_serve(), "m")
    assert (c.enable_auto_tool_choice, c.tool_call_parser, c.reasoning_parser) == (
        False, None, None)
    # auto tool choice without a parser: a usage error before any engine is built
    with pytest.raises(SystemExit) as e:
        serve_cli.main([str(model_dir), "--enable-auto-tool-choice"])
    assert e.value.code == 2
    assert "--enable-auto-tool-choice: needs --tool-call-parser" in capsys.readouterr().err


def test_model_positional_and_flag_must_agree() -> None:
    assert serve_cli.model_from_args(parse_serve("--model", "tiny-dsv32")) == "tiny-dsv32"
    assert serve_cli.model_from_args(parse_serve("tiny-dsv32")) == "tiny-dsv32"
    with pytest.raises(ConfigError, match="--model: 'tiny-glm5' contradicts MODEL 'tiny-dsv32'"):
        serve_cli.model_from_args(parse_serve("tiny-dsv32", "--model", "tiny-glm5"))


def test_engine_args_work_on_any_parser(model_dir: Path) -> None:
    """`generate` shares the flags: add_engine_args composes with a parser's own arguments."""
    parser = add_engine_args(argparse.ArgumentParser())
    parser.add_argument("--prompt")
    args = parser.parse_args(["--prompt", "x", "--block-size", "16"])
    assert engine_config_from_args(args, str(model_dir)).cache.block_size == 16


# ------------------------------------------------------------------------------------------------
# resolve_model
# ------------------------------------------------------------------------------------------------
def test_resolve_model_directory_and_unknown(model_dir: Path, tmp_path: Path) -> None:
    assert resolve_model(str(model_dir)) == model_dir
    with pytest.raises(ConfigError, match="--model: 'no-such-model' is neither"):
        resolve_model("no-such-model")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="--model"):
        resolve_model(str(tmp_path / "file"))
    with pytest.raises(ConfigError, match="--model: .*config.json not found"):
        engine_config_from_args(parse_serve(), str(tmp_path))


def test_cache_dir_default_and_override(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CACHE_DIR_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert models_cache_dir() == tmp_path / ".cache" / "dsaserve" / "models"
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "elsewhere"))
    assert models_cache_dir() == tmp_path / "elsewhere"


def test_preset_is_built_once_into_the_cache(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    from dsaserve.model import make_model as make_model_module

    calls: list[Path] = []
    real = make_model_module.make_model

    def counting(preset: str, out_dir: Path) -> Path:
        calls.append(Path(out_dir))
        return real(preset, out_dir)

    monkeypatch.setattr(make_model_module, "make_model", counting)
    path = resolve_model("tiny-dsv32")
    assert path == tmp_path / "tiny-dsv32"
    assert ModelConfig.from_file(path).model_type == "deepseek_v32"
    assert (path / "tokenizer.json").is_file()
    assert resolve_model("tiny-dsv32") == path
    assert len(calls) == 1 and calls[0].parent == tmp_path and calls[0] != path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-dsv32"]  # no temp dir left


def test_losing_a_build_race_uses_the_winner(monkeypatch, tmp_path: Path) -> None:
    """Another process renames its build into place while ours runs: ours is discarded."""
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    from dsaserve.model import make_model as make_model_module

    def racing(preset: str, out_dir: Path) -> Path:
        winner = tmp_path / preset
        winner.mkdir()
        (winner / "config.json").write_text(json.dumps(preset_config(preset)))
        (Path(out_dir) / "config.json").write_text("{}")  # our (different) copy
        return Path(out_dir)

    monkeypatch.setattr(make_model_module, "make_model", racing)
    path = resolve_model("tiny-glm5")
    assert ModelConfig.from_file(path).model_type == "glm_moe_dsa"  # the winner's files
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-glm5"]


def test_failed_build_leaves_nothing(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    from dsaserve.model import make_model as make_model_module

    def broken(preset: str, out_dir: Path) -> Path:
        (Path(out_dir) / "half").write_text("x")
        raise OSError("disk full")

    monkeypatch.setattr(make_model_module, "make_model", broken)
    with pytest.raises(OSError, match="disk full"):
        resolve_model("tiny-glm5")
    assert list(tmp_path.iterdir()) == []

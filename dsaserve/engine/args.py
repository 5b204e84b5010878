"""Engine flags shared by `dsaserve generate` and `dsaserve serve`, with vLLM's names and defaults.

Flags are validated where the message is clearest: argparse `type=` validators reject malformed
values (`argument --max-num-seqs: expected an integer >= 1, got '0'`), and the frozen configs reject
combinations (their ConfigError messages start with the flag's name). Users who know vLLM's command
line can therefore start dsaserve with the same flags.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    CompilationConfig,
    ConfigError,
    DisaggConfig,
    EngineConfig,
    FP8WeightConfig,
    HiSparseConfig,
    ModelConfig,
    OffloadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpecConfig,
)
from dsaserve.model.presets import DEFAULT_MODEL, TINY_PRESETS, TRAINED_MODEL, trained_model_dir

CACHE_DIR_ENV = "DSASERVE_CACHE_DIR"


# ------------------------------------------------------------------------------------------------
# argparse `type=` validators: the message argparse prints is "argument --flag: <message>"
# ------------------------------------------------------------------------------------------------
def int_at_least(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    return parse


def _seed(text: str) -> int:
    """What torch's generators take (a larger one was a traceback from torch.manual_seed)."""
    value = int_at_least(0)(text)
    if value >= 2**64:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, 2**64), got {text!r}")
    return value


def _fraction(text: str) -> float:
    """A float in (0, 1] (memory fractions)."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}")
    return value


def json_flag(flag: str, parse: Callable[[str], object]) -> Callable[[str], str]:
    """An argparse type for a JSON flag: checked by its config's parser at parse time, so a typo
    is reported there; kept as text, built for real once the model and the other flags are
    known (e.g. the attention backend, the model's MTP layer, --enforce-eager)."""

    def check(text: str) -> str:
        try:
            parse(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix(f"{flag}: ")) from None
        return text

    return check


def resolve_attention_backend(name: str, device: str) -> str:
    """`auto` picks the fast kernels where they run (as vLLM picks its backend): `triton` on a
    CUDA device, `reference` on the CPU."""
    if name != "auto":
        return name
    return "triton" if device.startswith("cuda") else "reference"


def _gib(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"expected a size in GiB > 0, got {text!r}")
    return value


def _appendable_file(text: str) -> str:
    """A file the process can create or append to (checked now, opened by the engine)."""
    path = Path(text).expanduser()
    parent = path.parent
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: no directory {str(parent)!r}")
    if not os.access(path if path.exists() else parent, os.W_OK):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: permission denied")
    return str(path)


def _device(text: str) -> str:
    kind, _, index = text.partition(":")
    if kind not in ("cpu", "cuda") or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


# ------------------------------------------------------------------------------------------------
# Flags
# ------------------------------------------------------------------------------------------------
def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine flags (vLLM's names and defaults) to `parser`; returns it for chaining."""
    pos = int_at_least(1)
    g = parser.add_argument_group("engine")
    g.add_argument("--max-model-len", type=pos, default=4096,
                   help="longest prompt + output, in tokens (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=pos, default=64,
                   help="most requests running at once (default: %(default)s)")
    g.add_argument("--max-logprobs", type=int_at_least(0), default=20,
                   help="most top log-probabilities a request may ask for per token "
                        "(logprobs / top_logprobs; default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=pos, default=2048,
                   help="most tokens computed in one step; longer prefills are chunked "
                        "(default: %(default)s)")
    g.add_argument("--block-size", type=pos, default=64,
                   help="tokens per KV block, a power of two (default: %(default)s)")
    g.add_argument("--kv-cache-dtype", choices=("auto", "fp8_ds_mla"), default="auto",
                   help="auto: the model dtype; fp8_ds_mla: FlashMLA's 656-byte rows")
    g.add_argument("--gpu-memory-utilization", type=_fraction, default=0.9,
                   help="fraction of device memory for weights + KV (default: %(default)s)")
    g.add_argument("--num-gpu-blocks-override", type=pos, default=None,
                   help="fixed number of KV blocks instead of sizing from memory")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse KV blocks of identical prompt prefixes (default: on)")
    g.add_argument("--seed", type=_seed, default=0,
                   help="engine seed for sampling (default: %(default)s)")
    g.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="weight / activation dtype; auto: the checkpoint's")
    g.add_argument("--quantization", "-q", choices=("fp8",), default=None,
                   help="fp8: matrices in FP8 with 128x128 block scales, kept in FP8 on every "
                        "device (a bf16 checkpoint is quantized at load); default: an FP8 "
                        "checkpoint is kept in FP8 on a GPU, dequantized on the CPU")
    g.add_argument("--attention-config", default=None,
                   type=json_flag("--attention-config", AttentionConfig.from_json),
                   help='JSON object, e.g. \'{"sparse_mla_force_mqa": true}\'')
    g.add_argument("--attention-backend", choices=("auto", "reference", "triton"), default="auto",
                   help="attention kernels; auto: triton on a CUDA device, reference on the CPU "
                        "(default: %(default)s)")
    g.add_argument("--speculative-config", default=None,
                   type=json_flag("--speculative-config", SpecConfig.from_json),
                   help='MTP speculative decoding, JSON, e.g. \'{"method": "mtp", '
                        '"num_speculative_tokens": 3}\'; benchmarks: add '
                        '"rejection_sample_method": "synthetic" and '
                        '"synthetic_acceptance_length": 2.99; "draft_lm_head": "fp8" or '
                        '"model" (default auto: fp8 with FP8 weights kept); "draft_vocab": a '
                        "JSON file of the token ids drafts may propose (dsaserve draft-vocab)")
    g.add_argument("--compilation-config", default=None,
                   type=json_flag("--compilation-config", CompilationConfig.from_json),
                   help='JSON, e.g. \'{"cudagraph_capture_sizes": [1, 2, 4, 8]}\': decode batch '
                        "sizes (tokens) captured as CUDA graphs; default: buckets up to "
                        "--max-num-seqs x (1 + drafts) (docs/decode.md)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never use CUDA graphs (always on the CPU)")
    g.add_argument("--async-scheduling", action="store_true",
                   help="schedule the next step while the device runs this one; tokens reach "
                        "the host one step later (docs/decode.md)")
    g.add_argument("--device", type=_device, default=None,
                   help="cpu, cuda or cuda:N (default: cuda if available, else cpu)")
    g.add_argument("--step-log", type=_appendable_file, default=None, metavar="PATH",
                   help="append one JSON line per engine step to PATH: wall and host time, "
                        "the batch, drafts accepted, CUDA graph, GPU forward time "
                        "(docs/decode.md; summarise with python -m dsaserve.bench.steplog)")

    o = parser.add_argument_group("host KV tier (vLLM names; docs/offload.md)")
    o.add_argument("--kv-offloading-size", type=_gib, default=None, metavar="GIB",
                   help="host memory for KV blocks, the engine's total over its ranks (off when "
                        "absent); prefixes evicted from the GPU are loaded back from there")
    o.add_argument("--kv-offloading-backend", choices=("native",), default=None,
                   help="how the host tier is built (native: dsaserve's own)")
    o.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                   help='the same as a connector: \'{"kv_connector":"OffloadingConnector",'
                        '"kv_role":"kv_both","kv_connector_extra_config":'
                        '{"cpu_bytes_to_use":N}}\'; "HiSparseConnector" with '
                        '{"host_pool_gib":G} (hybrid HiSparse decode, docs/hisparse.md); P/D '
                        '(docs/disagg.md): \'{"kv_connector":"NixlConnector","kv_role":'
                        '"kv_both","kv_connector_extra_config":{"backend":"nixl"|"shm"}}\'; '
                        'several: "MultiConnector" with {"connectors":[...]}')

    p = parser.add_argument_group("parallel (vLLM names)")
    p.add_argument("-tp", "--tensor-parallel-size", type=pos, default=1)
    p.add_argument("-pcp", "--prefill-context-parallel-size", type=pos, default=1)
    p.add_argument("-dcp", "--decode-context-parallel-size", type=pos, default=1,
                   help="shards the KV cache over the PCP (or TP) ranks; not extra ranks")
    p.add_argument("-dp", "--data-parallel-size", type=pos, default=1,
                   help="engine replicas behind one API, each request on one of them "
                        "(default: 1)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="shard the routed experts over every rank, with --data-parallel-size "
                        "over every replica's ranks (the replicas then step together)")
    p.add_argument("--dcp-comm-backend", choices=("ag_rs", "a2a"), default="ag_rs")
    p.add_argument("--cp-kv-cache-interleave-size", type=pos, default=1,
                   help="tokens per round-robin unit of KV ownership under DCP (default: 1)")
    return parser


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """Resolve `model` and build the frozen config tree from parsed engine flags.

    Raises ConfigError whose message starts with the offending flag; command-line front ends turn it
    into an argparse-style usage error (exit status 2).
    """
    path = resolve_model(model)
    try:
        model_config = ModelConfig.from_file(path)
    except ConfigError as e:
        raise ConfigError(f"--model: {path}: {e}") from e
    parallel = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        prefill_context_parallel_size=args.prefill_context_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        dcp_comm_backend=args.dcp_comm_backend,
        cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size,
    )
    speculative = SpecConfig.from_json(args.speculative_config)
    if speculative is not None:
        from dsaserve.model.loader import checkpoint_has_mtp  # deferred: imports torch

        if not checkpoint_has_mtp(path, model_config):
            raise ConfigError(f"--speculative-config: the checkpoint {path} has no MTP layer "
                              "(num_nextn_predict_layers is 0 or its weights are absent)")
    device = args.device or _default_device()
    if args.quantization == "fp8" and model_config.fp8_weights is None:
        model_config = replace(model_config, fp8_weights=FP8WeightConfig())  # quantized at load
    return EngineConfig(
        model_path=str(path),
        model=model_config,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_dtype=args.kv_cache_dtype,
            num_gpu_blocks=args.num_gpu_blocks_override,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            async_scheduling=args.async_scheduling,
            max_logprobs=args.max_logprobs,
        ),
        attention=AttentionConfig.from_json(
            args.attention_config,
            backend=resolve_attention_backend(args.attention_backend, device)),
        parallel=parallel,
        speculative=speculative,
        compilation=CompilationConfig.from_json(args.compilation_config, args.enforce_eager),
        offload=OffloadConfig.from_flags(args.kv_offloading_size, args.kv_offloading_backend,
                                         args.kv_transfer_config),
        hisparse=HiSparseConfig.from_transfer_json(args.kv_transfer_config),
        disagg=DisaggConfig.from_json(args.kv_transfer_config),
        dtype=args.dtype,
        device=device,
        seed=args.seed,
        keep_fp8_weights=True if args.quantization == "fp8" else None,
        step_log=args.step_log,
    )


def _default_device() -> str:
    import torch  # deferred: argument parsing and --help stay fast

    return "cuda" if torch.cuda.is_available() else "cpu"


# ------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------
def models_cache_dir() -> Path:
    """Where built-in presets are built: `$DSASERVE_CACHE_DIR`, else `~/.cache/dsaserve/models`."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dsaserve" / "models"


def resolve_model(name_or_path: str = DEFAULT_MODEL) -> Path:
    """A model directory: an existing directory as is, the shipped trained model (`tiny-trained`),
    or a tiny random preset built once into the cache.

    Presets are built into a temporary sibling directory and renamed into place, so a directory
    under the cache is always complete and concurrent processes (parallel test runs) never see half
    a model: the loser of a race discards its copy and uses the winner's.
    """
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path == TRAINED_MODEL:
        shipped = trained_model_dir()
        if not (shipped / "config.json").is_file():
            raise ConfigError(f"--model {TRAINED_MODEL}: the package has no trained checkpoint "
                              f"at {shipped} (an install without package data?)")
        return shipped
    if name_or_path not in TINY_PRESETS:
        raise ConfigError(
            f"--model: {name_or_path!r} is neither a model directory nor a built-in preset "
            f"(presets: {', '.join(sorted([TRAINED_MODEL, *TINY_PRESETS]))})"
        )
    final = models_cache_dir() / name_or_path
    if final.is_dir():
        return final
    from dsaserve.model.make_model import make_model  # deferred: imports torch

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name_or_path}.", dir=final.parent))
    try:
        make_model(name_or_path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left after a successful rename
    return final

"""Weight loading: Hugging Face safetensors checkpoints (bf16/fp32 or FP8 block-quantized) → module.

The module names its parameters (and persistent buffers) exactly like the checkpoint, except the
routed experts, which it stacks:

    checkpoint                                       module
    model.layers.{i}.mlp.experts.{e}.gate_proj.weight  → model.layers.{i}.mlp.experts.w13[e, 0:I]
    model.layers.{i}.mlp.experts.{e}.up_proj.weight    → model.layers.{i}.mlp.experts.w13[e, I:2I]
    model.layers.{i}.mlp.experts.{e}.down_proj.weight  → model.layers.{i}.mlp.experts.w2[e]
    X.weight (float8_e4m3fn) + X.weight_scale_inv      → both as stored where the module keeps X
                                                       in FP8 (model/fp8.py: experts' scales
                                                       stacked as w13_scale_inv, w2_scale_inv);
                                                       else X.weight, dequantized in fp32
    model.layers.{N}.embed_tokens.weight              dropped (DeepSeek's copy; use the target's)
    model.layers.{N}.shared_head.head.weight          dropped (likewise)

Tolerated with a warning: indexer tensors on IndexShare "shared" layers (some conversions keep them)
and the MTP layer's tensors when the module was built without it. Anything else that does not match
is a LoadError naming the tensor.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Callable, Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from dsaserve.config import ConfigError, ModelConfig
from dsaserve.kernels.fp8_weights import quantize_blocks
from dsaserve.model.fp8 import Fp8Linear

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"  # X.weight → X.weight_scale_inv
_EXPERT_RE = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_MAX_LISTED = 5


class LoadError(ConfigError):
    """The checkpoint does not fit the module, or a shard cannot be read; the message names the
    offending tensor and file. A ConfigError, so the CLIs report it as a start-up error, not a
    traceback."""


# ------------------------------------------------------------------------------------------------
# Checkpoint inspection
# ------------------------------------------------------------------------------------------------
def _weight_map(model_dir: str | Path) -> dict[str, Path]:
    """tensor name → shard file, from the index file or the single `model.safetensors`."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            raw = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise LoadError(f"{index}: not a safetensors index ({e!r})") from e
        weight_map = {name: model_dir / fname for name, fname in raw.items()}
        absent = sorted({p.name for p in weight_map.values() if not p.is_file()})
        if absent:
            raise LoadError(f"{index}: lists shards that are missing: {_listing(absent)}")
        return weight_map
    single = model_dir / SINGLE_FILE
    if single.is_file():
        try:
            with safe_open(str(single), framework="pt") as f:
                return {name: single for name in f.keys()}
        except SafetensorError as e:
            raise LoadError(f"{single}: unreadable ({e}): a truncated or corrupt shard?") from e
    raise LoadError(f"no checkpoint in {model_dir}: neither {INDEX_FILE} nor {SINGLE_FILE} found")


def checkpoint_tensor_names(model_dir: str | Path) -> set[str]:
    """Every tensor name the checkpoint holds (scale siblings included)."""
    return set(_weight_map(model_dir))


def checkpoint_has_mtp(model_dir: str | Path, cfg: ModelConfig) -> bool:
    """Whether the model should be built with its MTP layer: the config asks for one and the
    checkpoint carries its weights (checkpoints saved by HF transformers drop them)."""
    if cfg.num_nextn_predict_layers == 0:
        return False
    eh_proj = f"model.layers.{cfg.mtp_layer_index}.eh_proj.weight"
    return eh_proj in checkpoint_tensor_names(model_dir)


# ------------------------------------------------------------------------------------------------
# Maths
# ------------------------------------------------------------------------------------------------
def dequantize_fp8_blocks(
    wq: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> torch.Tensor:
    """W[r, c] = Wq[r, c] · S[r // br, c // bc], in fp32. wq: [out, in]; scale_inv: [⌈out/br⌉,
    ⌈in/bc⌉]. The last block row/column may be partial: the expanded scales are cut to [out, in]."""
    br, bc = block
    out_dim, in_dim = wq.shape
    s = scale_inv.float().repeat_interleave(br, dim=0)[:out_dim]
    s = s.repeat_interleave(bc, dim=1)[:, :in_dim]  # [out, in]
    return wq.float() * s


# ------------------------------------------------------------------------------------------------
# Loading
# ------------------------------------------------------------------------------------------------
class _Targets:
    """The module's tensors by name, and the checkpoint names each one needs."""

    def __init__(self, module: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype,
                 first_expert: int = 0) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(module.state_dict(keep_vars=True))
        # Projections kept in FP8, by their weight's name: their scales are cut to their range.
        self.fp8_linears: dict[str, Fp8Linear] = {
            f"{name}.weight": m for name, m in module.named_modules() if isinstance(m, Fp8Linear)}
        # Stacked experts kept in FP8 (model.dsa.Experts), by their checkpoint prefix.
        self.experts: dict[str, Any] = {
            name: m for name, m in module.named_modules() if hasattr(m, "w13_scale_inv")}
        # Under expert parallelism the stacked experts hold global ids [first, first + count).
        self.first_expert = first_expert
        # Layers the module holds; those >= num_hidden_layers are MTP layers.
        self.layers = {int(m.group(1)) for m in map(_LAYER_RE.match, self.tensors) if m}
        self.required: set[str] = set()  # checkpoint names that must be loaded
        for name, t in self.tensors.items():
            if name.endswith(SCALE_SUFFIX):
                continue  # an FP8 weight's scale: filled with its weight
            # float8_e4m3fn: a matrix kept in FP8, filled as stored
            if t.is_floating_point() and t.dtype not in (dtype, torch.float32,
                                                         torch.float8_e4m3fn):
                raise LoadError(f"{name}: module holds {t.dtype}, expected {dtype} or float32")
            if name.endswith(".mlp.experts.w13") or name.endswith(".mlp.experts.w2"):
                base, kind = name.rsplit(".", 1)
                projs = ("gate", "up") if kind == "w13" else ("down",)
                if kind == "w13" and t.shape[1] % 2:
                    raise LoadError(f"{name}: expected [E, 2*I, H], got {list(t.shape)}")
                first = self.first_expert
                self.required |= {f"{base}.{e}.{p}_proj.weight"
                                  for e in range(first, first + t.shape[0]) for p in projs}
            else:
                self.required.add(name)


def _ignore_reason(name: str, cfg: ModelConfig, targets: _Targets) -> str | None:
    """Why a checkpoint tensor is skipped: "drop" (silent), a warning category, or None (load)."""
    expert = _EXPERT_RE.match(name)
    if expert is not None and int(expert.group(2)) < cfg.n_routed_experts:
        stacked = targets.tensors.get(f"{expert.group(1)}.w13")
        local = int(expert.group(2)) - targets.first_expert
        if stacked is not None and not 0 <= local < stacked.shape[0]:
            return "drop"  # another expert-parallel rank holds it
    m = _LAYER_RE.match(name)
    if m is None:
        return None
    layer = int(m.group(1))
    if layer >= cfg.num_hidden_layers:
        if name.endswith((".embed_tokens.weight", ".shared_head.head.weight")):
            return "drop"
        if layer not in targets.layers:
            return "MTP-layer tensors (the module has no MTP layer)"
    elif not cfg.has_indexer(layer) and ".self_attn.indexer." in name:
        return "indexer tensors on IndexShare 'shared' layers"
    return None


class _ShardReader:
    """Opens shards on demand and closes them together: a weight's scale may sit in another shard
    (every safetensors file is memory-mapped, so an open handle costs no memory by itself)."""

    def __init__(self, weight_map: dict[str, Path]) -> None:
        self._weight_map = weight_map
        self._stack = ExitStack()
        self._handles: dict[Path, Any] = {}

    def __enter__(self) -> _ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def get(self, name: str) -> torch.Tensor:
        path = self._weight_map[name]
        try:
            if path not in self._handles:
                self._handles[path] = self._stack.enter_context(
                    safe_open(str(path), framework="pt"))
            return self._handles[path].get_tensor(name)
        except (OSError, SafetensorError) as e:
            raise LoadError(f"{name}: unreadable ({e}): a truncated or corrupt shard?") from e


def _read_scale(reader: _ShardReader, name: str, src: torch.Tensor,
                block: tuple[int, int]) -> torch.Tensor:
    """The block scale [⌈out/br⌉, ⌈in/bc⌉] of FP8 weight `name` (src: the weight as stored)."""
    scale_name = name + SCALE_SUFFIX
    if not reader.has(scale_name):
        raise LoadError(f"{name}: FP8 weight without its scale {scale_name}")
    scale = reader.get(scale_name)
    expected = [-(-src.shape[0] // block[0]), -(-src.shape[1] // block[1])]
    if list(scale.shape) != expected:
        raise LoadError(f"{scale_name}: shape {list(scale.shape)}, expected {expected} "
                        f"for weight {list(src.shape)}")
    return scale


def _read_dequantized(reader: _ShardReader, name: str, block: tuple[int, int]) -> torch.Tensor:
    """The tensor `name` as stored, or in fp32 if it is an FP8 weight (dequantized by its scale)."""
    src = reader.get(name)
    if src.dtype != torch.float8_e4m3fn:
        return src
    return dequantize_fp8_blocks(src, _read_scale(reader, name, src, block), block)


def _scale_destination(name: str, targets: _Targets, scale: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(module tensor, the checkpoint scale cut to what it holds) for FP8-kept weight `name`."""
    linear = targets.fp8_linears.get(name)
    if linear is not None:
        return targets.tensors[name + SCALE_SUFFIX], linear.narrow_scale(scale)
    m = _EXPERT_RE.match(name)  # _destination matched it: a routed expert of this rank
    assert m is not None, name
    base, e, proj = m.group(1), int(m.group(2)) - targets.first_expert, m.group(3)
    experts = targets.experts[base]
    blocks = experts.inter_range.blocks  # the intermediate's blocks this rank keeps (TP)
    if proj == "down":
        return experts.w2_scale_inv[e], scale[:, blocks]
    half = experts.w13_scale_inv.shape[1] // 2  # gate's blocks, then up's
    dst = experts.w13_scale_inv[e, :half] if proj == "gate" else experts.w13_scale_inv[e, half:]
    return dst, scale[blocks]


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise LoadError(f"{what}: shape mismatch: checkpoint {list(src.shape)}, "
                        f"module expects {list(dst.shape)}")
    dst.copy_(src)  # casts into the module's dtype (fp32-kept tensors stay fp32)


def _destination(name: str, targets: _Targets) -> torch.Tensor:
    """The module tensor (or expert slot, a view) that checkpoint tensor `name` fills."""
    m = _EXPERT_RE.match(name)
    if m is None:
        if name not in targets.tensors:
            raise LoadError(f"{name}: unknown tensor (no such parameter or buffer in the module)")
        return targets.tensors[name]
    base, e, proj = m.group(1), int(m.group(2)) - targets.first_expert, m.group(3)
    stacked = targets.tensors.get(f"{base}.{'w2' if proj == 'down' else 'w13'}")
    if stacked is None:
        raise LoadError(f"{name}: unknown tensor (the module has no stacked experts at {base})")
    if not 0 <= e < stacked.shape[0]:
        raise LoadError(f"{name}: expert {e} out of range (module has {stacked.shape[0]} experts)")
    half = stacked.shape[1] // 2
    # w13[e] rows: [0, I) gate, [I, 2I) up. w2[e] is down as is.
    return {"gate": stacked[e, :half], "up": stacked[e, half:], "down": stacked[e]}[proj]


def load_weights(
    module: torch.nn.Module,
    model_dir: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype,
    *,
    progress: bool = True,
    narrow: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
    first_expert: int = 0,
) -> None:
    """Fill every parameter and persistent buffer of `module` from the checkpoint in `model_dir`.

    A module that holds only this rank's part of the model (tensor or expert parallelism) passes
    `narrow(checkpoint name, full tensor) → the part it keeps` and, when its stacked experts are
    global ids [first_expert, first_expert + count), `first_expert`; other experts are skipped, so
    a rank reads only what it keeps beyond one tensor at a time.

    Streams shard by shard (memory: one tensor at a time beyond the module). FP8 weights are
    dequantized with their `weight_scale_inv` in fp32. Each value is copied into the module tensor's
    own dtype: `dtype` (the model dtype) or float32 for what the module keeps in fp32 (router bias,
    indexer weights_proj); any other floating dtype in the module is an error.
    Raises LoadError naming the tensor: unknown name, shape mismatch, FP8 weight without scale,
    or module tensors the checkpoint lacks.
    """
    with torch.no_grad():
        _load(module, Path(model_dir), cfg, dtype, progress, narrow, first_expert)


def _load(
    module: torch.nn.Module, model_dir: Path, cfg: ModelConfig, dtype: torch.dtype, progress: bool,
    narrow: Callable[[str, torch.Tensor], torch.Tensor] | None, first_expert: int,
) -> None:
    weight_map = _weight_map(model_dir)
    targets = _Targets(module, cfg, dtype, first_expert)
    block = cfg.fp8_weights.block_size if cfg.fp8_weights else (128, 128)

    # 1. Plan from names alone, so a wrong checkpoint fails before any byte is read.
    to_load: dict[Path, list[str]] = {}
    ignored: dict[str, list[str]] = {}
    for name in sorted(weight_map):
        if name.endswith(SCALE_SUFFIX):
            if name.removesuffix(SCALE_SUFFIX) not in weight_map:
                raise LoadError(f"{name}: scale without its weight "
                                f"{name.removesuffix(SCALE_SUFFIX)}")
            continue  # read together with its weight
        reason = _ignore_reason(name, cfg, targets)
        if reason is not None:
            if reason != "drop":
                ignored.setdefault(reason, []).append(name)
            continue
        _destination(name, targets)  # raises on unknown names
        to_load.setdefault(weight_map[name], []).append(name)
    missing = sorted(targets.required - {n for names in to_load.values() for n in names})
    if missing:
        raise LoadError(f"{len(missing)} tensors missing from the checkpoint in {model_dir}: "
                        f"{_listing(missing)}")
    for reason, names in ignored.items():
        logger.warning("ignored %d %s, e.g. %s", len(names), reason, names[0])

    # 2. Stream shard by shard: read, dequantize, copy with shape checks.
    for path in tqdm(sorted(to_load), desc="loading shards", unit="shard", file=sys.stderr,
                     disable=not progress):
        with _ShardReader(weight_map) as reader:
            for name in to_load[path]:
                try:
                    dst = _destination(name, targets)
                    if dst.dtype == torch.float8_e4m3fn:  # kept in FP8, with its scale
                        value = reader.get(name)
                        if value.dtype == torch.float8_e4m3fn:  # as stored
                            scale = _read_scale(reader, name, value, block)
                        else:  # a bf16 / fp32 checkpoint served with --quantization fp8
                            value, scale = quantize_blocks(value.float())
                        scale_dst, scale = _scale_destination(name, targets, scale)
                        _copy(scale_dst, scale, name + SCALE_SUFFIX)
                    else:
                        value = _read_dequantized(reader, name, block)
                    if narrow is not None:
                        value = narrow(name, value)
                    _copy(dst, value, name)
                except LoadError as e:  # name the file too: it is the one to re-download
                    raise LoadError(f"{e} (in {path})") from e


def _listing(names: Iterable[str]) -> str:
    names = list(names)
    head = ", ".join(names[:_MAX_LISTED])
    return head + (f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else "")

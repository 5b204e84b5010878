"""Trained weights → an HF-format checkpoint (the layout `dsaserve make-model` writes).

The tensor list and how each tensor is stored come from make_model's `checkpoint_specs`, so a
trained checkpoint is byte-for-byte the kind of file the loader, HF transformers and the random
presets share: fp32 router biases, FP8 block-quantized matrices when asked (with their
`weight_scale_inv`), everything else in the config's torch_dtype.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from dsaserve.config import ModelConfig
from dsaserve.kernels.fp8_weights import quantize_blocks
from dsaserve.model.make_model import _DTYPES, checkpoint_specs
from dsaserve.tokenizer import save_tokenizer


def checkpoint_tensors(state: dict[str, torch.Tensor], raw: dict[str, Any],
                       store_dtype: str | None = None) -> dict[str, torch.Tensor]:
    """The stored tensors of a trained state dict: unquantized ones in `store_dtype` (default: the
    config's torch_dtype; bf16 storage of an fp32 model halves the embeddings and the loaders
    upcast). Raises ValueError when the names differ from the checkpoint's (a training module
    that drifted from the HF layout)."""
    cfg = ModelConfig.from_hf(raw)
    specs = checkpoint_specs(cfg)
    wanted = {s.name for s in specs}
    if set(state) != wanted:
        extra, missing = sorted(set(state) - wanted), sorted(wanted - set(state))
        raise ValueError(f"trained tensors differ from the checkpoint layout: extra {extra[:5]}, "
                         f"missing {missing[:5]}")
    dtype = _DTYPES[store_dtype or raw.get("torch_dtype", "bfloat16")]
    fp8 = "quantization_config" in raw
    out: dict[str, torch.Tensor] = {}
    for spec in specs:
        w = state[spec.name].detach().float().cpu()
        if spec.fp32:
            out[spec.name] = w.contiguous()
        elif fp8 and spec.quantizable:
            out[spec.name], out[spec.name + "_scale_inv"] = quantize_blocks(w)
        else:
            out[spec.name] = w.to(dtype).contiguous()
    return out


def write_checkpoint(out_dir: str | Path, state: dict[str, torch.Tensor], raw: dict[str, Any],
                     tokenizer: HFTokenizer, extra: dict[str, Any] | None = None,
                     store_dtype: str | None = None) -> Path:
    """config.json, generation_config.json, model.safetensors and the tokenizer into `out_dir`;
    `extra` (training provenance and metrics) goes to training.json."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file(checkpoint_tensors(state, raw, store_dtype), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    _write_json(out / "config.json", raw)
    _write_json(out / "generation_config.json", {
        "_from_model_config": True, "bos_token_id": raw.get("bos_token_id"),
        "eos_token_id": raw.get("eos_token_id"), "pad_token_id": raw.get("pad_token_id")})
    save_tokenizer(tokenizer, out, model_max_length=int(raw["max_position_embeddings"]))
    if extra is not None:
        _write_json(out / "training.json", extra)
    return out


def read_state(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """A single-file checkpoint's tensors as a training state dict: FP8 weights dequantized to
    fp32 by their block scales (the loader's rule), everything else as stored."""
    from safetensors.torch import load_file

    from dsaserve.model.loader import SCALE_SUFFIX, dequantize_fp8_blocks

    stored = load_file(str(Path(model_dir) / "model.safetensors"))
    state = {}
    for name, t in stored.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        if t.dtype == torch.float8_e4m3fn:
            t = dequantize_fp8_blocks(t, stored[name + SCALE_SUFFIX])
        state[name] = t.float()
    return state


def restore(src: str | Path, dst: str | Path, *, fp8: bool, store_dtype: str | None) -> Path:
    """Write the checkpoint at `src` again into `dst`, FP8 block-quantized and/or with its
    unquantized tensors in `store_dtype` (how the shipped model is made small: train in fp32,
    store FP8 + bf16). training.json comes along."""
    from dsaserve.model.presets import DEEPSEEK_V3_2

    src = Path(src)
    raw = json.loads((src / "config.json").read_text())
    raw.pop("quantization_config", None)
    if fp8:
        raw["quantization_config"] = dict(DEEPSEEK_V3_2["quantization_config"])
    extra_path = src / "training.json"
    extra = json.loads(extra_path.read_text()) if extra_path.is_file() else None
    return write_checkpoint(dst, read_state(src), raw,
                            HFTokenizer.from_file(str(src / "tokenizer.json")), extra,
                            store_dtype=store_dtype)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m dsaserve.train.export",
                                description="re-store a trained checkpoint (FP8, bf16 storage)")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--fp8", action="store_true", help="FP8 e4m3 matrices, 128x128 block scales")
    p.add_argument("--store-dtype", choices=sorted(_DTYPES), default=None,
                   help="dtype of the unquantized tensors (default: the config's torch_dtype)")
    args = p.parse_args(argv)
    print(restore(args.src, args.dst, fp8=args.fp8, store_dtype=args.store_dtype))
    return 0


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())

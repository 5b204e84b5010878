"""`dsaserve train-tiny`: the flags of dsaserve.train.trainer.TrainConfig."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    from dsaserve.train.trainer import SIZES, TrainConfig

    d = TrainConfig(out=Path("."))
    p = subparsers.add_parser(
        "train-tiny", help="train a small GLM-5-architecture model on the Python standard library",
        description="Train a small glm_moe_dsa model (MLA, indexer with IndexShare, MoE, MTP) on "
        "the Python standard library's sources: dense attention, then the indexer warmed up "
        "against it (KL), then sparse attention; writes an HF-format checkpoint, a loss log "
        "(train_log.csv) and a plot (loss.png) into OUT.")
    p.add_argument("out", metavar="OUT", help="output directory (the checkpoint)")
    p.add_argument("--size", default=d.size, choices=sorted(SIZES),
                   help=f"model size (default: {d.size}; micro is for tests)")
    p.add_argument("--overrides", default=None, metavar="JSON",
                   help="config.json keys over the size's, e.g. '{\"index_topk\": 128}'")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--dense-frac", type=float, default=d.dense_frac,
                   help="share of the steps trained with dense attention")
    p.add_argument("--indexer-warmup-frac", type=float, default=d.indexer_warmup_frac,
                   help="share of the steps warming up the indexer (main model frozen)")
    p.add_argument("--mtp-weight", type=float, default=d.mtp_weight)
    p.add_argument("--log-every", type=int, default=d.log_every)
    p.add_argument("--eval-windows", type=int, default=d.eval_windows,
                   help="held-out windows of --seq-len tokens for the held-out loss")
    p.add_argument("--max-files", type=int, default=None,
                   help="train on the first N sorted source files only")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--fp8", action="store_true",
                   help="store matrices as FP8 e4m3 with 128x128 block scales")
    p.add_argument("--dtype", default=d.torch_dtype, choices=["float32", "bfloat16"],
                   help="the checkpoint's torch_dtype (default: %(default)s)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    from dsaserve.config import ConfigError
    from dsaserve.train.trainer import TrainConfig, train

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        overrides = json.loads(args.overrides) if args.overrides else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"--overrides: invalid JSON ({e})") from None
    if not isinstance(overrides, dict):
        raise ConfigError("--overrides: expected a JSON object")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        cfg = TrainConfig(
            out=Path(args.out), size=args.size, overrides=overrides, seed=args.seed,
            steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
            warmup_steps=args.warmup_steps, dense_frac=args.dense_frac,
            indexer_warmup_frac=args.indexer_warmup_frac, mtp_weight=args.mtp_weight,
            log_every=args.log_every, eval_windows=args.eval_windows, max_files=args.max_files,
            device=device, fp8=args.fp8, torch_dtype=args.dtype)
        train(cfg, log=lambda msg: print(msg, flush=True))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return 0

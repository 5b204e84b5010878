"""`dsaserve train-tiny`: train a small GLM-5-architecture DSA model on the Python standard library.

DeepSeek-V3.2's schedule, scaled down (`phase_of`):

    step 0 ─────────── dense ──────────┬─ indexer warm-up ─┬────── sparse ──────┐ steps
    LM + MTP losses, dense attention   │ KL only, the main │ LM + MTP losses over│
    (the indexers are not run)         │ model frozen      │ each query's top-k; │
                                       │                   │ the indexer's KL on │
                                       │                   │ the selected tokens │

The MTP layer's next-next-token loss (weight `mtp_weight`) is trained in the dense and sparse
phases. MoE experts are balanced by DeepSeek-V3's bias rule (no auxiliary loss). Everything is
deterministic given the seed on one device (CPU: one thread is enough to reproduce the numbers).
"""

from __future__ import annotations

import csv
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from dsaserve.config import ModelConfig
from dsaserve.model.make_model import build_config
from dsaserve.train import corpus as corpus_mod
from dsaserve.train.export import write_checkpoint
from dsaserve.train.model import Mode, TrainDsa

Phase = Literal["dense", "indexer_warmup", "sparse"]

# Model sizes (config.json overrides of the tiny-glm5 preset). All keep the real attention widths
# (512 latent, 64 RoPE, 128 indexer dims) so the fp8_ds_mla and indexer-key formats apply as is.
SIZES: dict[str, dict[str, Any]] = {
    # For tests: seconds on a CPU. 16 indexer heads, as the tiny presets: with few heads, scores
    # tie at 0 (every head's ReLU off) and the training and serving top-k break ties differently.
    "micro": {"vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
              "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "q_lora_rank": 32, "qk_nope_head_dim": 16, "v_head_dim": 16, "index_n_heads": 16,
              "n_routed_experts": 4, "index_topk": 8, "indexer_types": ["full", "shared"]},
    # The CPU-trained default model: minutes on one core.
    "small": {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512,
              "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
              "q_lora_rank": 128, "qk_nope_head_dim": 32, "v_head_dim": 32, "index_n_heads": 16,
              "n_routed_experts": 8, "index_topk": 64,
              "indexer_types": ["full", "shared", "full", "shared"]},
    # The H200 model: the small widths with a larger vocabulary and top-k 256 of its longer
    # windows (~9M parameters, ~10 MB as FP8 + bf16; the GPU buys tokens and context, not width).
    "base": {"vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
             "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
             "q_lora_rank": 128, "qk_nope_head_dim": 32, "v_head_dim": 32, "index_n_heads": 16,
             "n_routed_experts": 8, "index_topk": 256,
             "indexer_types": ["full", "shared", "full", "shared"]},
}


@dataclass(frozen=True)
class TrainConfig:
    """One training run (the `train-tiny` flags)."""

    out: Path
    size: str = "small"
    overrides: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.1
    dense_frac: float = 0.7  # share of steps in the dense phase
    indexer_warmup_frac: float = 0.05  # then the indexer warm-up; the rest is sparse
    mtp_weight: float = 0.3
    balance_rate: float = 1e-3
    log_every: int = 25
    eval_windows: int = 32
    held_out_every: int = 20
    max_files: int | None = None
    device: str = "cpu"
    fp8: bool = False
    torch_dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.size not in SIZES:
            raise ValueError(f"--size: expected one of {sorted(SIZES)}, got {self.size!r}")
        for name in ("steps", "batch_size", "seq_len", "log_every", "eval_windows"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 1")
        warm, dense = self.indexer_warmup_frac, self.dense_frac
        if not 0 <= dense <= 1 or not 0 <= warm <= 1 - dense:
            raise ValueError("--dense-frac, --indexer-warmup-frac: must be >= 0 and sum to <= 1")


def phase_of(step: int, steps: int, dense_frac: float, warmup_frac: float) -> Phase:
    """The schedule phase of `step` (0-based) in a run of `steps`."""
    dense_end = round(steps * dense_frac)
    warm_end = dense_end + round(steps * warmup_frac)
    if step < dense_end:
        return "dense"
    return "indexer_warmup" if step < warm_end else "sparse"


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warm-up to `peak`, then cosine decay to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def model_config(cfg: TrainConfig, vocab_size: int | None = None) -> dict[str, Any]:
    """The config.json of the trained model: tiny-glm5 with the size's (and user's) overrides."""
    overrides = {**SIZES[cfg.size], **cfg.overrides, "torch_dtype": cfg.torch_dtype,
                 "max_position_embeddings": 16384}
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    # MLA has as many KV heads as query heads (HF reads num_key_value_heads).
    if "num_key_value_heads" not in cfg.overrides:
        overrides["num_key_value_heads"] = overrides["num_attention_heads"]
    return build_config("tiny-glm5", fp8=cfg.fp8, with_mtp=True, overrides=overrides)


def losses(model: TrainDsa, ids: torch.Tensor, mode: Mode, with_indexer: bool
           ) -> dict[str, torch.Tensor]:
    """LM loss (next token), MTP loss (the token after next) and the mean indexer KL."""
    out = model(ids, mode, with_indexer)
    v = out.logits.shape[-1]
    result = {"lm": torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, v),
                                                      ids[:, 1:].reshape(-1))}
    if out.mtp_logits is not None and ids.shape[1] > 2:
        result["mtp"] = torch.nn.functional.cross_entropy(
            out.mtp_logits[:, :-1].reshape(-1, v), ids[:, 2:].reshape(-1))
    if out.kl:
        result["kl"] = torch.stack(out.kl).mean()
    return result


def eval_windows(stream: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """Up to `n` consecutive non-overlapping windows from the start of the stream [n, length]."""
    n = min(n, stream.numel() // length)
    if n < 1:
        raise ValueError(f"--seq-len: the held-out files hold fewer than {length} tokens")
    return stream[: n * length].view(n, length).long()


@torch.no_grad()
def evaluate(model: TrainDsa, windows: torch.Tensor, mode: Mode, batch: int) -> dict[str, float]:
    model.eval()
    sums: dict[str, float] = {}
    for i in range(0, windows.shape[0], batch):
        chunk = windows[i : i + batch].to(next(model.parameters()).device)
        for k, v in losses(model, chunk, mode, with_indexer=True).items():
            sums[k] = sums.get(k, 0.0) + v.item() * chunk.shape[0]
    model.train()
    return {k: v / windows.shape[0] for k, v in sums.items()}


def _autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16,
                          enabled=device.type == "cuda")


def train(cfg: TrainConfig, log=print) -> dict[str, Any]:
    """Run the schedule, write the checkpoint, the loss log (CSV) and plot into `cfg.out`.
    Returns the summary also written to training.json."""
    torch.manual_seed(cfg.seed)
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    t_start = time.perf_counter()
    raw_probe = model_config(cfg)
    corp = corpus_mod.build_corpus(corpus_mod.stdlib_root(), vocab_size=raw_probe["vocab_size"],
                                   held_out_every=cfg.held_out_every, max_files=cfg.max_files)
    train_stream = corpus_mod.encode_files(corp.tokenizer, corp.train_files)
    held_stream = corpus_mod.encode_files(corp.tokenizer, corp.held_out_files)
    log(f"corpus: {len(corp.train_files)} train files ({train_stream.numel()} tokens), "
        f"{len(corp.held_out_files)} held out ({held_stream.numel()} tokens), "
        f"vocab {corp.tokenizer.get_vocab_size()}, {time.perf_counter() - t_start:.1f} s")

    raw = raw_probe
    mcfg = ModelConfig.from_hf(raw)
    model = TrainDsa(mcfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"model: {n_params / 1e6:.2f}M parameters ({cfg.size}), {mcfg.num_hidden_layers} layers "
        f"+ MTP, top-k {mcfg.index_topk} of {cfg.seq_len}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    indexer_params = {id(p) for m in model.indexers() for p in m.parameters()}
    gen = torch.Generator().manual_seed(cfg.seed)
    held = eval_windows(held_stream, cfg.eval_windows, cfg.seq_len)
    rows: list[dict[str, Any]] = []
    evals: dict[str, dict[str, float]] = {}
    tokens, t_train = 0, time.perf_counter()
    phase_prev: Phase | None = None
    for step in range(cfg.steps):
        phase = phase_of(step, cfg.steps, cfg.dense_frac, cfg.indexer_warmup_frac)
        if phase != phase_prev:
            if phase_prev is not None:
                evals[f"after_{phase_prev}"] = evaluate(
                    model, held, "sparse" if phase_prev == "sparse" else "dense", cfg.batch_size)
                log(f"held-out after {phase_prev}: {_fmt(evals[f'after_{phase_prev}'])}")
            warm = phase == "indexer_warmup"
            for p in model.parameters():  # the warm-up freezes all but the indexers
                p.requires_grad_(not warm or id(p) in indexer_params)
            log(f"step {step}: phase {phase}")
            phase_prev = phase
        lr = lr_at(step, cfg.steps, cfg.lr, cfg.warmup_steps)
        if phase == "indexer_warmup":
            lr = cfg.lr  # a short phase of its own: the indexers start from their init
        for g in opt.param_groups:
            g["lr"] = lr
        ids = corpus_mod.sample_windows(train_stream, cfg.batch_size, cfg.seq_len, gen).to(device)
        with _autocast(device):
            parts = losses(model, ids, "dense" if phase != "sparse" else "sparse",
                           with_indexer=phase != "dense")
        if phase == "indexer_warmup":
            loss = parts["kl"]
        else:
            loss = parts["lm"] + cfg.mtp_weight * parts.get("mtp", 0.0) + parts.get("kl", 0.0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], 1.0)
        opt.step()
        if phase != "indexer_warmup":
            for r in model.routers():
                r.balance(cfg.balance_rate)
        tokens += ids.numel()
        row = {"step": step, "phase": phase, "lr": lr,
               **{k: round(v.item(), 5) for k, v in parts.items()}}
        rows.append(row)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            rate = tokens / max(time.perf_counter() - t_train, 1e-9)
            log(f"step {step:5d} {phase:14s} lr {lr:.2e} "
                + " ".join(f"{k} {row[k]:.4f}" for k in ("lm", "mtp", "kl") if k in row)
                + f"  {rate:,.0f} tok/s")
    evals[f"after_{phase_prev}"] = evaluate(
        model, held, "sparse" if phase_prev == "sparse" else "dense", cfg.batch_size)
    log(f"held-out after {phase_prev}: {_fmt(evals[f'after_{phase_prev}'])}")
    if phase_prev == "sparse":
        evals["final_dense"] = evaluate(model, held, "dense", cfg.batch_size)
        log(f"held-out, same weights, dense attention: {_fmt(evals['final_dense'])}")

    wall = time.perf_counter() - t_start
    summary = {
        # The output path is left out: the checkpoint may ship and must not name this machine.
        "train_config": {k: v for k, v in asdict(cfg).items() if k != "out"},
        "parameters": n_params, "train_tokens": tokens, "wall_seconds": round(wall, 1),
        "device": str(device), "torch": torch.__version__,
        "python": platform.python_version(), "corpus_root_python_files": len(corp.train_files)
        + len(corp.held_out_files), "held_out_files": len(corp.held_out_files),
        "held_out_tokens": int(held.numel()), "held_out": evals,
    }
    out = Path(cfg.out)
    write_checkpoint(out, model.state_dict(), raw, corp.tokenizer, extra=summary)
    _write_log(out / "train_log.csv", rows)
    _plot(out / "loss.png", rows)
    log(f"wrote {out} in {wall:.0f} s")
    return summary


def _fmt(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" for k, v in metrics.items())


def _write_log(path: Path, rows: list[dict[str, Any]]) -> None:
    keys = ["step", "phase", "lr", "lm", "mtp", "kl"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def _plot(path: Path, rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_kl) = plt.subplots(1, 2, figsize=(10, 3.5))
    for key, label in (("lm", "LM loss"), ("mtp", "MTP loss (token after next)")):
        pts = [(r["step"], r[key]) for r in rows if key in r and r["phase"] != "indexer_warmup"]
        if pts:
            ax.plot(*zip(*pts, strict=True), label=label, linewidth=0.8)
    pts = [(r["step"], r["kl"]) for r in rows if "kl" in r]
    if pts:
        ax_kl.plot(*zip(*pts, strict=True), color="C2", linewidth=0.8)
    for a in (ax, ax_kl):
        for r0, r1 in zip(rows, rows[1:], strict=False):
            if r0["phase"] != r1["phase"]:
                a.axvline(r1["step"], color="grey", linestyle=":", linewidth=0.8)
        a.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.legend()
    ax_kl.set_ylabel("indexer KL(attention ‖ indexer)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summary_json(summary: dict[str, Any]) -> str:
    return json.dumps(summary, indent=2)


if __name__ == "__main__":  # pragma: no cover
    sys.exit("use `dsaserve train-tiny`")

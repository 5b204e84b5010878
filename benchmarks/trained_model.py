"""Measurements of a trained checkpoint (by default the shipped `tiny-trained`), CPU-runnable.

    python benchmarks/trained_model.py [--model DIR] [--contexts 1024 2048 4096] [--out FILE.json]

1. held-out loss: the training forward (dsaserve/train/model.py) over the held-out standard-library
   files (the split `train-tiny` used), sparse and dense attention, at the training length and
   longer;
2. sample continuations: greedy, through the engine, from the openings of held-out files;
3. MTP speculative decoding with 3 drafts through the engine (real rejection sampling at
   temperature 1, and greedy): mean acceptance length and per-position acceptance, vLLM's counters;
   With --draft-vocab-sizes, the same over the N tokens most frequent in the training split
   (--speculative-config's draft_vocab);
4. top-k locality: the overlap |S_t ∩ S_{t-1}| / k of consecutive decode steps' top-k sets, per
   full-indexer layer, at each context (what a hot buffer of the last step's rows would hit);
5. indexer recall: per full layer, how many of dense attention's top-k rows (attention summed over
   heads) the indexer's top-k holds, and the attention mass the indexer's choice covers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from dsaserve.config import (
    AttentionConfig,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SpecConfig,
)
from dsaserve.core import SamplingParams
from dsaserve.engine.args import resolve_model
from dsaserve.engine.engine import LLMEngine
from dsaserve.spec import draft_vocab
from dsaserve.tokenizer import Tokenizer
from dsaserve.train import corpus
from dsaserve.train.export import read_state
from dsaserve.train.model import TrainDsa
from dsaserve.train.trainer import eval_windows


def _engine(model_dir: Path, max_len: int, spec: SpecConfig | None = None) -> LLMEngine:
    cfg = EngineConfig(
        model_path=str(model_dir), model=ModelConfig.from_file(model_dir),
        cache=CacheConfig(block_size=64, num_gpu_blocks=-(-max_len // 64) * 4 + 16,
                          enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max(2048, max_len),
                                  max_model_len=max_len),
        attention=AttentionConfig(), speculative=spec, dtype="float32")
    return LLMEngine.from_config(cfg)


def _held_out(model_dir: Path, tok: Tokenizer) -> tuple[list[Path], torch.Tensor]:
    summary = json.loads((model_dir / "training.json").read_text())
    every = summary["train_config"]["held_out_every"]
    root = corpus.stdlib_root()
    files = [p for p in corpus.list_sources(root, summary["train_config"]["max_files"])
             if corpus.is_held_out(p.relative_to(root).as_posix(), every)]
    ids: list[int] = []
    for f in files:
        ids += tok.encode(corpus.read_text(f)) + [0]
    return files, torch.tensor(ids)


def held_out_loss(model: TrainDsa, stream: torch.Tensor, lengths: list[int]) -> dict:
    from dsaserve.train.trainer import evaluate

    out = {}
    for length in lengths:
        windows = eval_windows(stream, max(1, 16 * 256 // length), length)  # 4096 tokens
        out[length] = {m: evaluate(model, windows, m, batch=4) for m in ("sparse", "dense")}
        print(f"held-out loss @ {length}: " + "; ".join(
            f"{m} lm {v['lm']:.3f} mtp {v['mtp']:.3f}" for m, v in out[length].items()))
    return out


def _prompt_text(text: str) -> str:
    """The ~400 characters up to and including a `def` line past the first third of the file
    (the model continues a function from its signature)."""
    start = len(text) // 3
    for marker in ("\n    def ", "\ndef "):
        at = text.find(marker, start)
        if at >= 0:
            end = text.find("\n", at + 1)
            return text[max(0, at - 400) : end + 1]
    return text[:400]


def samples(model_dir: Path, tok: Tokenizer, files: list[Path], n: int) -> list[dict]:
    engine = _engine(model_dir, 1024)
    out = []
    for f in files[:n]:
        prompt = tok.encode(_prompt_text(corpus.read_text(f)))
        ids = engine.generate([prompt], SamplingParams(max_tokens=96, temperature=0.0))[0]
        out.append({"file": f.name, "prompt": tok.decode(prompt), "continuation": tok.decode(ids)})
        print(f"--- {f.name}: prompt ...{tok.decode(prompt)[-80:]!r}\n{tok.decode(ids)}\n")
    engine.check_integrity()
    return out


def training_split_counts(model_dir: Path, tok: Tokenizer) -> list[list[int]]:
    """The token ids of every training file (the held-out ones left out): what a draft
    vocabulary is counted over, as a deployment would count its traffic."""
    summary = json.loads((model_dir / "training.json").read_text())
    every = summary["train_config"]["held_out_every"]
    root = corpus.stdlib_root()
    return [tok.encode(corpus.read_text(f))
            for f in corpus.list_sources(root, summary["train_config"]["max_files"])
            if not corpus.is_held_out(f.relative_to(root).as_posix(), every)]


def mtp_acceptance(model_dir: Path, stream: torch.Tensor, n_prompts: int,
                   draft_lm_head: str = "model", vocab: tuple[int, ...] | None = None) -> dict:
    """MTP3's acceptance at temperature 1 and greedy, the drafts reading `draft_lm_head`
    (SpecConfig: the checkpoint's lm_head, or its FP8 copy), over `vocab` (SpecConfig's
    draft_vocab; None: every token)."""
    out = {}
    prompts = eval_windows(stream, n_prompts, 192).tolist()
    spec = SpecConfig(method="mtp", num_speculative_tokens=3, draft_lm_head=draft_lm_head,
                      draft_vocab=vocab)
    over = "every token" if vocab is None else f"{len(vocab)} tokens"
    for label, temp in (("temperature 1", 1.0), ("greedy", 0.0)):
        engine = _engine(model_dir, 1024, spec)
        params = [SamplingParams(max_tokens=128, temperature=temp, seed=i, ignore_eos=True)
                  for i in range(len(prompts))]
        engine.generate(prompts, params)
        engine.check_integrity()
        s = engine.stats()
        per_pos = [a / max(s.spec_decode_num_drafts, 1)
                   for a in s.spec_decode_num_accepted_tokens_per_pos]
        out[label] = {"mean_acceptance_length": s.spec_decode_mean_acceptance_length,
                      "acceptance_per_position": per_pos, "drafts": s.spec_decode_num_drafts}
        print(f"MTP3 {label}, drafts through {draft_lm_head} over {over}: mean acceptance length "
              f"{s.spec_decode_mean_acceptance_length:.3f}, per position "
              f"{[round(p, 3) for p in per_pos]} over {s.spec_decode_num_drafts} "
              "verification steps")
    return out


def topk_overlap(model_dir: Path, stream: torch.Tensor, contexts: list[int], steps: int) -> dict:
    """Decode `steps` greedy tokens after a held-out prompt of each context length; per full
    layer, the mean overlap of consecutive steps' top-k sets."""
    cfg = ModelConfig.from_file(model_dir)
    out = {}
    for ctx in contexts:
        engine = _engine(model_dir, ctx + steps + 8)
        sets: dict[int, list[set[int]]] = {i: [] for i in cfg.full_indexer_layers}
        hooks = []
        for i in cfg.full_indexer_layers:
            attn = engine.runner.model.model.layers[i].self_attn

            def hook(_m, _inp, output, i=i, sets=sets):
                topk = output[1]
                if topk is not None and topk.shape[0] == 1:  # a decode step (one query row)
                    sets[i].append({p for p in topk[0].tolist() if p >= 0})
            hooks.append(attn.register_forward_hook(hook))
        prompt = stream[:ctx].tolist()
        t0 = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=steps, temperature=0.0,
                                                 ignore_eos=True))
        for h in hooks:
            h.remove()
        engine.check_integrity()
        row = {}
        for i, s in sets.items():
            ov = [len(a & b) / max(len(a), 1) for a, b in zip(s, s[1:], strict=False)]
            row[i] = sum(ov) / max(len(ov), 1)
        out[ctx] = row
        print(f"top-k overlap of consecutive decode steps @ {ctx} tokens (k = {cfg.index_topk}): "
              + ", ".join(f"layer {i} {v:.3f}" for i, v in row.items())
              + f"  ({time.perf_counter() - t0:.0f} s)")
    return out


def indexer_recall(model: TrainDsa, stream: torch.Tensor, contexts: list[int],
                   queries: int) -> dict:
    """Recall of dense attention's top-k rows by the indexer's top-k, over the last `queries`
    queries of one held-out window per context, per full layer (and the MTP layer)."""
    k = model.cfg.index_topk
    attns = [(i, layer.self_attn) for i, layer in enumerate(model.model.layers)
             if layer.self_attn.indexer is not None]
    out = {}
    for ctx in contexts:
        ids = stream[:ctx].long()[None].to(model.inv_freq.device)
        for _, a in attns:
            a.probe = {}
        with torch.no_grad():
            model(ids, "dense", with_indexer=True)
        row = {}
        for i, a in attns:
            attn = a.probe["attn"][0, :, -queries:].sum(0)  # [Q, T] summed over heads
            attn = attn / attn.sum(-1, keepdim=True)
            scores = a.probe["scores"][0, -queries:]  # [Q, T]
            dense_top = attn.topk(k, dim=-1).indices
            idx_top = scores.topk(k, dim=-1).indices
            hit = torch.zeros_like(attn, dtype=torch.bool).scatter_(-1, idx_top, True)
            recall = hit.gather(-1, dense_top).float().mean().item()
            mass = (attn * hit).sum(-1).mean().item()
            row[i] = {"recall": recall, "attention_mass": mass}
            a.probe = None
        out[ctx] = row
        print(f"indexer recall of dense top-{k} @ {ctx}: " + ", ".join(
            f"layer {i} {v['recall']:.3f} (mass {v['attention_mass']:.3f})"
            for i, v in row.items()))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny-trained")
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--mtp-prompts", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu",
                   help="where the training forward runs (loss, recall; 16K contexts need a GPU)")
    p.add_argument("--skip", nargs="*", default=[],
                   choices=["loss", "samples", "mtp", "overlap", "recall"])
    p.add_argument("--draft-lm-heads", nargs="+", default=["model"], choices=["model", "fp8"],
                   help="MTP acceptance with the drafts reading each head (--speculative-config's "
                        "draft_lm_head)")
    p.add_argument("--draft-vocab-sizes", type=int, nargs="*", default=[],
                   help="also MTP acceptance with the drafts restricted to the N tokens most "
                        "frequent in the training split (--speculative-config's draft_vocab)")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    tok = Tokenizer.from_pretrained(model_dir)
    files, stream = _held_out(model_dir, tok)
    cfg = ModelConfig.from_file(model_dir)
    # a context plus its decode steps must fit the model's positions (16K for the base size)
    fits = [c for c in args.contexts if c + args.decode_steps + 8 <= cfg.max_position_embeddings]
    if fits != args.contexts:
        print(f"contexts {sorted(set(args.contexts) - set(fits))} skipped: beyond the model's "
              f"{cfg.max_position_embeddings} positions with {args.decode_steps} decode steps")
        args.contexts = fits
    model = TrainDsa(cfg).eval()
    model.load_state_dict(read_state(model_dir))
    model.to(args.device)
    print(f"{model_dir}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters; "
          f"{len(files)} held-out files, {stream.numel()} tokens")
    results: dict = {"model": str(args.model)}
    seq = json.loads((model_dir / "training.json").read_text())["train_config"]["seq_len"]
    if "loss" not in args.skip:
        results["held_out_loss"] = held_out_loss(model, stream, [seq, 4 * seq])
    if "samples" not in args.skip:
        results["samples"] = samples(model_dir, tok, files, args.samples)
    if "mtp" not in args.skip:
        for head in args.draft_lm_heads:
            key = "mtp3" if head == "model" else f"mtp3 drafts {head}"
            results[key] = mtp_acceptance(model_dir, stream, args.mtp_prompts, head)
        counts = training_split_counts(model_dir, tok) if args.draft_vocab_sizes else []
        for size in args.draft_vocab_sizes:
            vocab = tuple(draft_vocab.most_frequent(counts, size))
            covered = torch.isin(stream, torch.tensor(vocab)).float().mean().item()
            print(f"draft vocabulary of {size} tokens: {covered:.1%} of the held-out tokens")
            results[f"mtp3 draft vocab {size}"] = mtp_acceptance(
                model_dir, stream, args.mtp_prompts, args.draft_lm_heads[-1], vocab)
            results[f"mtp3 draft vocab {size}"]["held_out_coverage"] = covered
    if "overlap" not in args.skip:
        results["topk_overlap"] = topk_overlap(model_dir, stream, args.contexts,
                                               args.decode_steps)
    if "recall" not in args.skip:
        results["indexer_recall"] = indexer_recall(model, stream, args.contexts, queries=256)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

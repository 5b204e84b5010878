"""`dsaserve train-tiny` (dsaserve/train): a micro run on a slice of the standard library is
deterministic, learns, its indexer warm-up lowers the KL, and its checkpoint is one our engine and
HF transformers both read with the same logits (and the same logits as the training forward)."""

from __future__ import annotations

import csv
import json

import pytest
import torch
from safetensors.torch import load_file
from test_model_vs_hf import _hf_logits, _max_rel_err, run_chunks

from dsaserve.config import ModelConfig
from dsaserve.core import NewRequestData, SamplingParams, SchedulerOutput
from dsaserve.engine.runner import ModelRunner
from dsaserve.model.loader import dequantize_fp8_blocks
from dsaserve.model.presets import trained_model_dir
from dsaserve.train import corpus
from dsaserve.train.export import write_checkpoint
from dsaserve.train.model import TrainDsa, topk_mask
from dsaserve.train.trainer import TrainConfig, lr_at, phase_of, train

SEQ = 48  # > the micro top-k (8): the sparse path is exercised


def _micro(out) -> TrainConfig:
    return TrainConfig(out=out, size="micro", steps=16, batch_size=4, seq_len=SEQ, max_files=6,
                       log_every=100, eval_windows=3, warmup_steps=2, dense_frac=0.5,
                       indexer_warmup_frac=0.25, lr=1e-2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same micro run twice (same seed)."""
    torch.manual_seed(1234)  # the run must not depend on the caller's RNG state
    a = tmp_path_factory.mktemp("run_a")
    sa = train(_micro(a), log=lambda _: None)
    torch.manual_seed(99)
    b = tmp_path_factory.mktemp("run_b")
    sb = train(_micro(b), log=lambda _: None)
    return (a, sa), (b, sb)


def _log(path) -> list[dict[str, str]]:
    with (path / "train_log.csv").open() as f:
        return list(csv.DictReader(f))


def test_schedule_phases_and_lr():
    phases = [phase_of(s, 20, 0.5, 0.1) for s in range(20)]
    assert phases == ["dense"] * 10 + ["indexer_warmup"] * 2 + ["sparse"] * 8
    assert phase_of(0, 10, 0.0, 0.0) == "sparse"
    assert lr_at(0, 100, 1.0, 10) == pytest.approx(0.1)
    assert lr_at(10, 100, 1.0, 10) == pytest.approx(1.0)
    assert lr_at(99, 100, 1.0, 10) == pytest.approx(0.1, abs=1e-3)
    with pytest.raises(ValueError, match="--dense-frac"):
        TrainConfig(out=None, dense_frac=0.9, indexer_warmup_frac=0.2)
    with pytest.raises(ValueError, match="--size"):
        TrainConfig(out=None, size="huge")


def test_corpus_split_is_by_file_and_stable(tmp_path):
    root = corpus.stdlib_root()
    files = corpus.list_sources(root, max_files=30)
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    assert not any("test" in f.relative_to(root).parts[:-1] for f in files)
    held = [f for f in files if corpus.is_held_out(f.relative_to(root).as_posix(), 5)]
    assert held == [f for f in files if corpus.is_held_out(f.relative_to(root).as_posix(), 5)]
    assert 0 < len(held) < len(files)


def test_run_is_deterministic(runs):
    (a, sa), (b, sb) = runs
    assert _log(a) == _log(b)
    assert sa["held_out"] == sb["held_out"]
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()
    assert (a / "loss.png").stat().st_size > 0


def test_loss_decreases_and_warmup_lowers_the_kl(runs):
    (a, summary), _ = runs
    rows = _log(a)
    dense = [float(r["lm"]) for r in rows if r["phase"] == "dense"]
    assert sum(dense[-3:]) / 3 < dense[0] - 0.5
    mtp = [float(r["mtp"]) for r in rows if r["phase"] == "dense"]
    assert sum(mtp[-3:]) / 3 < mtp[0] - 0.5
    held = summary["held_out"]
    # The warm-up trains the indexers only: LM loss unchanged, KL to dense attention lower.
    assert held["after_indexer_warmup"]["lm"] == pytest.approx(held["after_dense"]["lm"])
    assert held["after_indexer_warmup"]["kl"] < held["after_dense"]["kl"] - 0.01
    assert json.loads((a / "training.json").read_text())["held_out"] == held


def _runner(model_dir, engine_config) -> ModelRunner:
    return ModelRunner(engine_config(model_dir, block_size=16, num_blocks=8, dtype="float32"))


def _prompt(model_dir) -> list[int]:
    """Held-out-looking text: a standard-library file's opening, tokenized by the model's BPE."""
    from dsaserve.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(model_dir)
    text = corpus.read_text(corpus.list_sources(corpus.stdlib_root())[-1])
    return tok.encode(text)[:SEQ]


def test_checkpoint_matches_hf_and_the_training_forward(runs, engine_config):
    (a, _), _ = runs
    cfg = ModelConfig.from_file(a)
    assert cfg.model_type == "glm_moe_dsa" and cfg.has_mtp and cfg.index_topk < SEQ
    ids = _prompt(a)
    ours = run_chunks(_runner(a, engine_config), ids, [20, 28], block_size=16)
    assert _max_rel_err(ours, _hf_logits(a, "tiny-glm5", ids)) <= 1e-4
    model = TrainDsa(cfg).eval()
    model.load_state_dict(load_file(a / "model.safetensors"))
    with torch.no_grad():
        out = model(torch.tensor([ids]), "sparse")
        dense = model(torch.tensor([ids]), "dense")
    assert _max_rel_err(out.logits[0], ours) <= 1e-4
    # Past top-k tokens, sparse attention really differs from dense attention.
    assert _max_rel_err(dense.logits[0, -8:], ours[-8:]) > 1e-3
    # The MTP layer: draft step 0 over the same positions (token p+1 and the hidden state at p).
    runner = _runner(a, engine_config)
    so = SchedulerOutput((NewRequestData("r", tuple(ids), SamplingParams(), (0, 1, 2), 0),), (),
                         {"r": SEQ}, ())
    runner._apply_diff(so)
    batch = runner._prepare(["r"], {"r": SEQ}, {})
    hidden = runner.model(batch.input_ids, batch.meta, runner.caches)
    nxt = torch.tensor(ids[1:] + [0])
    mtp = runner.model.compute_logits(runner.model.forward_mtp(nxt, hidden, batch.meta,
                                                               runner.caches))
    assert _max_rel_err(out.mtp_logits[0], mtp[:-1]) <= 1e-4


def test_fp8_export_loads_and_stays_close(runs, engine_config, tmp_path):
    (a, _), _ = runs
    raw = json.loads((a / "config.json").read_text())
    raw8 = {**raw, "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                           "fmt": "e4m3", "weight_block_size": [128, 128]}}
    from tokenizers import Tokenizer as HFTokenizer

    state = load_file(a / "model.safetensors")
    out = write_checkpoint(tmp_path / "fp8", state, raw8,
                           HFTokenizer.from_file(str(a / "tokenizer.json")), store_dtype="bfloat16")
    stored = load_file(out / "model.safetensors")
    w = "model.layers.0.self_attn.q_a_proj.weight"
    assert stored[w].dtype == torch.float8_e4m3fn
    assert stored["model.embed_tokens.weight"].dtype == torch.bfloat16
    back = dequantize_fp8_blocks(stored[w], stored[w + "_scale_inv"])
    assert _max_rel_err(back, state[w]) < 0.1
    ids = _prompt(a)
    ref = run_chunks(_runner(a, engine_config), ids, [SEQ], block_size=16)
    got = run_chunks(_runner(out, engine_config), ids, [SEQ], block_size=16)
    assert torch.isfinite(got).all()
    assert (got - ref).abs().mean() < 0.1 * ref.abs().mean()  # FP8 rounding, no broken tensor
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_topk_mask_is_dense_below_k():
    g = torch.Generator().manual_seed(0)
    future = ~torch.ones(6, 6, dtype=torch.bool).tril()
    scores = torch.randn(1, 6, 6, generator=g).masked_fill(future, -1e30)
    mask = topk_mask(scores, 4)
    assert mask[0, :4].equal(torch.ones(4, 6, dtype=torch.bool).tril()[:4])
    assert mask[0, 4:].sum(-1).tolist() == [4, 4]


def test_resolve_trained_model(monkeypatch, tmp_path):
    from dsaserve.config import ConfigError
    from dsaserve.engine import args as engine_args
    from dsaserve.model.presets import TRAINED_MODEL

    monkeypatch.setattr(engine_args, "trained_model_dir", lambda: tmp_path)
    with pytest.raises(ConfigError, match="--model tiny-trained: the package has no trained"):
        engine_args.resolve_model(TRAINED_MODEL)
    (tmp_path / "config.json").write_text("{}")
    assert engine_args.resolve_model(TRAINED_MODEL) == tmp_path


@pytest.mark.skipif(not (trained_model_dir() / "config.json").is_file(),
                    reason="no trained checkpoint shipped")
def test_shipped_model_matches_hf(engine_config, tmp_path):
    """The shipped checkpoint (FP8 matrices, bf16 rest) read by our loader gives HF's logits, in
    fp32, on a held-out file: HF reads the same weights dequantized into an fp32 copy."""
    from dsaserve.tokenizer import Tokenizer
    from dsaserve.train.export import restore

    shipped = trained_model_dir()
    assert sum(f.stat().st_size for f in shipped.iterdir()) < 11_000_000
    cfg = ModelConfig.from_file(shipped)
    assert cfg.model_type == "glm_moe_dsa" and cfg.fp8_weights is not None and cfg.has_mtp
    plain = restore(shipped, tmp_path / "fp32", fp8=False, store_dtype="float32")
    tok = Tokenizer.from_pretrained(shipped)
    n = cfg.index_topk + 32  # past top-k: the indexer's choice matters
    ids = tok.encode(corpus.read_text(corpus.list_sources(corpus.stdlib_root())[-1]))[:n]
    runner = ModelRunner(engine_config(shipped, block_size=16, num_blocks=16, dtype="float32"))
    ours = run_chunks(runner, ids, [n - 40, 40], block_size=16)
    assert _max_rel_err(ours, _hf_logits(plain, "tiny-glm5", ids)) <= 1e-4

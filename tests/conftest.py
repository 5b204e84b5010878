"""Shared fixtures: tiny checkpoints built once per session, and engine-config factories."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def pytest_collectreport(report) -> None:
    """tests/unit/test_triton_interpret.py skips itself when triton was imported before it
    without the interpreter: right on a GPU machine (the GPU modules import it), a silent loss of
    every interpreted kernel test on a CPU one, where it means that a module collected earlier
    imported triton at import time (unit modules import it inside their tests instead)."""
    if (report.nodeid.endswith("test_triton_interpret.py") and report.skipped
            and "imported before" in str(report.longrepr) and not torch.cuda.is_available()):
        raise pytest.UsageError(
            "test_triton_interpret.py was skipped: a test module collected before it imported "
            "triton without TRITON_INTERPRET=1 (import dsaserve.kernels.triton inside tests)")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Lazily built tiny checkpoints, keyed by preset name (tiny-glm5, tiny-dsv32)."""
    from dsaserve.model.make_model import make_model

    cache: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("models")

    class _Dirs(dict):
        def __missing__(self, preset: str) -> Path:
            cache[preset] = make_model(preset, root / preset)
            self[preset] = cache[preset]
            return cache[preset]

    return _Dirs()


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory) -> Path:
    """The built-in tiny tokenizer, written once per session."""
    from dsaserve.tokenizer import build_tiny_tokenizer

    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tok(tok_dir: Path):
    """The tiny tokenizer, loaded."""
    from dsaserve.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(tok_dir)


def _mixed_prompts(n: int = 5, seed: int = 0) -> list[list[int]]:
    """Mixed lengths (21–99 tokens for n = 5) with a shared 40-token prefix over the tiny
    vocabulary: prefix hits, sparse top-k (tiny top-k is 16) and, under PCP, both split and
    replicated prefills happen."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(4, 512, (40,), generator=g).tolist()
    out = []
    for i in range(n):
        tail = torch.randint(4, 512, (3 + 11 * i,), generator=g).tolist()
        out.append(shared + tail if i % 2 == 0 else tail + shared[:7])
    return out


@pytest.fixture(scope="session")
def mixed_prompts():
    """mixed_prompts(n=5, seed=0) → prompts (token ids) every engine test can share."""
    return _mixed_prompts


@pytest.fixture
def engine_config():
    """engine_config(model_dir, kv_cache_dtype=..., block_size=..., ...) → EngineConfig."""
    from dsaserve.config import (
        AttentionConfig,
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
    )

    def build(model_dir: Path, *, kv_cache_dtype: str = "auto", block_size: int = 16,
              num_blocks: int | None = 64, prefix_caching: bool = True, max_model_len: int = 256,
              max_num_seqs: int = 16, max_num_batched_tokens: int = 512, force_mqa: bool = True,
              dtype: str = "auto") -> EngineConfig:
        return EngineConfig(
            model_path=str(model_dir),
            model=ModelConfig.from_file(model_dir),
            cache=CacheConfig(block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                              num_gpu_blocks=num_blocks, enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
            attention=AttentionConfig(sparse_mla_force_mqa=force_mqa),
            dtype=dtype,
        )

    return build


def _draftable_checkpoint(src: Path, dst: Path, attn_scale: float = 0.3, mix: float = 0.05) -> Path:
    """A copy of a tiny checkpoint whose MTP layer drafts well, for tests of the acceptance path.

    Random tiny weights make the MTP layer's drafts almost never right, so nothing past the
    first draft would be exercised. Here the target is made *mostly* context-free and the MTP
    layer is made to predict what that context-free part says:

      * every MLP / MoE output is zeroed and attention outputs are scaled by `attn_scale`, so the
        target's hidden state at q is embed(token[q]) plus a small context term, and its next
        token is lm_head(norm(...)) — usually the same as without context, sometimes not;
      * the MTP layer's attention and MoE outputs are zeroed, its norms are 1 and
        eh_proj = [I | mix·I], so h_mtp ≈ norm(embed(token[q+1])) (+ a little of H[q]) and its
        logits are the context-free target logits one position ahead: the draft is the target's
        next token whenever the context term does not change the argmax.

    Drafts are then accepted at a high but not perfect rate, with the target still depending on
    the context (KV rollback mistakes change its output) and the MTP KV depending on both inputs.
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    if dst.is_dir():
        return dst
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, ignore=shutil.ignore_patterns("*.safetensors"))
    n = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    mtp = f"model.layers.{n}."
    for shard in sorted(src.glob("*.safetensors")):
        w = load_file(shard)
        for name, t in w.items():
            if "down_proj" in name:
                w[name] = torch.zeros_like(t)
            elif name.endswith("self_attn.o_proj.weight"):
                w[name] = torch.zeros_like(t) if name.startswith(mtp) else t * attn_scale
            elif name == "model.norm.weight" or name.startswith(mtp) and name.endswith(
                    ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")):
                w[name] = torch.ones_like(t)
            elif name == mtp + "eh_proj.weight":
                hidden = t.shape[0]
                eye = torch.eye(hidden, dtype=t.dtype)
                w[name] = torch.cat((eye, mix * eye), dim=1)
        save_file(w, tmp / shard.name, metadata={"format": "pt"})
    tmp.rename(dst)
    return dst


@pytest.fixture(scope="session")
def draftable_dirs(model_dirs, tmp_path_factory) -> dict[str, Path]:
    """preset → a checkpoint built to draft well (see _draftable_checkpoint), built lazily."""
    root = tmp_path_factory.mktemp("draftable")

    class _Dirs(dict):
        def __missing__(self, preset: str) -> Path:
            self[preset] = _draftable_checkpoint(model_dirs[preset], root / preset)
            return self[preset]

    return _Dirs()


def _weka_traces(root: Path, sessions: int, turns: int, block: int = 16,
                 first: int = 96, grow: int = 48, out: int = 6) -> Path:
    """Weka traces of growing sessions: each turn re-sends the previous prompt's blocks."""
    weka = root / "weka"
    weka.mkdir(parents=True)
    for s in range(sessions):
        requests, ids = [], list(range(first // block))
        for k in range(turns):
            if k:
                ids += range(len(ids), len(ids) + grow // block)
            requests.append({"t": 0.5 * k, "type": "s", "in": len(ids) * block, "out": out + s,
                             "hash_ids": list(ids), "think_time": 0.25})
        trace = {"id": f"s{s}", "block_size": block, "hash_id_scope": "local",
                 "requests": requests}
        (weka / f"s{s}.json").write_text(json.dumps(trace))
    return root


@pytest.fixture(scope="session")
def weka_traces():
    """_weka_traces(root, sessions, turns, ...) → root: growing sessions in the Weka trace form
    (`dsaserve simulate --workload`)."""
    return _weka_traces


@pytest.fixture
def load_benchmark(monkeypatch):
    """load_benchmark("decode") → benchmarks/decode.py as a module, registered in sys.modules
    while the test runs (its dataclasses look their module up there)."""
    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
        return module

    return load


def _generate_checked(engine, prompts, params) -> list[list[int]]:
    """The prompts through `engine` step by step, every invariant checked after each step, then
    one empty step (it tells the runner which requests ended) and a last check → the output
    token ids of each prompt, in order."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        engine.check_integrity()
    engine.step()
    engine.check_integrity()
    return [out[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="session")
def generate_checked():
    """generate_checked(engine, prompts, params) → outputs, invariants checked every step."""
    return _generate_checked

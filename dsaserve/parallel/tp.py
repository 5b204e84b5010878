"""Sharding a loaded model over its engine's ranks (TP heads and intermediates, EP experts).

TP shards attention heads (q_b_proj and kv_b_proj rows, o_proj columns), the intermediate of
dense MLPs, shared experts and — without EP — every routed expert, and the vocabulary (the rows of
embed_tokens and lm_head: parallel/vocab.py); partial outputs are all-reduced over the TP group.
The latent KV projection and the indexer stay replicated: every TP rank stores the whole latent
cache and scores every query, which is why TP scales badly for this model.
EP gives each rank n_routed_experts / EP size experts (the engine's ranks, or with DP + EP
every replica's: ParallelConfig.expert_parallel_size).

Sharding happens before any weight is read: the model is built on the meta device, `shard_model`
cuts every parameter to this rank's shape, the model is materialised, and the loader narrows each
checkpoint tensor with `checkpoint_narrower` (and skips experts other ranks hold), so a rank reads
and keeps only its own part. The two functions must cut the same way: the equivalence tests
against a single rank (tests/parallel/) check that they do.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
from torch import nn

from dsaserve.config import ModelConfig, ParallelConfig, check_divisible
from dsaserve.model import fp8
from dsaserve.model.dsa import MLP, DsaForCausalLM, Experts, MLAAttention, MoE
from dsaserve.parallel.groups import ParallelGroups
from dsaserve.parallel.vocab import VocabShard, vocab_ranges


def _slice(p: nn.Parameter, view: torch.Tensor) -> None:
    p.data = view.contiguous().clone()


def _chunk(size: int, rank: int, parts: int) -> tuple[int, int]:
    """Rank's [start, stop) of `size` cut in `parts` equal chunks."""
    n = size // parts
    return rank * n, (rank + 1) * n


def _shard_mlp(mlp: MLP, rank: int, size: int) -> None:
    rows = _chunk(mlp.gate_proj.weight.shape[0], rank, size)
    fp8.shard_linear(mlp.gate_proj, rows=rows)
    fp8.shard_linear(mlp.up_proj, rows=rows)
    fp8.shard_linear(mlp.down_proj, cols=rows)


def shard_model(model: DsaForCausalLM, groups: ParallelGroups, p: ParallelConfig) -> None:
    check_divisible(model.cfg, p)
    model.groups = groups
    tp, r = groups.tp.size, groups.tp.rank_in_group
    use_ep = p.enable_expert_parallel and groups.ep.size > 1
    for m in model.modules():
        if isinstance(m, MLAAttention):
            m.groups, m.comm_backend = groups, p.dcp_comm_backend
            if tp > 1:
                # this rank's heads are a contiguous range of rows (q_b, kv_b), of columns (o)
                for proj in (m.q_b_proj, m.kv_b_proj):
                    fp8.shard_linear(proj, rows=_chunk(proj.weight.shape[0], r, tp))
                fp8.shard_linear(m.o_proj, cols=_chunk(m.o_proj.weight.shape[1], r, tp))
                m.num_heads //= tp
        elif isinstance(m, MoE):
            if use_ep:
                m.ep = groups.ep
            elif tp > 1:
                _shard_experts_tp(m.experts, r, tp)
                if m.shared_experts is not None:
                    _shard_mlp(m.shared_experts, r, tp)
                m.reduce = groups.tp
    if tp > 1:  # the vocabulary, and dense FFN layers (not shared experts: their MoE's)
        vocab = model.vocab = VocabShard.of(groups.tp, model.cfg.vocab_size)
        _slice(model.model.embed_tokens.weight,
               model.model.embed_tokens.weight[vocab.start : vocab.stop])
        fp8.shard_linear(model.lm_head, rows=(vocab.start, vocab.stop))
        for layer in model.model.layers:
            if isinstance(layer.mlp, MLP):
                _shard_mlp(layer.mlp, r, tp)
                layer.mlp.reduce = groups.tp
    if use_ep:
        for m in model.modules():
            if isinstance(m, Experts):
                per = m.w13.shape[0] // groups.ep.size
                m.first = groups.ep.rank_in_group * per
                held = slice(m.first, m.first + per)
                for p in (m.w13, m.w2) + ((m.w13_scale_inv, m.w2_scale_inv) if m.fp8 else ()):
                    _slice(p, p[held])


def _shard_experts_tp(experts: Experts, rank: int, size: int) -> None:
    start, stop = _chunk(experts.inter, rank, size)
    rows = slice(start, stop)
    gate, up = experts.w13[:, : experts.inter], experts.w13[:, experts.inter :]
    _slice(experts.w13, torch.cat((gate[:, rows], up[:, rows]), dim=1))
    _slice(experts.w2, experts.w2[:, :, rows])
    experts.inter = stop - start
    experts.inter_range = experts.inter_range.sub(start, stop)
    if experts.fp8:  # the scale blocks covering the kept rows, for gate and up alike
        s13, s2, blocks = experts.w13_scale_inv, experts.w2_scale_inv, experts.inter_range.blocks
        ib = s13.shape[1] // 2
        _slice(s13, torch.cat((s13[:, :ib][:, blocks], s13[:, ib:][:, blocks]), dim=1))
        _slice(s2, s2[:, :, blocks])


# Checkpoint names and how TP cuts them: rows or columns, per head (attention) or in equal chunks.
_HEAD_ROWS = re.compile(r"\.self_attn\.(q_b_proj|kv_b_proj)\.weight$")
_HEAD_COLS = re.compile(r"\.self_attn\.o_proj\.weight$")
_DENSE = re.compile(r"\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARED = re.compile(r"\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")
_ROUTED = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")  # the target's (MTP copies: dropped)


def expert_parallel(groups: ParallelGroups, p: ParallelConfig) -> bool:
    return p.enable_expert_parallel and groups.ep.size > 1


def first_expert(cfg: ModelConfig, groups: ParallelGroups, p: ParallelConfig) -> int:
    """Global id of the first routed expert this rank holds (0 without EP)."""
    if not expert_parallel(groups, p):
        return 0
    return groups.ep.rank_in_group * (cfg.n_routed_experts // groups.ep.size)


def checkpoint_narrower(cfg: ModelConfig, groups: ParallelGroups, p: ParallelConfig
                        ) -> Callable[[str, torch.Tensor], torch.Tensor] | None:
    """name, full checkpoint tensor → the part this rank keeps (None: keep everything)."""
    tp, r = groups.tp.size, groups.tp.rank_in_group
    if tp == 1:
        return None
    use_ep = expert_parallel(groups, p)
    heads = cfg.num_attention_heads
    start, stop = vocab_ranges(cfg.vocab_size, tp)[r]

    def chunk(t: torch.Tensor, dim: int) -> torch.Tensor:
        size = t.shape[dim] // tp
        return t.narrow(dim, r * size, size)

    def narrow(name: str, t: torch.Tensor) -> torch.Tensor:
        if name in _VOCAB:
            return t[start:stop]
        if _HEAD_ROWS.search(name):
            return chunk(t.view(heads, -1, t.shape[1]), 0).reshape(-1, t.shape[1])
        if _HEAD_COLS.search(name):
            return chunk(t.view(t.shape[0], heads, -1), 1).reshape(t.shape[0], -1)
        proj = None
        for pattern, sharded in ((_DENSE, True), (_SHARED, not use_ep), (_ROUTED, not use_ep)):
            m = pattern.search(name)
            if m is not None:
                proj = m.group(1) if sharded else None
                break
        if proj is None:
            return t
        return chunk(t, 1 if proj == "down_proj" else 0)

    return narrow

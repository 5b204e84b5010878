"""Sharding a loaded model over its engine's ranks (TP heads and intermediates, EP experts).

TP shards attention heads (q_b_proj and kv_b_proj rows, o_proj columns) and the intermediate of
dense MLPs, shared experts and — without EP — every routed expert; partial outputs are all-reduced
over the TP group. The latent KV projection and the indexer stay replicated: every TP rank stores
the whole latent cache and scores every query, which is why TP scales badly for this model.
EP gives each rank n_routed_experts / world experts.

The full checkpoint is loaded first and sliced afterwards, which is simple and exact; loading only
the local slices is the known next step for checkpoints that do not fit one GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.config import ConfigError, ModelConfig, ParallelConfig
from dsaserve.model.dsa import MLP, DsaForCausalLM, Experts, MLAAttention, MoE
from dsaserve.parallel.groups import ParallelGroups


def _slice(p: nn.Parameter, view: torch.Tensor) -> None:
    p.data = view.contiguous().clone()


def check_divisible(cfg: ModelConfig, p: ParallelConfig) -> None:
    tp, world = p.tensor_parallel_size, p.world_size
    if tp > 1:
        for name in ("num_attention_heads", "intermediate_size", "moe_intermediate_size"):
            if getattr(cfg, name) % tp:
                raise ConfigError(f"--tensor-parallel-size: {tp} does not divide {name} "
                                  f"({getattr(cfg, name)})")
    if p.enable_expert_parallel and cfg.n_routed_experts % world:
        raise ConfigError(f"--enable-expert-parallel: {world} ranks do not divide "
                          f"n_routed_experts ({cfg.n_routed_experts})")


def _shard_mlp(mlp: MLP, rank: int, size: int) -> None:
    inter = mlp.gate_proj.weight.shape[0] // size
    rows = slice(rank * inter, (rank + 1) * inter)
    _slice(mlp.gate_proj.weight, mlp.gate_proj.weight[rows])
    _slice(mlp.up_proj.weight, mlp.up_proj.weight[rows])
    _slice(mlp.down_proj.weight, mlp.down_proj.weight[:, rows])


def shard_model(model: DsaForCausalLM, groups: ParallelGroups, p: ParallelConfig) -> None:
    check_divisible(model.cfg, p)
    model.groups = groups
    tp, r = groups.tp.size, groups.tp.rank_in_group
    use_ep = p.enable_expert_parallel and groups.ep.size > 1
    for m in model.modules():
        if isinstance(m, MLAAttention):
            m.groups, m.comm_backend = groups, p.dcp_comm_backend
            if tp > 1:
                h, hl = m.num_heads, m.num_heads // tp
                heads = slice(r * hl, (r + 1) * hl)
                w = m.q_b_proj.weight
                _slice(w, w.view(h, -1, w.shape[1])[heads].reshape(-1, w.shape[1]))
                w = m.kv_b_proj.weight
                _slice(w, w.view(h, -1, w.shape[1])[heads].reshape(-1, w.shape[1]))
                w = m.o_proj.weight
                _slice(w, w.view(w.shape[0], h, -1)[:, heads].reshape(w.shape[0], -1))
                m.num_heads = hl
        elif isinstance(m, MoE):
            if use_ep:
                m.ep = groups.ep
            elif tp > 1:
                _shard_experts_tp(m.experts, r, tp)
                if m.shared_experts is not None:
                    _shard_mlp(m.shared_experts, r, tp)
                m.reduce = groups.tp
    if tp > 1:  # dense FFN layers (not shared experts, which their MoE handles)
        for layer in model.model.layers:
            if isinstance(layer.mlp, MLP):
                _shard_mlp(layer.mlp, r, tp)
                layer.mlp.reduce = groups.tp
    if use_ep:
        for m in model.modules():
            if isinstance(m, Experts):
                per = m.w13.shape[0] // groups.ep.size
                m.first = groups.ep.rank_in_group * per
                _slice(m.w13, m.w13[m.first : m.first + per])
                _slice(m.w2, m.w2[m.first : m.first + per])


def _shard_experts_tp(experts: Experts, rank: int, size: int) -> None:
    inter = experts.inter // size
    rows = slice(rank * inter, (rank + 1) * inter)
    gate, up = experts.w13[:, : experts.inter], experts.w13[:, experts.inter :]
    _slice(experts.w13, torch.cat((gate[:, rows], up[:, rows]), dim=1))
    _slice(experts.w2, experts.w2[:, :, rows])
    experts.inter = inter

"""The DSA model (GLM-5.x `glm_moe_dsa` and DeepSeek-V3.2 `deepseek_v32` share it): MLA attention
with q-LoRA, the lightning indexer with IndexShare, sparse attention over the selected rows, the
noaux_tc MoE, and the MTP layer. MODEL_SPEC.md §2 and §5 are the maths; parameters carry the
checkpoint's names (routed experts are stacked: `mlp.experts.w13` [E, 2I, H], `mlp.experts.w2`
[E, H, I]).

All tokens of a step are flattened ([N, hidden]); `AttentionMetadata` says which request each token
belongs to and where its KV goes. Each layer:

    1. q latent (q_a → RMSNorm) → q heads; latent KV c (kv_a → RMSNorm) and RoPE key k_pe
    2. write c, k_pe (and the indexer key) at the tokens' slots (all ranks compute, owners write)
    3. indices: own indexer (full layers) or the previous full layer's (shared layers)
    4. attention: absorbed MQA over the selected rows (576 → 512), or the dense MHA path for batches
       where every query sees ≤ top-k keys (only when sparse_mla_force_mqa is off)
    5. W_UV up-projection, o_proj; then the FFN (dense SwiGLU or MoE)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.config import ModelConfig
from dsaserve.kernels import formats, fp8_weights
from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.kernels.registry import AttentionBackend, use_kernels
from dsaserve.kv import layout
from dsaserve.model import fp8, fused, moe_compute
from dsaserve.model.precision import held_in_fp32
from dsaserve.model.rope import RotaryTable, apply_rope
from dsaserve.parallel import cp_attention, ep
from dsaserve.parallel.groups import Group, ParallelGroups
from dsaserve.parallel.vocab import VocabShard


@dataclass
class LayerCache:
    """One layer's paged caches on this rank."""

    kv: torch.Tensor  # [num_blocks, B, L+R] model dtype, or [num_blocks, B, 656] uint8 (fp8_ds_mla)
    # [num_blocks, B, D] or [num_blocks, B·(D+4)] uint8; None on shared (IndexShare) layers
    index: torch.Tensor | None


def _fp32_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.float32), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x):  # the same arithmetic in one pass (kernels/triton/norm.py)
            from dsaserve.kernels.triton import norm

            return norm.rms_norm(x, self.weight, self.eps)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)  # HF order: cast, then scale

    def add(self, h: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h, d [N, dim] → (this norm of h + d, h + d): the residual stream's add made in the
        norm's pass on a GPU (kernels/triton/norm.py), in the model's order (the sum rounded
        to h's dtype, then normed)."""
        if use_kernels(h):
            from dsaserve.kernels.triton import norm

            return norm.add_rms_norm(h, d, self.weight, self.eps)
        h = h + d
        return self(h), h


class LayerNormFP32(nn.Module):
    """The indexer's k_norm: a real LayerNorm with bias, computed and stored in fp32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32), requires_grad=False)
        self.bias = _fp32_param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight, self.bias, self.eps)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    layer.weight.requires_grad_(False)
    return layer


def keeps_fp8(cfg: ModelConfig) -> bool:
    """Whether the model keeps the checkpoint's FP8 matrices in FP8 (model/fp8.py): FP8
    checkpoints with DeepSeek's 128 × 128 blocks; other block shapes are dequantized at load."""
    return cfg.fp8_weights is not None and cfg.fp8_weights.block_size == (fp8.BLOCK, fp8.BLOCK)


class Indexer(nn.Module):
    """Lightning indexer (MODEL_SPEC.md §2.4). Keys are written to the index cache every step;
    scores are `Σ_h w[t,h]·ReLU(q_h·k)` with every positive scale folded into w."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.interleaved = cfg.indexer_rope_interleave
        q8 = keeps_fp8(cfg)
        self.wq_b = fp8.linear(cfg.q_lora_rank, self.n_heads * self.head_dim, q8)
        self.wk = fp8.linear(cfg.hidden_size, self.head_dim, q8)
        self.k_norm = LayerNormFP32(self.head_dim, cfg.index_k_norm_eps)
        self.weights_proj = _linear(cfg.hidden_size, self.n_heads).float()  # fp32, as the reference

    # The RoPE part is the FIRST qk_rope_head_dim dims here (in MLA q it is the last):
    # apply_rope rotates the first 2·cos.shape[-1] columns and copies the rest.
    def keys(self, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """k = wk(x) [N, D] → keys [N, D] fp32 (LayerNorm, then RoPE)."""
        return apply_rope(self.k_norm(k), cos, sin, self.interleaved)

    def queries(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q = wq_b(qr) [N, Hi·D] → queries [N, Hi, D] in the model dtype."""
        return apply_rope(q.view(q.shape[0], self.n_heads, self.head_dim), cos, sin,
                          self.interleaved)

    def weights(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] → per-head weights [N, Hi] fp32 with nh^-1/2 and D^-1/2 folded in."""
        w = self.weights_proj(x.float())
        return w * (self.n_heads**-0.5 * self.head_dim**-0.5)


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.nope = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.scale = cfg.softmax_scale
        q8 = keeps_fp8(cfg)
        self.q_a_proj = fp8.linear(cfg.hidden_size, cfg.q_lora_rank, q8)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps)
        self.q_b_proj = fp8.linear(cfg.q_lora_rank, self.num_heads * cfg.qk_head_dim, q8)
        self.kv_a_proj_with_mqa = fp8.linear(cfg.hidden_size, cfg.kv_cache_width, q8)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps)
        # Dequantized at load even from FP8 checkpoints: attention reads it as W_UK and W_UV
        # per head (absorbed into the query and the output), not as a projection.
        self.kv_b_proj = _linear(cfg.kv_lora_rank, self.num_heads * (self.nope + self.v_dim))
        self.o_proj = fp8.linear(self.num_heads * self.v_dim, cfg.hidden_size, q8)
        self.indexer = Indexer(cfg) if cfg.has_indexer(layer_idx) else None
        # (kv_b_proj's storage, shape, dtype) and the W_UK, W_UV, W_UVᵀ views of it (_w_uk_uv)
        self._w_views: tuple | None = None
        # Set by dsaserve.parallel.tp.shard_model when the engine has several ranks.
        self.groups = ParallelGroups.single()
        self.comm_backend = "ag_rs"
        # After loading (fuse_projections): q_a, wk, kv_a as one product of x, q_b and wq_b as
        # one of the q latent (model/fused.py); None: apart.
        self.x_proj: fused.FusedProjections | None = None
        self.qr_proj: fused.FusedProjections | None = None

    def fuse_projections(self) -> int:
        """Merge the projections that read one input (model/fused.py); the groups merged."""
        wk = () if self.indexer is None else (self.indexer.wk,)
        wq_b = () if self.indexer is None else (self.indexer.wq_b,)
        # whole blocks: at prefill sizes cuBLAS's block-scaled GEMM takes the padded product
        self.x_proj = fused.fuse((self.q_a_proj, self.kv_a_proj_with_mqa, *wk), whole_blocks=True)
        self.qr_proj = fused.fuse((self.q_b_proj, *wq_b), whole_blocks=True)
        return (self.x_proj is not None) + (self.qr_proj is not None)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [n, hidden] → q_a(x) [n, q_lora], kv_a(x) [n, L+R], wk(x) [n, D] (None without
        an indexer): one product when fused."""
        if self.x_proj is not None:
            q_a, kv, *k = self.x_proj(x)
            return q_a, kv, k[0] if k else None
        k = self.indexer.wk(x) if self.indexer is not None else None
        return self.q_a_proj(x), self.kv_a_proj_with_mqa(x), k

    def _project_q(self, qr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """qr [n, q_lora] → q_b(qr) [n, H·(nope+R)] and, when fused, wq_b(qr) [n, Hi·D]
        (else None: computed where the indexer needs it)."""
        if self.qr_proj is not None:
            q, *q_idx = self.qr_proj(qr)
            return q, q_idx[0] if q_idx else None
        return self.q_b_proj(qr), None

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """kv_b_proj viewed per head: W_UK [H, nope, L], W_UV [H, v, L], W_UVᵀ [H, L, v]. The
        views are made once per weight storage (each is a host op of every layer of every step
        otherwise); a weight loaded in place is seen through them, a replaced one makes them
        again."""
        w = self.kv_b_proj.weight
        if self._w_views is None or self._w_views[0] != (w.data_ptr(), w.shape, w.dtype):
            per_head = w.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
            w_uv = per_head[:, self.nope :]
            self._w_views = ((w.data_ptr(), w.shape, w.dtype), per_head[:, : self.nope], w_uv,
                             w_uv.transpose(1, 2))
        return self._w_views[1:]

    def forward(
        self,
        x: torch.Tensor,  # [n, hidden], normalised (this rank's rows)
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [n, rope/2]
        meta: AttentionMetadata,
        cache: LayerCache,
        backend: AttentionBackend,
        prev_topk: torch.Tensor | None,  # [n, topk] from the previous full layer
        prefetch: cp_attention.ContextPrefetch | None = None,  # PCP × DCP: cached contexts
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        n = x.shape[0]
        cos, sin = rope
        # 1. projections (this rank's heads under TP; the latent and the indexer are replicated)
        q_a, kv, idx_k = self._project(x)  # [n, q_lora], [n, L+R], [n, D] | None
        qr = self.q_a_layernorm(q_a)  # [n, q_lora]
        q, idx_q = self._project_q(qr)  # [n, H·(nope+R)], [n, Hi·D] | None
        q = q.view(n, self.num_heads, self.nope + self.rope_dim)
        q_nope, q_rope = q[..., : self.nope], q[..., self.nope :]  # q_rope: before RoPE
        c = self.kv_a_layernorm(kv[:, : self.kv_lora_rank])  # [n, L]
        k_pe = apply_rope(kv[:, self.kv_lora_rank :], cos, sin, True)  # [n, R]
        if idx_k is not None:
            idx_k = self.indexer.keys(idx_k, cos, sin)  # [n, D] fp32

        # 2. cache writes: all ranks compute, the owner writes (PCP: gather every rank's rows first)
        mla_meta = meta.for_mla()  # HiSparse spilling: MLA pages apart from the indexer's
        slots = meta.slot_mapping
        if meta.pcp is not None:
            pcp = self.groups.pcp
            c, k_pe = (
                cp_attention.gather_new_rows(c, meta, pcp),
                cp_attention.gather_new_rows(k_pe, meta, pcp),
            )
            if idx_k is not None:
                idx_k = cp_attention.gather_new_rows(idx_k, meta, pcp)
            slots = meta.pcp.write_slots
        # (HiSparse refuses PCP, so spilling's MLA slots never meet PCP's write slots)
        backend.write_kv(cache.kv, slots if mla_meta is meta else mla_meta.slot_mapping, c, k_pe)
        if idx_k is not None:
            backend.write_index_k(cache.index, slots, idx_k)

        # 3. attention → o [n, heads of this rank, v]
        w_uk, w_uv, w_uv_t = self._w_uk_uv()
        if meta.use_dense:
            q_pe = apply_rope(q_rope, cos, sin, True)
            o, topk = self._dense_attention(q_nope, q_pe, mla_meta, cache, w_uk, w_uv), prev_topk
        else:
            q_full = self._absorbed_query(q_nope, q_rope, w_uk, cos, sin)  # [n, H, L+R]
            if self.indexer is not None:
                if idx_q is None:
                    idx_q = self.indexer.wq_b(qr)  # [n, Hi·D]
                q_idx, w_idx = self.indexer.queries(idx_q, cos, sin), self.indexer.weights(x)
            else:
                q_idx = w_idx = None
            if meta.dcp_size > 1:
                o_lat, topk = self._context_parallel(
                    q_full, q_idx, w_idx, prev_topk, meta, cache, backend, (c, k_pe, idx_k),
                    prefetch,
                )
            else:
                topk = prev_topk
                if q_idx is not None:
                    _, topk = backend.indexer_topk(
                        q_idx, w_idx, cache.index, meta, self.cfg.index_topk
                    )
                if topk is None:
                    raise RuntimeError(
                        f"layer {self.layer_idx}: a shared layer needs earlier top-k"
                    )
                o_lat, _lse = backend.sparse_mla_positions(
                    q_full, cache.kv, topk, mla_meta, self.scale, self.kv_lora_rank
                )  # [n, H, L]
            if o_lat.dtype != w_uv.dtype:  # (a no-op .to is a host op all the same)
                o_lat = o_lat.to(w_uv.dtype)
            o = self._value_output(o_lat, w_uv_t)  # [n, H, v]
        out = self.o_proj(o.reshape(n, self.num_heads * self.v_dim))
        return self.groups.tp.all_reduce(out), topk

    def _context_parallel(self, q_full, q_idx, w_idx, prev_topk, meta, cache, backend,
                          new_rows, prefetch):
        """DCP: shared rows merge partial results over the group; PCP-split rows attend over a
        temporary full copy of their context (parallel/cp_attention.py). `new_rows` are this
        step's (c, k_pe, index keys) of the whole batch in global order (gathered under PCP)."""
        dcp = self.groups.dcp
        # DCP over the TP ranks (no PCP): the group's ranks hold different heads of one query.
        heads_split = self.groups.pcp.size == 1 and self.groups.tp.size > 1
        n = q_full.shape[0]
        o = q_full.new_zeros(n, self.num_heads, self.kv_lora_rank)
        topk = q_full.new_full((n, self.cfg.index_topk), -1, dtype=torch.int32)
        shared = meta.shared_requests()
        groups = [[r for r in range(meta.num_reqs) if shared[r]]]
        groups += [[r] for r in range(meta.num_reqs) if not shared[r]]
        for i, reqs in enumerate(groups):
            if not reqs:
                continue
            sub, rows = meta.select(reqs)
            qi = q_idx[rows] if q_idx is not None else None
            wi = w_idx[rows] if w_idx is not None else None
            prev = prev_topk[rows] if prev_topk is not None else None
            if i > 0:  # one PCP-split request: its own rows only
                r = reqs[0]
                lo, hi = meta.pcp.global_range(r)
                mine = tuple(t[lo:hi] if t is not None else None for t in new_rows)
                cached = (None, None) if prefetch is None else (
                    prefetch.take(self.layer_idx, r, "kv"),
                    prefetch.take(self.layer_idx, r, "index"))
                o[rows], topk[rows] = cp_attention.own_rows_attention(
                    self, qi, wi, q_full[rows], prev, sub, cache, backend, mine, cached
                )
                continue
            top = (
                prev
                if qi is None
                else cp_attention.distributed_topk(
                    qi, wi, cache, sub, backend, dcp, self.cfg.index_topk
                )
            )
            q_all = q_full[rows]
            if heads_split:  # gather every head's query over the group (rank-major = head order)
                q_all = dcp.all_gather(q_all).permute(1, 0, 2, 3).flatten(1, 2)
            o[rows] = cp_attention.merged_sparse_attention(
                q_all,
                top,
                sub,
                cache,
                backend,
                self.scale,
                self.kv_lora_rank,
                dcp,
                self.comm_backend,
                heads_split,
            )
            topk[rows] = top
        return o, topk

    def _absorbed_query(self, q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """q_nope [n, H, nope] · W_UK [H, nope, L] (the absorbed query) beside RoPE(q_rope)
        [n, H, R]: [n, H, L+R], the product written in place by a batched matmul over the
        heads, the rotation in place by its kernel. (A concatenation of the product and q_pe
        copied all of q again: 1.2 GB and 1.46 ms per layer for a 16K-token chunk on an H200;
        rotating into a tensor of its own and copying it in was a launch and a copy more.)"""
        n, heads, _ = q_nope.shape
        q_full = torch.empty(n, heads, self.kv_lora_rank + self.rope_dim, dtype=q_nope.dtype,
                             device=q_nope.device)
        torch.bmm(q_nope.transpose(0, 1), w_uk, out=q_full.transpose(0, 1)[..., :self.kv_lora_rank])
        apply_rope(q_rope, cos, sin, True, out=q_full[..., self.kv_lora_rank:])
        return q_full

    def _value_output(self, o_lat: torch.Tensor, w_uv_t: torch.Tensor) -> torch.Tensor:
        """o_lat [n, H, L] · W_UVᵀ [H, L, v] → o [n, H, v], written in place in the token-major
        layout o_proj reads (an einsum returns it head-major, and the reshape copied it)."""
        n, heads, _ = o_lat.shape
        o = torch.empty(n, heads, self.v_dim, dtype=o_lat.dtype, device=o_lat.device)
        torch.bmm(o_lat.transpose(0, 1), w_uv_t, out=o.transpose(0, 1))
        return o

    def _dense_attention(self, q_nope, q_pe, meta, cache, w_uk, w_uv) -> torch.Tensor:
        """MHA form over the request's whole cached context (each query sees ≤ top-k keys, so this
        equals sparse attention over the indexer's choice); computed in fp32."""
        out = torch.empty(
            q_nope.shape[0], self.num_heads, self.v_dim, dtype=q_nope.dtype, device=q_nope.device
        )
        for r in range(meta.num_reqs):
            s, e = meta.query_range(r)
            if s == e:
                continue
            slots, key_pos = layout.context_slots(
                meta.seq_lens[r], meta.block_table[r], meta.block_size
            )
            rows = formats.read_mla_cache(
                cache.kv, slots.to(q_nope.device), self.kv_lora_rank, self.rope_dim
            )  # [S, L+R] fp32
            c, k_pe = rows[:, : self.kv_lora_rank], rows[:, self.kv_lora_rank :]
            k_nope = torch.einsum("sl,hdl->hsd", c, w_uk.float())  # [H, S, nope]
            v = torch.einsum("sl,hvl->hsv", c, w_uv.float())  # [H, S, v]
            qn = q_nope[s:e].float().transpose(0, 1)  # [H, n, nope]
            qp = q_pe[s:e].float().transpose(0, 1)  # [H, n, R]
            scores = (qn @ k_nope.transpose(1, 2) + qp @ k_pe.T) * self.scale  # [H, n, S]
            visible = key_pos.to(q_nope.device)[None, :] <= meta.positions[s:e, None]  # [n, S]
            scores = scores.masked_fill(~visible, float("-inf"))
            out[s:e] = (scores.softmax(-1) @ v).transpose(0, 1).to(out.dtype)
        return out


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, fp8_kept: bool = False) -> None:
        super().__init__()
        self.gate_proj = fp8.linear(hidden, inter, fp8_kept)
        self.up_proj = fp8.linear(hidden, inter, fp8_kept)
        self.down_proj = fp8.linear(inter, hidden, fp8_kept)
        self.reduce: Group | None = None  # TP: the intermediate is sharded, outputs are summed
        self.gate_up: fused.FusedProjections | None = None  # after loading: one product

    def fuse_projections(self) -> int:
        """Merge gate and up into one matrix (model/fused.py); the groups merged."""
        self.gate_up = fused.fuse((self.gate_proj, self.up_proj))
        return self.gate_up is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None and isinstance(self.down_proj, fp8.Fp8Linear):
            # [gate | up] in one product; silu(gate) · up formed while down's input is quantized
            out = self.down_proj.forward_glu(self.gate_up.merged(x))
        else:
            gate, up = self.gate_up(x) if self.gate_up is not None else (self.gate_proj(x),
                                                                         self.up_proj(x))
            out = self.down_proj(F.silu(gate) * up)
        return self.reduce.all_reduce(out) if self.reduce is not None else out


def route_reference(logits: torch.Tensor, bias: torch.Tensor, cfg: ModelConfig
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router GEMM's logits [N, E] fp32 → (expert ids [N, k] int64, weights [N, k] fp32):
    noaux_tc routing in PyTorch (kernels/triton/routing.py does the same in one launch)."""
    scores = logits.sigmoid()
    choice = scores + bias  # the bias steers selection only
    if cfg.n_group > 1:
        grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [N, G]
        keep = group_scores.topk(cfg.topk_group, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = choice.masked_fill(
            ~mask.repeat_interleave(grouped.shape[-1], 1), float("-inf")
        )
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices  # [N, k]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * cfg.routed_scaling_factor


class Router(nn.Module):
    """Sigmoid noaux_tc routing (MODEL_SPEC.md §2.6), in fp32."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = _fp32_param(cfg.n_routed_experts, cfg.hidden_size)
        self.e_score_correction_bias = _fp32_param(cfg.n_routed_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] → (expert ids [N, k] int64, weights [N, k] fp32)."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight)  # [N, E]
        if use_kernels(logits):  # the same routing in one launch (kernels/triton/routing.py)
            from dsaserve.kernels.triton import routing

            return routing.route(logits, self.e_score_correction_bias, cfg.num_experts_per_tok,
                                 cfg.n_group, cfg.topk_group, cfg.norm_topk_prob,
                                 cfg.routed_scaling_factor)
        return route_reference(logits, self.e_score_correction_bias, cfg)


class Experts(nn.Module):
    """Routed experts, stacked. Under EP this rank holds experts [first, first + count) only; under
    TP without EP every expert's intermediate dimension is sharded instead (`inter_range`: the
    part of the model's intermediate kept). From FP8 checkpoints w13 and w2 stay float8_e4m3fn
    beside their block scales `w13_scale_inv` [E, 2·⌈I/128⌉, ⌈H/128⌉] (gate's blocks, then up's)
    and `w2_scale_inv` [E, ⌈H/128⌉, ⌈I/128⌉] (model/fp8.py)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.inter = i
        self.inter_range = fp8.BlockRange(0, i)
        self.num_experts = e  # the model's; this rank's are w13.shape[0] from `first`
        self.first = 0
        self.fp8 = keeps_fp8(cfg)
        dtype = torch.float8_e4m3fn if self.fp8 else None
        self.w13 = nn.Parameter(torch.zeros(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(e, h, i, dtype=dtype), requires_grad=False)
        if self.fp8:
            ib, hb = -(-i // fp8.BLOCK), -(-h // fp8.BLOCK)
            self.w13_scale_inv = _fp32_param(e, 2 * ib, hb)
            self.w2_scale_inv = _fp32_param(e, hb, ib)

    def weights(self) -> tuple[torch.Tensor, torch.Tensor] | fp8.Fp8Experts:
        """What moe_compute multiplies by: (w13, w2), or their FP8 form."""
        if not self.fp8:
            return self.w13, self.w2
        return fp8.Fp8Experts(self.w13, self.w2, self.w13_scale_inv, self.w2_scale_inv,
                              self.inter_range)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                shared: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden], ids/weights [N, k] → Σ over the experts held here of w·expert(x), fp32;
        with `shared` [N, hidden], plus it, in its dtype."""
        # without reading the routing on the host where the batch allows (model/moe_compute.py)
        return moe_compute.routed_experts(x, self.weights(), ids, weights, self.first,
                                          self.num_experts, shared)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, keeps_fp8(cfg))
            if cfg.n_shared_experts
            else None
        )
        # Set by dsaserve.parallel.tp.shard_model: sum partial outputs over TP (no EP), or
        # dispatch tokens to the experts' ranks over EP.
        self.reduce: Group | None = None
        self.ep: Group | None = None
        # dispatches over `ep` since the last `parallel/lockstep.py` check (DP + EP: every rank
        # of every replica must make the same calls in a step)
        self.ep_calls = 0
        # set by parallel/lockstep.py while every EP rank dispatches as many rows as this one
        # (a DP + EP step padded to one size): no row counts exchanged, nothing read on the host
        self.same_rows = False
        self.size_exchanges = 0  # dispatches that exchanged row counts (tests count them)

    def serve_peers(self, dtype: torch.dtype, device: torch.device) -> None:
        """An EP dispatch with no rows of this rank's own: the experts held here still serve
        the other ranks' rows (DP + EP lock-step, parallel/lockstep.py)."""
        assert self.ep is not None, "serve_peers: no EP group"
        self.ep_calls += 1
        self.size_exchanges += 1
        ep.dispatch_combine(torch.empty((0, self.gate.weight.shape[1]), dtype=dtype,
                                        device=device), self.gate, self.experts, self.ep)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep is None and self.reduce is None and self.shared_experts is not None:
            # the shared experts' output added in the routed experts' combine, and the sum cast
            # to x's dtype there (one pass on the GPU; the same fp32 sum and cast as below)
            ids, weights = self.gate(x)
            return self.experts(x, ids, weights, shared=self.shared_experts(x))
        if self.ep is not None:
            self.ep_calls += 1
            self.size_exchanges += not self.same_rows
            y = ep.dispatch_combine(x, self.gate, self.experts, self.ep,
                                    x.shape[0] if self.same_rows else None)
        else:
            y = self.experts(x, *self.gate(x))
        if self.shared_experts is not None:
            y = y + self.shared_experts(x).float()
        if self.reduce is not None:
            y = self.reduce.all_reduce(y)
        return y.to(x.dtype)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(cfg, layer_idx)
        self.mlp = (
            MoE(cfg) if cfg.is_moe_layer(layer_idx)
            else MLP(cfg.hidden_size, cfg.intermediate_size, keeps_fp8(cfg))
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, delta, rope, meta, cache, backend, prev_topk, prefetch=None):
        """The residual stream comes in as h + delta (delta None: h alone) and leaves so: each
        add is made in the pass of the norm that follows it (RMSNorm.add) → (h, delta, topk)."""
        if delta is None:
            x = self.input_layernorm(h)
        else:
            x, h = self.input_layernorm.add(h, delta)
        attn, topk = self.self_attn(x, rope, meta, cache, backend, prev_topk, prefetch)
        x, h = self.post_attention_layernorm.add(h, attn)
        return h, self.mlp(x), topk


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(DecoderLayer):
    """The next-n prediction layer (MODEL_SPEC.md §5.1): a full DSA decoder layer fed with
    eh_proj([enorm(embed(next token)) | hnorm(h_prev)])."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = _linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.shared_head = SharedHead(cfg)


class DsaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, with_mtp: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        layers: list[nn.Module] = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        if with_mtp:
            layers.append(MTPLayer(cfg, cfg.num_hidden_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DsaForCausalLM(nn.Module):
    """Forward over a flattened batch; returns the final-norm hidden states that sampling and the
    MTP layer consume."""

    def __init__(self, cfg: ModelConfig, *, with_mtp: bool, backend: AttentionBackend) -> None:
        super().__init__()
        self.cfg = cfg
        self.with_mtp = with_mtp
        self.backend = backend
        self.model = DsaModel(cfg, with_mtp)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        # make_draft_head's: the drafts' head (None: lm_head) and the ids of its rows (None:
        # every id, in order)
        self.draft_head: nn.Module | None = None
        self.draft_ids: torch.Tensor | None = None  # [rows] int64, ascending
        self.rotary: RotaryTable | None = None
        self.groups = ParallelGroups.single()
        # TP: this rank's rows of embed_tokens and lm_head (parallel/tp.py); None: every row
        self.vocab: VocabShard | None = None

    @property
    def num_cache_layers(self) -> int:
        """Layers that own a KV cache: the decoder layers plus the MTP layer when present."""
        return self.cfg.num_hidden_layers + int(self.with_mtp)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rotary is None or self.rotary.inv_freq.device != positions.device:
            self.rotary = RotaryTable(self.cfg.rope, self.cfg.qk_rope_head_dim, positions.device)
        return self.rotary.cos_sin(positions)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, meta: AttentionMetadata, caches: list[LayerCache]
    ) -> torch.Tensor:
        """input_ids [N] → hidden [N, hidden] after the final norm."""
        rope = self._rope(meta.positions)
        h, delta = self._embed(input_ids), None  # the residual stream: h + delta
        topk = None
        layers = self.cfg.num_hidden_layers
        prefetch = None
        if meta.pcp is not None and meta.dcp_size > 1:
            # PCP × DCP: gather layer i+1's cached context while layer i computes.
            prefetch = cp_attention.ContextPrefetch(meta, caches, self.groups.dcp_prefetch,
                                                    self.cfg.index_head_dim)
            prefetch.start(0)
        for i in range(layers):
            if prefetch is not None and i + 1 < layers:
                prefetch.start(i + 1)
            h, delta, topk = self.model.layers[i](h, delta, rope, meta, caches[i], self.backend,
                                                  topk, prefetch)
        h = self.model.norm(h) if delta is None else self.model.norm.add(h, delta)[0]
        if meta.pcp is not None:  # every rank samples from the whole batch, in global order
            h = cp_attention.gather_new_rows(h, meta, self.groups.pcp)
        return h

    @torch.inference_mode()
    def forward_mtp(
        self,
        input_ids: torch.Tensor,
        prev_hidden: torch.Tensor,
        meta: AttentionMetadata,
        caches: list[LayerCache],
    ) -> torch.Tensor:
        """One MTP step: input_ids [N] are the *next* tokens, prev_hidden [N, hidden] the
        post-norm states at the same positions → MTP hidden [N, hidden] after shared_head.norm.

        All three are in the global batch order, like `forward`'s output. Under PCP the MTP
        layer follows the target's partition: this rank computes its rows of `meta`, the new KV
        rows are gathered and written by their owners, and the output is gathered back."""
        if not self.with_mtp:
            raise RuntimeError(
                "this checkpoint has no MTP layer; speculative decoding is unavailable"
            )
        layer = self.cfg.num_hidden_layers
        mtp: MTPLayer = self.model.layers[layer]
        prefetch = None
        if meta.pcp is not None:  # this rank's rows only
            input_ids = input_ids[meta.pcp.local_index]
            prev_hidden = prev_hidden[meta.pcp.local_index]
            if meta.dcp_size > 1:  # split rows attend over a full copy of their MTP context
                prefetch = cp_attention.ContextPrefetch(meta, caches, self.groups.dcp_prefetch,
                                                        self.cfg.index_head_dim)
                prefetch.start(layer)
        rope = self._rope(meta.positions)
        e = self._embed(input_ids)
        e = e.masked_fill((meta.positions == 0)[:, None], 0.0)  # position 0 carries no input (vLLM)
        u = mtp.eh_proj(torch.cat((mtp.enorm(e), mtp.hnorm(prev_hidden)), dim=-1))
        h, delta, _ = mtp(u, None, rope, meta, caches[layer], self.backend, None, prefetch)
        h = mtp.shared_head.norm.add(h, delta)[0]
        if meta.pcp is not None:
            h = cp_attention.gather_new_rows(h, meta, self.groups.pcp)
        return h

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] → [N, hidden]."""
        if self.vocab is None:
            return self.model.embed_tokens(input_ids)
        return self.vocab.embed(self.model.embed_tokens.weight, input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] → logits [M, vocab] fp32 (every column, on every rank)."""
        logits = self.lm_head(hidden)
        if self.vocab is not None:
            logits = self.vocab.gather_logits(logits)
        return logits.float()

    def draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, hidden] → [M] int64, the MTP drafts' argmax: over lm_head's logits (as
        compute_logits' argmax, without its fp32 copy: widening is exact, so the same token,
        ties included), or over the draft head's where make_draft_head made one (its rows only,
        mapped back to their ids)."""
        head = self.lm_head if self.draft_head is None else self.draft_head
        logits = head(hidden)  # [M, rows held]: every id, this rank's (TP), or the draft ids'
        if self.vocab is not None:
            return self.vocab.argmax(logits, self.draft_ids)
        best = logits.argmax(-1)
        return best if self.draft_ids is None else self.draft_ids[best]

    def make_draft_head(self, ids: Sequence[int] | None, quantize: bool) -> None:
        """Give the drafts a head of their own: lm_head's rows of `ids` only (ascending; None:
        every row; under TP an equal part of the ids per rank, parallel/vocab.py's
        balanced_rows, a collective), and with `quantize` in block FP8
        (128 × 128 blocks, as the checkpoints store their matrices; model/fp8.py), so that a
        draft's argmax reads fewer bytes. GLM-5.3's lm_head is 154,880 × 6,144, 1.9 GB in bf16
        (0.95 GB as FP8, ~0.2 ms less per draft on an H200), read three times an MTP3 step: work
        only the speculative step does, so its speed-up over plain decoding rises
        (docs/decode.md). The target's logits keep lm_head."""
        w = self.lm_head.weight.detach()  # [rows held, hidden]
        if ids is not None and self.vocab is not None:
            w, self.draft_ids = self.vocab.balanced_rows(w, ids)
        elif ids is not None:
            self.draft_ids = torch.tensor(ids, dtype=torch.int64, device=w.device)
            w = w[self.draft_ids]
        quantize = quantize and w.shape[0] > 0  # (TP: fewer draft ids than ranks)
        with torch.device("meta"):
            head = fp8.Fp8Linear(w.shape[1], w.shape[0]) if quantize else _linear(w.shape[1],
                                                                                   w.shape[0])
        if quantize:
            wq, scale = fp8_weights.quantize_blocks(w)
            head.weight = nn.Parameter(wq, requires_grad=False)
            head.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        else:
            head.weight = nn.Parameter(w.clone(), requires_grad=False)
        self.draft_head = head

    # ---- construction ---------------------------------------------------------------------------
    @staticmethod
    def build(
        cfg: ModelConfig,
        *,
        with_mtp: bool,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device | str,
        shard: Callable[[DsaForCausalLM], None] | None = None,
    ) -> DsaForCausalLM:
        """Allocate on `device` in `dtype`, except the parameters model/precision.py lists
        (router, indexer weights_proj and k_norm: fp32), uninitialised: the loader fills every
        parameter. `shard` cuts the parameters to this rank's part first, so only that part is
        ever allocated."""
        with torch.device("meta"):
            model = DsaForCausalLM(cfg, with_mtp=with_mtp, backend=backend)
        # FP8 matrices and their fp32 block scales keep their dtypes (model/fp8.py)
        keep = {id(p) for m in model.modules() if isinstance(m, fp8.Fp8Linear)
                for p in m.parameters()}
        keep |= {id(p) for m in model.modules() if isinstance(m, Experts) and m.fp8
                 for p in (m.w13_scale_inv, m.w2_scale_inv)}
        for name, p in model.named_parameters():
            if id(p) not in keep and p.dtype != torch.float8_e4m3fn:
                p.data = p.data.to(torch.float32 if held_in_fp32(name) else dtype)
        if shard is not None:
            shard(model)
        return model.to_empty(device=device).eval()

"""A differentiable, batch-major copy of the DSA forward for training (dsaserve/model/dsa.py is the
serving form: paged caches, inference mode, fused kernels on CUDA).

The maths is MODEL_SPEC.md §2 and §5 term for term, and every parameter carries its checkpoint name
(per-expert modules, `e_score_correction_bias` a buffer), so `state_dict()` is the checkpoint.
Attention is the MHA (non-absorbed) form over [B, T] windows, each starting at position 0:

    mode "dense":   every head sees every earlier token (the model before its indexer exists)
    mode "sparse":  each query sees its full layer's top-k tokens only (IndexShare: shared layers
                    reuse the previous full layer's choice; the MTP layer has its own indexer)

Each indexer layer also returns its KL loss against the attention it serves (DeepSeek-V3.2): the
target is the layer's attention probabilities summed over heads and renormalised, detached; the
indexer's inputs are detached too, so the KL trains the indexer only and the LM loss never
reaches it. In sparse mode the KL is taken over the selected tokens only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.config import ModelConfig
from dsaserve.model.rope import rope_inv_freq

Mode = Literal["dense", "sparse"]


def _fp32(x: torch.Tensor) -> torch.autocast:
    """A region kept in fp32 under bf16 autocast (the router and indexer weights are fp32 in the
    serving path too)."""
    return torch.autocast(device_type=x.device.type, enabled=False)


def _linear(n_in: int, n_out: int) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=False)
    nn.init.normal_(layer.weight, std=n_in**-0.5)
    return layer


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the first 2·cos.shape[-1] columns of x [B, T, ..., d]; cos/sin [T, R/2]. Same
    pairing and layout as dsaserve.model.rope.apply_rope, differentiable, in x's dtype."""
    r = 2 * cos.shape[-1]
    extra = (1,) * (x.dim() - 3)
    c = cos.view(1, cos.shape[0], *extra, cos.shape[1]).to(x.dtype)
    s = sin.view(1, sin.shape[0], *extra, sin.shape[1]).to(x.dtype)
    head, tail = x[..., :r], x[..., r:]
    if interleaved:
        x1, x2 = head[..., 0::2], head[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = head[..., : r // 2], head[..., r // 2 :]
        rot = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((rot, tail), dim=-1) if tail.shape[-1] else rot


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.interleaved = cfg.indexer_rope_interleave
        self.wq_b = _linear(cfg.q_lora_rank, self.n_heads * self.head_dim)
        self.wk = _linear(cfg.hidden_size, self.head_dim)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=cfg.index_k_norm_eps)
        self.weights_proj = _linear(cfg.hidden_size, self.n_heads)

    def scores(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden], qr [B, T, q_lora] → I [B, T, T] fp32, -inf above the diagonal:
        I[t, s] = Σ_h w[t, h] · ReLU(q_h[t] · k[s]) with nh^-1/2 · D^-1/2 folded into w."""
        b, t, _ = x.shape
        q = rope(self.wq_b(qr).view(b, t, self.n_heads, self.head_dim), cos, sin,
                 self.interleaved)
        k = rope(self.k_norm(self.wk(x).float()), cos, sin, self.interleaved)  # [B, T, D]
        with _fp32(x):
            w = self.weights_proj(x.float()) * (self.n_heads**-0.5 * self.head_dim**-0.5)
            logits = torch.einsum("bthd,bsd->bths", q.float(), k.float()).relu()  # [B, T, Hi, T]
            scores = torch.einsum("bths,bth->bts", logits, w)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        return scores.masked_fill(~causal, float("-inf"))


def topk_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [B, T, T] (-inf above the diagonal) → bool [B, T, T]: the top-k earlier tokens of
    each query. A query with ≤ k earlier tokens sees them all (top-k also returns masked ones,
    which the causal mask removes again), as in the serving path."""
    t = scores.shape[-1]
    idx = scores.topk(min(k, t), dim=-1).indices
    chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, idx, True)
    return chosen & torch.ones(t, t, dtype=torch.bool, device=scores.device).tril()


def indexer_kl(scores: torch.Tensor, attn: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ softmax(I)) per query, averaged: p = attention probabilities [B, H, T, T] summed over
    heads and L1-normalised (the target, detached), both restricted to `visible` [B|1, T, T]."""
    p = attn.detach().sum(1).masked_fill(~visible, 0.0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-20)  # [B, T, T]
    log_q = scores.masked_fill(~visible, float("-inf")).log_softmax(-1)
    kl = torch.where(visible & (p > 0), p * (p.clamp_min(1e-20).log() - log_q), 0.0)
    return kl.sum(-1).mean()


@dataclass
class Topk:
    """What a full layer hands the shared layers after it: its selection mask [B, T, T]."""

    mask: torch.Tensor | None = None


class MLAAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.h, self.nope, self.rope_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, \
            cfg.qk_rope_head_dim
        self.v_dim, self.lora = cfg.v_head_dim, cfg.kv_lora_rank
        self.q_a_proj = _linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps)
        self.q_b_proj = _linear(cfg.q_lora_rank, self.h * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = _linear(cfg.hidden_size, cfg.kv_cache_width)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps)
        self.kv_b_proj = _linear(cfg.kv_lora_rank, self.h * (self.nope + self.v_dim))
        self.o_proj = _linear(self.h * self.v_dim, cfg.hidden_size)
        self.indexer = Indexer(cfg) if cfg.has_indexer(layer_idx) else None
        # Measurements (benchmarks/trained_model.py) set a dict here: each forward stores its
        # attention probabilities [B, H, T, T] and indexer scores [B, T, T] into it.
        self.probe: dict[str, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mode: Mode,
                shared: Topk, with_indexer: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [B, T, hidden] normalised → (out [B, T, hidden], indexer KL or None)."""
        b, t, _ = x.shape
        qr = self.q_a_layernorm(self.q_a_proj(x))  # [B, T, q_lora]
        q = self.q_b_proj(qr).view(b, t, self.h, self.nope + self.rope_dim)
        q_nope, q_pe = q[..., : self.nope], rope(q[..., self.nope :], cos, sin, True)
        kv = self.kv_a_proj_with_mqa(x)
        c = self.kv_a_layernorm(kv[..., : self.lora])  # [B, T, L]
        k_pe = rope(kv[..., self.lora :], cos, sin, True)  # [B, T, R]
        kvb = self.kv_b_proj(c).view(b, t, self.h, self.nope + self.v_dim)
        k_nope, v = kvb[..., : self.nope], kvb[..., self.nope :]
        scores = (torch.einsum("bthd,bshd->bhts", q_nope, k_nope)
                  + torch.einsum("bthr,bsr->bhts", q_pe, k_pe)) * self.cfg.softmax_scale

        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()[None]  # [1, T, T]
        idx_scores = None
        # The indexer's inputs are detached: its KL trains the indexer alone.
        if self.indexer is not None and (with_indexer or mode == "sparse"):
            idx_scores = self.indexer.scores(x.detach(), qr.detach(), cos, sin)
            if mode == "sparse":
                shared.mask = topk_mask(idx_scores.detach(), self.cfg.index_topk)
        visible = causal if mode == "dense" else shared.mask
        if visible is None:
            raise RuntimeError("sparse mode: a shared layer before any full layer")
        attn = scores.float().masked_fill(~visible[:, None], float("-inf")).softmax(-1)
        o = torch.einsum("bhts,bshv->bthv", attn.to(v.dtype), v).reshape(b, t, -1)
        kl = indexer_kl(idx_scores, attn, visible) if idx_scores is not None else None
        if self.probe is not None:
            self.probe.update(attn=attn.detach(), scores=idx_scores)
        return self.o_proj(o), kl


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, inter)
        self.up_proj = _linear(hidden, inter)
        self.down_proj = _linear(inter, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid noaux_tc routing (MODEL_SPEC.md §2.6). The correction bias is a buffer: it steers
    selection only and is moved by the load-balancing rule (`balance`), not by gradients."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.randn(cfg.n_routed_experts, cfg.hidden_size)
                                   * cfg.hidden_size**-0.5)
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        self.load: torch.Tensor | None = None  # tokens per expert in the last forward

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] → (ids [N, k], weights [N, k] fp32)."""
        cfg = self.cfg
        with _fp32(x):
            scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        choice = scores.detach() + self.e_score_correction_bias
        if cfg.n_group > 1:
            grouped = choice.view(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
            keep = grouped.topk(2, dim=-1).values.sum(-1).topk(cfg.topk_group, dim=-1).indices
            mask = torch.zeros(choice.shape[0], cfg.n_group, dtype=torch.bool,
                               device=x.device).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(grouped.shape[-1], 1),
                                        float("-inf"))
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
        weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        self.load = torch.bincount(ids.flatten(), minlength=cfg.n_routed_experts)
        return ids, weights * cfg.routed_scaling_factor

    @torch.no_grad()
    def balance(self, rate: float) -> None:
        """DeepSeek-V3's auxiliary-loss-free balancing: raise the bias of under-loaded experts and
        lower it for over-loaded ones by `rate`."""
        if self.load is not None:
            load = self.load.float()
            self.e_score_correction_bias += rate * (load.mean() - load).sign()


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size
                                   * cfg.n_shared_experts) if cfg.n_shared_experts else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, hidden]
        ids, weights = self.gate(flat)
        out = torch.zeros(flat.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            tok, slot = (ids == e).nonzero(as_tuple=True)
            if tok.numel():
                y = expert(flat[tok]).float() * weights[tok, slot, None]
                out = out.index_add(0, tok, y)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat).float()
        return out.to(x.dtype).view(shape)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MLAAttention(cfg, layer_idx)
        self.mlp = (MoE(cfg) if cfg.is_moe_layer(layer_idx)
                    else MLP(cfg.hidden_size, cfg.intermediate_size))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, cos, sin, mode: Mode, shared: Topk, with_indexer: bool):
        a, kl = self.self_attn(self.input_layernorm(h), cos, sin, mode, shared, with_indexer)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h)), kl


class MTPLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = _linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.shared_head = nn.Module()
        self.shared_head.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        nn.init.normal_(self.embed_tokens.weight, std=1.0)
        layers: list[nn.Module] = [DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)]
        if cfg.has_mtp:
            layers.append(MTPLayer(cfg, cfg.num_hidden_layers))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@dataclass
class Output:
    logits: torch.Tensor  # [B, T, V] fp32: next token
    mtp_logits: torch.Tensor | None  # [B, T-1, V] fp32: the token after next (position t → t+2)
    kl: list[torch.Tensor]  # one indexer KL per indexer layer (the MTP layer's last)


class TrainDsa(nn.Module):
    """GLM-5 / DeepSeek-V3.2 DSA model for training; `state_dict()` holds HF checkpoint names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size)
        inv_freq, self.attention_factor = rope_inv_freq(cfg.rope, cfg.qk_rope_head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def routers(self) -> list[Router]:
        return [m for m in self.modules() if isinstance(m, Router)]

    def indexers(self) -> list[Indexer]:
        return [m for m in self.modules() if isinstance(m, Indexer)]

    def forward(self, ids: torch.Tensor, mode: Mode = "dense", with_indexer: bool = False
                ) -> Output:
        """ids [B, T] (position 0 at column 0) → logits, MTP logits, indexer KLs. Dense mode runs
        the indexers (for their KL) only if `with_indexer`; sparse mode always needs them."""
        b, t = ids.shape
        angles = torch.arange(t, device=ids.device, dtype=torch.float32)[:, None] * self.inv_freq
        cos, sin = angles.cos() * self.attention_factor, angles.sin() * self.attention_factor
        layers = self.model.layers
        h = self.model.embed_tokens(ids)
        shared, kls = Topk(), []
        for i in range(self.cfg.num_hidden_layers):
            h, kl = layers[i](h, cos, sin, mode, shared, with_indexer)
            if kl is not None:
                kls.append(kl)
        hidden = self.model.norm(h)  # [B, T, hidden]
        logits = self.lm_head(hidden).float()
        mtp_logits = None
        if self.cfg.has_mtp and t > 1:
            # At position p the MTP layer reads embed(token p+1) and the target's normed state at
            # p, and predicts token p+2; position 0's embedding is zeroed, as the serving path does.
            mtp: MTPLayer = layers[self.cfg.num_hidden_layers]
            e = self.model.embed_tokens(ids[:, 1:])
            e = torch.cat((torch.zeros_like(e[:, :1]), e[:, 1:]), dim=1)
            u = mtp.eh_proj(torch.cat((mtp.enorm(e), mtp.hnorm(hidden[:, :-1])), dim=-1))
            hm, kl = mtp(u, cos[:-1], sin[:-1], mode, Topk(), with_indexer)
            if kl is not None:
                kls.append(kl)
            mtp_logits = self.lm_head(mtp.shared_head.norm(hm)).float()
        return Output(logits, mtp_logits, kls)

"""Piecewise CUDA graphs for prefill and mixed steps: each layer's work between its attention
calls replayed from a graph, the attention run eager (vLLM's FULL_AND_PIECEWISE mode).

A prefill step cannot be captured whole: the indexer's and sparse MLA's plans (tiles, key
windows, workspace pages) are built on the host from the step's lengths. Everything else in a
layer depends on the step's token count alone: norms, projections, rotary, cache writes, the
indexer's queries and weights, the absorbed query, o_proj, the router, the experts and their
combine — about 45 of a layer's ~50 kernel launches (docs/long_prefill.md). A step of n
tokens runs at the smallest piecewise size ≥ n, over static buffers:

    piece 0       embed, rotary → cos/sin; layer 0 to its attention → q_full, q_idx, w_idx
    eager         layer 0's indexer top-k and sparse MLA over rows [0, n) → o (W_UV applied)
    piece i       layer i − 1 after its attention (o_proj, residual, MoE); layer i to its
                  attention
    …
    piece L       layer L − 1 after its attention; the final norm → hidden

Padding rows (n ≤ row < size) copy the step's last row: its token and position, and after each
attention its output. They compute what that row computes, so the router sends them to that
row's experts, and no other expert's weights are read for them (stale rows would route
anywhere: at 256 experts a few live rows padded to 256 would read most of them). They write
nowhere (slot −1), the attention never reads them, and their outputs are dropped.

One set of buffers at the largest size serves every size (each uses their first rows), and
every graph allocates from one shared pool: the pieces of a step replay in order, so a graph's
temporaries can reuse another's.

A size's L + 1 graphs are captured at its first step (warmed up once, captured, replayed), the
attention calls between them run as usual; later steps of the size replay them. Graphs are
captured on CUDA with a capturable backend on one rank (runner.py `_prefill_graphs`); with
`cudagraph_mode` FULL_AND_PIECEWISE set explicitly, other devices run the same pieces eager
over the buffers, so that the layout is tested on the CPU. Steps this path does not take:
decode-only steps (engine/decode_graph.py), dense attention, context parallelism, HiSparse, and
more tokens than the largest size.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dsaserve.engine import cudagraph
from dsaserve.kernels.metadata import AttentionMetadata
from dsaserve.model.dsa import DsaForCausalLM, LayerCache

logger = logging.getLogger(__name__)


@dataclass
class _Buffers:
    """The static buffers at the largest size (rows) and views of a size's first rows."""

    input_ids: torch.Tensor  # [S] int64
    positions: torch.Tensor  # [S] int64
    slots: torch.Tensor  # [S] int64, −1 past the step's rows
    h: torch.Tensor  # [S, hidden]: the residual stream between a layer's pieces
    q_full: torch.Tensor  # [S, H, L+R]: the absorbed query
    o: torch.Tensor  # [S, H, v]: the attention's output, W_UV applied
    out: torch.Tensor  # [S, hidden]: the step's final-norm hidden states
    # made from the first values stored (by example): cos, sin, the indexer's q and weights
    kept: dict[str, torch.Tensor]

    def rows(self, size: int) -> _Buffers:
        return _Buffers(*(t[:size] for t in (self.input_ids, self.positions, self.slots, self.h,
                                             self.q_full, self.o, self.out)),
                        {k: t[:size] for k, t in self.kept.items()})


class PrefillGraphs:
    """The runner's piecewise path: `size_for` says whether a step takes it and at which size,
    `forward` runs it. `capture`: record each size's pieces in CUDA graphs at its first step and
    replay them; otherwise run the pieces eager over the buffers."""

    def __init__(self, model: DsaForCausalLM, caches: list[LayerCache], sizes: Sequence[int],
                 device: torch.device, capture: bool) -> None:
        self.model = model
        self.caches = caches
        self.sizes = tuple(sorted(sizes))
        self.device = device
        self.capture = capture
        self.num_layers = model.cfg.num_hidden_layers
        self._buffers: _Buffers | None = None
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._pool = None
        self.num_steps = 0  # steps run through the pieces
        self.num_replays = 0  # of them, replayed from graphs

    @property
    def num_graphs(self) -> int:
        return sum(len(g) for g in self._graphs.values())

    def size_for(self, meta: AttentionMetadata) -> int | None:
        """The size a step with this metadata runs at; None: it runs as it is."""
        if (not self.sizes or meta.use_dense or meta.pcp is not None or meta.dcp_size > 1
                or meta.hisparse is not None or meta.mla_block_table is not None):
            return None
        return cudagraph.padded_size(meta.num_tokens, self.sizes)

    @torch.inference_mode()
    def forward(self, size: int, input_ids: torch.Tensor, meta: AttentionMetadata
                ) -> torch.Tensor:
        """model(input_ids, meta) → hidden [n, hidden] (a view of a static buffer, valid until
        the next step of this path), through the pieces of `size` ≥ n."""
        n = input_ids.shape[0]
        buf = self._allocate().rows(size)
        buf.input_ids[:n].copy_(input_ids)
        buf.positions[:n].copy_(meta.positions)
        buf.slots[:n].copy_(meta.slot_mapping)
        if n < size:  # padding rows: copies of the last row that write nowhere
            buf.input_ids[n:].copy_(input_ids[-1:].expand(size - n))
            buf.positions[n:].copy_(meta.positions[-1:].expand(size - n))
            buf.slots[n:].fill_(-1)
        self.num_steps += 1
        graphs = self._graphs.get(size)
        if graphs is None and self.capture:
            self._capture(size, buf, meta)  # (runs the step)
            return buf.out[:n]
        topk = None
        for i in range(self.num_layers + 1):
            if i > 0:
                topk = self._attention(i - 1, buf, meta, topk)
            if graphs is None:
                self._piece(i, buf)()
            else:
                graphs[i].replay()
        self.num_replays += graphs is not None
        return buf.out[:n]

    def _capture(self, size: int, buf: _Buffers, meta: AttentionMetadata) -> None:
        """Run the step, capturing each piece as it comes (warmed up once, captured, then
        replayed). A piece that cannot be captured turns capturing off: the step finishes
        eager over the buffers, and later steps run without this path."""
        logger.info("capturing the pieces of a %d-token prefill step in CUDA graphs", size)
        graphs: list[torch.cuda.CUDAGraph] = []
        topk = None
        for i in range(self.num_layers + 1):
            if i > 0:
                topk = self._attention(i - 1, buf, meta, topk)
            piece = self._piece(i, buf)
            if not self.capture:
                piece()
                continue
            try:
                graph, _ = cudagraph.capture(piece, self._pool, warmup=1)
            except RuntimeError as e:  # a kernel that cannot be captured: serve eager
                logger.warning("capturing piece %d of a %d-token prefill step failed (%s); "
                               "prefill steps run without piecewise graphs from now on",
                               i, size, e)
                self.capture = False
                self.sizes = ()
                piece()
                continue
            self._pool = graph.pool()
            graph.replay()
            graphs.append(graph)
        if self.capture:
            self._graphs[size] = graphs

    def _attention(self, layer: int, buf: _Buffers, meta: AttentionMetadata,
                   prev_topk: torch.Tensor | None) -> torch.Tensor:
        """Layer `layer`'s attention over the step's n rows, eager: o written, its padding rows
        the last row's (→ the layer's topk)."""
        n = meta.num_tokens
        attn = self.model.model.layers[layer].self_attn
        q_idx = buf.kept["q_idx"][:n] if attn.indexer is not None else None
        w_idx = buf.kept["w_idx"][:n] if attn.indexer is not None else None
        o_lat, topk = attn.attend(buf.q_full[:n], q_idx, w_idx, prev_topk, meta,
                                  self.caches[layer], self.model.backend)
        attn.value_output(o_lat, buf.o[:n])
        if n < buf.o.shape[0]:  # the padding rows go on as copies of the last row
            buf.o[n:].copy_(buf.o[n - 1 : n].expand(buf.o.shape[0] - n, -1, -1))
        return topk

    def _piece(self, i: int, buf: _Buffers) -> Callable[[], None]:
        """Piece i over the buffers of one size: layer i − 1 after its attention (i > 0; else
        the embedding and rotary), then layer i up to its attention (i < L; else the final
        norm). Reads and writes only the buffers."""
        model, layers = self.model, self.model.model.layers

        def run() -> None:
            if i == 0:
                h = model.model.embed_tokens(buf.input_ids)
                cos, sin = model._rope(buf.positions)
                self._keep(buf, "cos", cos)
                self._keep(buf, "sin", sin)
            else:
                prev = layers[i - 1]
                h = prev.finish(buf.h, prev.self_attn.output(buf.o))
            if i == self.num_layers:
                buf.out.copy_(model.model.norm(h))
                return
            layer = layers[i]
            buf.h.copy_(h)  # the residual, read after the attention
            _, q_idx, w_idx = layer.self_attn.prepare(
                layer.input_layernorm(h), (buf.kept["cos"], buf.kept["sin"]), buf.slots,
                buf.slots, self.caches[i], model.backend, q_full=buf.q_full)
            if q_idx is not None:
                self._keep(buf, "q_idx", q_idx)
                self._keep(buf, "w_idx", w_idx)

        return run

    def _keep(self, buf: _Buffers, name: str, t: torch.Tensor) -> None:
        """t [size, ...] into the static buffer `name` (made at its first value, zeroed: the
        first run of a piece is never captured)."""
        if name not in buf.kept:
            full = torch.zeros(self._buffers.input_ids.shape[0], *t.shape[1:], dtype=t.dtype,
                               device=t.device)
            self._buffers.kept[name] = full
            buf.kept[name] = full[: t.shape[0]]
        buf.kept[name].copy_(t)

    def _allocate(self) -> _Buffers:
        """The static buffers at the largest size, made at the first step."""
        if self._buffers is None:
            cfg, s, dev = self.model.cfg, self.sizes[-1], self.device
            attn = self.model.model.layers[0].self_attn
            dtype = self.model.model.embed_tokens.weight.dtype
            o_dtype = attn.kv_b_proj.weight.dtype
            with torch.inference_mode():
                self._buffers = _Buffers(
                    input_ids=torch.zeros(s, dtype=torch.int64, device=dev),
                    positions=torch.zeros(s, dtype=torch.int64, device=dev),
                    slots=torch.full((s,), -1, dtype=torch.int64, device=dev),
                    h=torch.zeros(s, cfg.hidden_size, dtype=dtype, device=dev),
                    q_full=torch.zeros(s, attn.num_heads, attn.kv_lora_rank + attn.rope_dim,
                                       dtype=dtype, device=dev),
                    o=torch.zeros(s, attn.num_heads, attn.v_dim, dtype=o_dtype, device=dev),
                    out=torch.zeros(s, cfg.hidden_size, dtype=dtype, device=dev),
                    kept={})
        return self._buffers

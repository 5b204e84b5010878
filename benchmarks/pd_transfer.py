"""P/D KV transfer speed between two processes on this machine, and what the 16-GPU deployment's
links would take (one table).

    python benchmarks/pd_transfer.py                    # 32K and 128K tokens, shm and NIXL
    python benchmarks/pd_transfer.py --layers 8 --tokens 32768
    python benchmarks/pd_transfer.py --backends nixl --memory vram     # GPU → GPU (NIXL, UCX)
    python benchmarks/pd_transfer.py --smoke            # tiny sizes, checks every byte (CI)

A request's KV is measured on a few GLM-5.3-shaped fp8 layers (656-byte MLA rows, 132-byte indexer
keys), then scaled to the whole model's 54,728 B per token (DESIGN §2, from the cost model). Two
measurements per backend and request size:

  1. transport: the consumer (decode side, a spawned process) READs the producer's registered
     buffer of the request's rows, and the producer WRITEs it back; GB/s of each, best of
     `--repeat`, bytes compared;
  2. re-layout: gathering one prefill rank's share out of its DCP-8 caches and scattering it into
     a DP decode rank's pages (kvio), in one process, for interleave 1 (token round robin) and
     interleave = block size (whole pages);
  3. the connector's READ of the same share, per backend and interleave, on the path the
     connector chooses for the pair (disagg/staging.py; the "path" column): zero-copy, segment
     by segment from registered caches into registered caches (descriptors), or staged, one
     segment per source page into a registered staging buffer, then scattered into the pages;
     beside it the zero-copy READ of the same pair, whatever was chosen: how the segment count
     costs;
  4. posting: the host time of posting one request's READs over L region pairs (a layer's MLA
     rows and indexer keys each), as L `read` calls against one `read_regions` (what the
     connector posts since), two agents in one process, tiny segments: the per-transfer cost a
     request pays per layer before and none after (9 pairs: 4 layers + MTP; 156: GLM-5.3).

The "16 GPUs" column is the cost model: a DP decode rank receives the request's whole KV over its
own 400 Gb/s InfiniBand link (50 GB/s), the 8 prefill ranks sending 1/8 each in parallel, so the
receiving link bounds the time: bytes / 50 GB/s.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time

import torch

from dsaserve.config import ModelConfig
from dsaserve.disagg import descriptors, kvio, staging, transport
from dsaserve.disagg.relayout import KVLayout, plan_transfer
from dsaserve.kernels import formats
from dsaserve.model.dsa import LayerCache
from dsaserve.model.presets import preset_config
from dsaserve.plan import costmodel

TABLES = ("transport", "relayout", "zerocopy", "posting")
POSTING_PAIRS = (9, 24, 156)  # region pairs of 4, 16 and 78 layers + MTP (MLA rows, keys)
IB_GBPS = 50.0  # 400 Gb/s InfiniBand per GPU, one direction, GB/s
L, R, D = 512, 64, 128  # GLM-5.3 latent, RoPE and indexer widths


def glm53_bytes_per_token() -> int:
    """The whole model's KV bytes per token (78 MLA layers, 21 indexer layers, the MTP layer)."""
    model = ModelConfig.from_hf(preset_config("glm-5.3"))
    return costmodel.kv_bytes_per_token(model, "fp8_ds_mla").total


def sample_bytes_per_token(layers: int) -> int:
    """The benchmark's layers: each an fp8_ds_mla row and an FP8 indexer key."""
    return layers * (formats.mla_row_bytes(L, R) + formats.index_token_bytes(D))


# ---- transport: two processes --------------------------------------------------------------
def _region(t: transport.KVTransport, name: str, nbytes: int, memory: str) -> torch.Tensor:
    """A registered region of host memory (the transport's own) or of the GPU's (VRAM)."""
    if memory == "vram":
        return t.register(name, torch.zeros(nbytes, dtype=torch.uint8, device="cuda"))
    return t.allocate(name, nbytes)


def _consumer(backend: str, port: int, sizes: list[int], repeat: int, q: mp.Queue,
              memory: str) -> None:
    torch.set_num_threads(1)
    with transport.make_transport(backend, "bench-decode") as t:
        for i, n in enumerate(sizes):
            _region(t, f"r{i}", n, memory)
        side = transport.SideChannel(t.metadata)
        q.put(("port", side.port, t.backend))
        peer = t.add_peer(transport.fetch_metadata(port))
        for i, n in enumerate(sizes):
            best = float("inf")
            for k in range(repeat):
                start = time.perf_counter()
                t.wait(t.read(peer, f"r{i}", f"r{i}", notify=f"read {i} {k}".encode()), 600)
                best = min(best, time.perf_counter() - start)
            got = t.regions[f"r{i}"].tensor
            q.put(("read", i, n / best / 1e9, int(got.sum(dtype=torch.int64))))
            t.regions[f"r{i}"].tensor.zero_()
            q.put(("zeroed", i))
            t.wait_notification(peer, f"written {i}".encode(), 600)
            q.put(("write-check", i, int(got.sum(dtype=torch.int64))))
        t.wait_notification(peer, b"bye", 600)
        side.close()


def _get(q: mp.Queue, proc: mp.Process, timeout_s: float = 600.0) -> tuple:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return q.get(timeout=0.2)
        except Exception:
            if not proc.is_alive():
                raise RuntimeError(f"consumer exited with {proc.exitcode}") from None
    raise TimeoutError("consumer did not report")


def measure_transport(backend: str, sizes: list[int], repeat: int,
                      memory: str = "dram") -> list[tuple[float, float]]:
    """(READ GB/s, WRITE GB/s) per size, between this process and a spawned one, each side's
    region in host memory ("dram") or on the GPU ("vram"; NIXL only)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    gen = torch.Generator().manual_seed(0)
    out = []
    with transport.make_transport(backend, "bench-prefill") as t:
        sums = []
        for i, n in enumerate(sizes):
            buf = _region(t, f"r{i}", n, memory)
            buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen))
            sums.append(int(buf.sum(dtype=torch.int64)))
        side = transport.SideChannel(t.metadata)
        proc = ctx.Process(target=_consumer, args=(backend, side.port, sizes, repeat, q, memory))
        proc.start()
        try:
            _, port, their = _get(q, proc)
            assert their == t.backend == backend, (their, t.backend, backend)
            peer = t.add_peer(transport.fetch_metadata(port))
            for i, n in enumerate(sizes):
                for k in range(repeat):
                    t.wait_notification(peer, f"read {i} {k}".encode(), 600)
                _, _, read_gbps, checksum = _get(q, proc)
                if checksum != sums[i]:
                    raise RuntimeError(f"{backend}: READ of {n} bytes delivered other bytes")
                _get(q, proc)  # the consumer cleared its copy
                best = float("inf")
                for k in range(repeat):
                    notify = f"written {i}".encode() if k == repeat - 1 else b""
                    start = time.perf_counter()
                    t.wait(t.write(peer, f"r{i}", f"r{i}", notify=notify), 600)
                    best = min(best, time.perf_counter() - start)
                _, _, checksum = _get(q, proc)
                if checksum != sums[i]:
                    raise RuntimeError(f"{backend}: WRITE of {n} bytes delivered other bytes")
                out.append((read_gbps, n / best / 1e9))
            t.send_notification(peer, b"bye")
            proc.join(60)
        finally:
            side.close()
            if proc.is_alive():
                proc.kill()
                proc.join()
    return out


# ---- re-layout: one process ----------------------------------------------------------------
def _fp8_caches(num_blocks: int, block_size: int, layers: int) -> list[LayerCache]:
    return [LayerCache(
        kv=torch.randint(0, 256, formats.mla_cache_shape(num_blocks, block_size, True, L, R),
                         dtype=torch.uint8),
        index=torch.randint(0, 256, formats.index_cache_shape(num_blocks, block_size, True, D),
                            dtype=torch.uint8),
    ) for _ in range(layers)]


def measure_relayout(tokens: int, layers: int, interleave: int, repeat: int,
                     block_size: int = 64, dcp: int = 8) -> tuple[float, float, int]:
    """(gather GB/s, scatter GB/s, runs) for prefill rank 0's share (DCP `dcp`) into a DP rank,
    best of `repeat`; checks the bytes against the plan and the rows against the source."""
    per_rank_blocks = -(-tokens // (block_size * dcp))
    src = KVLayout(tuple(range(per_rank_blocks)), block_size, dcp, interleave)
    dst = KVLayout(tuple(range(per_rank_blocks * dcp)), block_size)
    plan = plan_transfer(src, dst, 0, tokens)
    pair = plan.pair(0, 0)
    src_caches = _fp8_caches(per_rank_blocks, block_size, layers)
    dst_caches = _fp8_caches(per_rank_blocks * dcp, block_size, layers)
    src_slots, dst_slots = pair.src_slots(), pair.dst_slots()
    buf = kvio.gather_rows(src_caches, src_slots)  # warm-up, and the buffer
    if buf.numel() != pair.num_rows * kvio.row_bytes(src_caches).per_token:
        raise RuntimeError("re-layout: the buffer is not the size the plan says")
    gather = scatter = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        kvio.gather_rows(src_caches, src_slots, out=buf)
        gather = min(gather, time.perf_counter() - start)
        start = time.perf_counter()
        kvio.scatter_rows(dst_caches, dst_slots, buf)
        scatter = min(scatter, time.perf_counter() - start)
    kv_src = src_caches[-1].kv.view(-1, src_caches[-1].kv.shape[-1])
    kv_dst = dst_caches[-1].kv.view(-1, dst_caches[-1].kv.shape[-1])
    if not torch.equal(kv_src[src_slots], kv_dst[dst_slots]):
        raise RuntimeError("re-layout: the target rows differ from the source rows")
    return buf.numel() / gather / 1e9, buf.numel() / scatter / 1e9, pair.num_runs


def measure_read(backend: str, tokens: int, layers: int, interleave: int, repeat: int,
                 path: str, block_size: int = 64, dcp: int = 8) -> tuple[float, int, str]:
    """(GB/s, segments, path): the decode agent READs prefill rank 0's share from its registered
    caches (two agents in this process), zero-copy into its own caches, or staged into a
    staging buffer and scattered (timed to the last row scattered); `path` "auto" takes the
    connector's choice (`staging.worth_staging`)."""
    per_rank_blocks = -(-tokens // (block_size * dcp))
    src = KVLayout(tuple(range(per_rank_blocks)), block_size, dcp, interleave)
    dst = KVLayout(tuple(range(per_rank_blocks * dcp)), block_size)
    pair = plan_transfer(src, dst, 0, tokens).pair(0, 0)
    tag = f"{interleave}-{tokens}-{path}"
    with transport.make_transport(backend, f"rd-prefill-{tag}") as p, \
            transport.make_transport(backend, f"rd-decode-{tag}") as d:
        src_caches = descriptors.register_caches(p, _fp8_caches(per_rank_blocks, block_size,
                                                                layers))
        dst_caches = descriptors.register_caches(d, _fp8_caches(per_rank_blocks * dcp,
                                                                block_size, layers))
        peer = d.add_peer(p.metadata())
        src_fmt, dst_fmt = (descriptors.layer_formats(c) for c in (src_caches, dst_caches))
        segs = descriptors.plan_segments(pair, src_fmt, dst_fmt)
        staged = staging.plan_staged(pair, src_fmt, dst_fmt)
        if path == "auto":
            path = "staged" if staging.worth_staging(segs, staged) else "zero-copy"
        if path == "staged":
            buf = d.allocate("stage", staged.nbytes)
            targets = [{"kv": (v := kvio.part_views(c))[:1], "index": v[1:]}
                       for c in dst_caches]
            reads = [("stage", f"L{i}.{part}", descriptors.for_read(g))
                     for i, layer in enumerate(staged.reads) for part, g in layer.items()]
        else:
            reads = [(f"L{i}.{part}", f"L{i}.{part}", descriptors.for_read(g))
                     for i, layer in enumerate(segs) for part, g in layer.items()]
        nbytes = sum(n for *_, g in reads for _, _, n in g)
        if nbytes != pair.num_rows * kvio.row_bytes(src_caches).per_token:
            raise RuntimeError(f"{path}: the segments do not move the plan's bytes")
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            for x in [d.read(peer, local, remote, g) for local, remote, g in reads]:
                d.wait(x, 600)
            if path == "staged":
                staging.scatter_staged(staged, buf, targets)
            best = min(best, time.perf_counter() - start)
        for s_c, d_c in zip(src_caches, dst_caches, strict=True):
            kv_src = s_c.kv.view(-1, s_c.kv.shape[-1])
            kv_dst = d_c.kv.view(-1, d_c.kv.shape[-1])
            if not torch.equal(kv_src[pair.src_slots()], kv_dst[pair.dst_slots()]):
                raise RuntimeError(f"{path}: the target rows differ from the source rows")
    return nbytes / best / 1e9, sum(len(g) for *_, g in reads), path


# ---- the table -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+",
                    help="request lengths (default 32768 131072; --smoke: 256 1024)")
    ap.add_argument("--layers", type=int, default=4, help="fp8 layers moved (MLA + indexer)")
    ap.add_argument("--backends", nargs="+", default=["shm", "nixl"])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--memory", choices=("dram", "vram"), default="dram",
                    help="where the transport table's regions live: host memory, or each "
                         "process's GPU (NIXL only; UCX's own variables, e.g. UCX_TLS or "
                         "UCX_PROTO_INFO=y, choose and show its transports)")
    ap.add_argument("--tables", default=",".join(TABLES),
                    help=f"which tables, comma-separated ({', '.join(TABLES)})")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, one repeat (CI)")
    args = ap.parse_args(argv)
    wanted = set(args.tables.split(","))
    if not wanted or wanted - set(TABLES):
        ap.error(f"--tables: expected some of {','.join(TABLES)}, got {args.tables!r}")
    # One copy thread per process, as a connector's transfer thread would have; on a small shared
    # machine torch's default intra-op threads also contend with each other (10x slower here).
    torch.set_num_threads(1)
    if args.smoke:
        args.tokens, args.layers, args.repeat = args.tokens or [256, 1024], 1, 1
    args.tokens = args.tokens or [32768, 131072]
    full = glm53_bytes_per_token()
    sample = sample_bytes_per_token(args.layers)
    if args.memory == "vram" and not torch.cuda.is_available():
        ap.error("--memory vram: no GPU here")
    if args.memory == "vram" and set(args.backends) - {"nixl"}:
        ap.error("--memory vram: only the nixl backend moves GPU memory (--backends nixl)")
    backends = [b for b in args.backends if b != "nixl" or transport.nixl_available()]
    skipped = sorted(set(args.backends) - set(backends))

    print(f"KV per token: GLM-5.3 whole model {full:,} B (cost model); measured on {args.layers} "
          f"fp8 layers = {sample:,} B; times scaled by {full / sample:.2f}")
    if skipped:
        print(f"not measured (not installed): {', '.join(skipped)}")
    sizes = [t * sample for t in args.tokens]
    if "transport" in wanted:
        print_transport(args, backends, sizes, full, sample)
    if "relayout" in wanted:
        print_relayout(args)
    if "zerocopy" in wanted:
        print_zero_copy(args, backends)
    if "posting" in wanted:
        print_posting(backends, (2, 4) if args.smoke else POSTING_PAIRS,
                      5 if args.smoke else 300)
    return 0


def print_transport(args: argparse.Namespace, backends: list[str], sizes: list[int], full: int,
                    sample: int) -> None:
    print()
    print(f"Transport, two processes, regions in {args.memory.upper()}")
    print()
    print("| backend | tokens | bytes moved | READ GB/s | WRITE GB/s | whole-model request | "
          "READ time here | 16 GPUs (IB 50 GB/s) |")
    print("|---|---|---|---|---|---|---|---|")
    for backend in backends:
        speeds = measure_transport(backend, sizes, args.repeat, args.memory)
        for tokens, (read, write) in zip(args.tokens, speeds, strict=True):
            req = tokens * full
            print(f"| {backend} | {tokens:,} | {tokens * sample / 1e6:,.1f} MB | {read:.2f} | "
                  f"{write:.2f} | {req / 1e9:.2f} GB | {req / read / 1e9 * 1e3:,.0f} ms | "
                  f"{req / IB_GBPS / 1e9 * 1e3:,.1f} ms |")


def print_relayout(args: argparse.Namespace) -> None:
    print()
    print("Re-layout (kvio, one process): prefill rank 0 of DCP 8 (block 64) → a DP decode "
          "rank (block 64)")
    print()
    print("| tokens | interleave | runs | gather GB/s | scatter GB/s |")
    print("|---|---|---|---|---|")
    for tokens in args.tokens:
        for interleave in (1, 64):
            gather, scatter, runs = measure_relayout(tokens, args.layers, interleave,
                                                     args.repeat)
            print(f"| {tokens:,} | {interleave} | {runs:,} | {gather:.2f} | {scatter:.2f} |")


def print_zero_copy(args: argparse.Namespace, backends: list[str]) -> None:
    print()
    print("The connector's READ of the same share (two agents, one process): the path it "
          "chooses for the pair, and the zero-copy READ beside it")
    print()
    print("| backend | tokens | interleave | path | segments | GB/s | zero-copy segments | "
          "zero-copy GB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for backend in backends:
        for tokens in args.tokens:
            for interleave in (1, 64):
                gbps, nseg, path = measure_read(backend, tokens, args.layers, interleave,
                                                args.repeat, "auto")
                zc_gbps, zc_nseg = gbps, nseg
                if path != "zero-copy":
                    zc_gbps, zc_nseg, _ = measure_read(backend, tokens, args.layers,
                                                       interleave, args.repeat, "zero-copy")
                print(f"| {backend} | {tokens:,} | {interleave} | {path} | {nseg:,} | "
                      f"{gbps:.2f} | {zc_nseg:,} | {zc_gbps:.2f} |")



def measure_posting(backend: str, pairs: int, repeat: int) -> tuple[float, float]:
    """Host ms of posting READs over `pairs` region pairs of two 656-byte segments each: as
    `pairs` `read` calls, then as one `read_regions` (each posting waited for before the
    next; medians of `repeat`)."""
    with transport.make_transport(backend, "post-prefill") as p, \
            transport.make_transport(backend, "post-decode") as d:
        for i in range(pairs):
            p.allocate(f"r{i}", 1 << 13)
            d.allocate(f"r{i}", 1 << 13)
        peer = d.add_peer(p.metadata())
        p.add_peer(d.metadata())
        items = [(f"r{i}", f"r{i}", [(0, 0, 656), (4096, 4096, 656)]) for i in range(pairs)]
        each, one = [], []
        for _ in range(repeat):
            start = time.perf_counter()
            xfers = [d.read(peer, *item) for item in items]
            each.append(time.perf_counter() - start)
            for x in xfers:
                d.wait(x, 60)
            start = time.perf_counter()
            x = d.read_regions(peer, items)
            one.append(time.perf_counter() - start)
            d.wait(x, 60)
    return 1e3 * statistics.median(each), 1e3 * statistics.median(one)


def print_posting(backends: list[str], pair_counts: tuple[int, ...], repeat: int) -> None:
    print()
    print(f"Posting one request's READs (two agents, one process; medians of {repeat})")
    print()
    print("| backend | region pairs | one `read` per pair (ms) | one `read_regions` (ms) | ratio |")
    print("|---|---:|---:|---:|---:|")
    for backend in backends:
        for pairs in pair_counts:
            each, one = measure_posting(backend, pairs, repeat)
            print(f"| {backend} | {pairs} | {each:.3f} | {one:.3f} | {each / one:.1f}× |")


if __name__ == "__main__":
    sys.exit(main())

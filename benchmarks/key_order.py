"""The indexer's top-k put in key order (kernels/triton/row_topk.py `in_key_order`): its two
sorts against each other and PyTorch's, from CUDA graphs, at decode and prefill row
counts. Each result is checked against `in_key_order_reference` first.

    python benchmarks/key_order.py [--rows 1,4,16,64,256,1024,16384] [--out docs/x.md]

sort32: one int32 sort per row (the key index above the list place); sort64: one int64 sort
per row (the key index above the score's bits). The default (`method=None`) picks sort32
where the rows are short enough (`pack32_max_keys`). (A rank count over many programs per row
was timed here too, no faster at any row count: deleted; docs/decode.md.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import triton

from dsaserve.kernels.triton import row_topk

K = 2048
KEYS = 131072  # the rows' length: sort32 takes it (≤ pack32_max_keys(2048) = 1,048,575)
METHODS = ("sort32", "sort64")


def chosen(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k's output as the list kernels leave it: distinct keys in no order, scores."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    local = torch.rand(rows, KEYS, device="cuda", generator=g).argsort(dim=1)[:, :K]
    values = torch.randn(rows, K, device="cuda", generator=g)
    return values, local.int()


def graph_us(fn) -> float:
    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def measure(rows: int) -> dict[str | None, float]:
    """µs per call of each method (None: the default's choice) and of PyTorch's sort ("torch")
    at `rows` rows, each result checked against the reference first."""
    values, local = chosen(rows, rows)
    want = row_topk.in_key_order_reference(values, local)
    us: dict[str | None, float] = {}
    for method in (*METHODS, None):
        got = row_topk.in_key_order(values, local, KEYS, method)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), method
        us[method] = graph_us(lambda m=method: row_topk.in_key_order(values, local, KEYS, m))
    us["torch"] = graph_us(lambda: row_topk.in_key_order_reference(values, local))
    return us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,64,128,256,1024,16384")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    head = (f"µs per call from CUDA graphs, k = {K}, rows of {KEYS} keys, "
            f"{torch.cuda.get_device_name()}")
    lines = [head, "", "| rows | " + " | ".join(METHODS) + " | PyTorch sort | default | best |",
             "|---:|" + "---:|" * (len(METHODS) + 3)]
    print(head, flush=True)
    for rows in (int(r) for r in args.rows.split(",")):
        us = measure(rows)
        best = min(METHODS, key=lambda m, us=us: us[m])
        line = (f"| {rows} | " + " | ".join(f"{us[m]:.1f}" for m in METHODS)
                + f" | {us['torch']:.1f} | {us[None]:.1f} | {best} |")
        print(line, flush=True)
        lines.append(line)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

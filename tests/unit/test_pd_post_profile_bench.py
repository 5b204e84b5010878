"""benchmarks/pd_post_profile.py (the P/D posting step's host time by part) runs on the CPU at
tiny size over shared memory, a request's READs are one transfer, and a READ into blocks another
request freed posts a few segments per layer and tensor, not one per block (the freed blocks
come back in descending order; a new request's table takes them ascending)."""

from __future__ import annotations

from pathlib import Path

from dsaserve.model.make_model import make_model


def test_smoke_reads_into_reused_blocks_coalesce(load_benchmark, tmp_path: Path) -> None:
    bench = load_benchmark("pd_post_profile")
    args = bench.parse_args(["--smoke", "--tokens", "1024,1024"])
    model_dir = make_model("tiny-glm5", tmp_path / "tiny", with_mtp=True,
                           overrides=bench.GLM53_4_LAYERS)
    rows = bench.measure(args, model_dir, "shm")
    assert [r.tokens for r in rows] == [1024, 1024]
    row_bytes, key_bytes = 656, 132  # fp8_ds_mla MLA row, FP8 indexer key
    for r in rows:
        # 4 layers + MTP: an MLA region each, an indexer region on layers 0-2 and the MTP layer,
        # 9 region pairs READ as one transfer (one peer, one memory kind)
        assert r.reads == 1
        assert r.nbytes == 1023 * (5 * row_bytes + 4 * key_bytes)
        assert r.segments <= 3 * 9, r.segments  # a few runs per region: not one per block (130)
        assert set(r.parts) == {label for label, _ in bench.PARTS}
        assert r.post_ms > 0 and r.profile
        # the running requests' forward is called before the READs are posted (runner.submit)
        assert r.forward_at_ms < r.post_from_ms <= r.post_to_ms < r.post_ms

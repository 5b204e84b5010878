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


def test_smoke_phases_time_the_path_to_the_first_token(load_benchmark, tmp_path: Path) -> None:
    """--tables phases: add_request → the first decoded token by stage and phase, at tiny size.
    The side channel is checked in add_request, which hashes none of the prompt (a P/D arrival
    is hashed once its READs are posted); the READs are posted in the posting step; the
    first-token step runs the model and samples; the stages fit in the total."""
    bench = load_benchmark("pd_post_profile")
    args = bench.parse_args(["--smoke", "--tables", "phases", "--tokens", "1024,2048",
                             "--repeats", "1"])
    model_dir = make_model("tiny-glm5", tmp_path / "tiny", with_mtp=True,
                           overrides=bench.GLM53_4_LAYERS)
    rows, profile = bench.measure_phases(args, model_dir, "shm")
    assert [r.tokens for r in rows] == [1024, 2048] and "engine.py" in profile
    for r in rows:
        ms = r.ms
        assert ms[("add_request", "check (side channel)")] > 0
        assert ms[("add_request", "prefix hashes (update_hashes)")] == 0
        assert ms[("posting step", "· posting (start_receives)")] > 0
        assert ms[("first-token step", "· forward")] > 0 and ms[("first-token step", "· sample")]
        assert sum(ms[(s, bench.WHOLE)] for s in bench.STAGES) <= ms[
            ("total", "to the first decoded token")]
        assert ms[("total", "READ step (→ the step that found them landed)")] <= ms[
            ("total", "to the first decoded token")]
        assert ms[("total", "host, less the forwards")] > 0
    lines = bench.phase_table(rows)
    assert lines[0].count("|") == 5 and all(line.count("|") == 5 for line in lines)

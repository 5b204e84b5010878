"""benchmarks/decode.py --smoke: the decode benchmark's whole path (steady-state steps with and
without MTP3 at synthetic acceptance 2.99, with --async-scheduling with and without MTP3, the
table) on the tiny model, on the CPU."""

from __future__ import annotations


def test_decode_benchmark_smoke(tmp_path, load_benchmark) -> None:
    bench = load_benchmark("decode")
    out = tmp_path / "decode.md"
    assert bench.main(["--smoke", "--device", "cpu", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.count("\n| 40 |") == 8  # batches 1 and 2: plain, MTP3, async, async MTP3
    rows = [line.split("|") for line in text.splitlines() if line.startswith("| 40 |")]
    per_step = {(r[2].strip(), r[3].strip(), r[5].strip()): float(r[9]) for r in rows}
    assert per_step[("1", "no", "no")] == 1.0
    assert 2.0 <= per_step[("1", "yes", "no")] <= 3.0  # 1 + accepted drafts (synthetic 2.99)
    assert per_step[("2", "no", "yes")] == 1.0  # async: one token per step, read a step later
    assert 2.0 <= per_step[("2", "yes", "yes")] <= 3.0  # async MTP3: drafts from the device
    # the same steps from the engine's step log: every row, its steps, the same tokens per step
    log = text[text.index("The engine's step log"):].splitlines()
    log_rows = [line.split("|") for line in log if line.startswith(("| 1 |", "| 2 |"))]
    assert len(log_rows) == 8
    for r in log_rows:
        batch, mtp, async_, steps = r[1].strip(), r[2].strip(), r[4].strip(), int(r[5])
        assert steps == 2 and r[7].strip() == "–"  # no GPU time on the CPU
        assert float(r[9]) == per_step[(batch, mtp, async_)]
        assert (float(r[9]) == 1.0) == (mtp == "no")


def test_decode_benchmark_gaps_smoke(load_benchmark, capsys) -> None:
    """--gaps N: each row's steps profiled again with Python stacks, the idle time inside them
    (on a CPU: all of it, no device) by the host function running then; the synchronised
    steps' windows are their executes, the pipelined ones' one span."""
    bench = load_benchmark("decode")
    assert bench.main(["--smoke", "--device", "cpu", "--gaps", "2"]) == 0
    err = capsys.readouterr().err
    sections = err.split("exposed host time: ")[1:]
    assert len(sections) == 8  # batches 1 and 2: plain, MTP3, async, async MTP3
    for section in sections:
        totals = next(line for line in section.splitlines()
                      if line.startswith("exposed host time "))
        assert "(100.0 %; GPU busy 0.000 ms)" in totals
        gaps = int(totals.split(" in ")[1].split(" gaps")[0])
        assert gaps == (1 if "async True" in section.splitlines()[0] else 2)
        assert "| runner." in section  # the chains start at the runner's step

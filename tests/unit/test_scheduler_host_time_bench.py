"""benchmarks/scheduler_host_time.py at tiny sizes: its decode rows (sync and async) time steps
in which every request stays running, and its allocation row takes blocks that each evict a
cached one."""

from __future__ import annotations


def test_scheduler_host_time_smoke(load_benchmark, capsys) -> None:
    bench = load_benchmark("scheduler_host_time")
    assert len(bench.decode_step_ms(3, 100, 70, async_=False)) == 70
    assert len(bench.decode_step_ms(3, 100, 70, async_=True)) == 70
    assert len(bench.allocate_ms(16, 3)) == 3
    bench.main(["--batch", "2", "--context", "64", "--steps", "5", "--allocate", "8",
                "--repeats", "2"])
    out = capsys.readouterr().out
    assert "| sync | 2 | 64 |" in out and "| async | 2 | 64 |" in out
    assert "BlockPool.allocate(8), all evicting" in out

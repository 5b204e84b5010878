"""Soak: many streaming clients against one `dsaserve serve` for a bounded time, with random
disconnects and aborts; prints what was served, what failed, latency, and the server's RSS and KV
use at the start and the end.

    python benchmarks/soak.py --clients 64 --duration 300          # own server: tiny model, CPU
    python benchmarks/soak.py --clients 16 --duration 20 --json    # the CI version's shape
    python benchmarks/soak.py --url http://127.0.0.1:8000 --pid 1234 --model glm-5.3 ...

Each client loops until the deadline, drawing one behaviour per request (the official openai
client, chat completions with a shared system prompt so the prefix cache is exercised):
    stream      streamed to the end: must end with usage and exactly max_tokens tokens (ignore_eos)
    complete    the same, not streamed
    disconnect  a stream closed by the client after a few chunks        (caused by the test)
    abort       a request cancelled by the client after a random delay (caused by the test)
An error is anything else: an exception, an HTTP error, a short or truncated answer. The targets:
no error, RSS growth below 5 % from the end of the warm-up to the end, and the KV cache back to
zero blocks in use (cached prefix blocks are free: they are evictable) once the clients stop.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

from dsaserve.bench.agentx import percentile
from dsaserve.serve.ports import free_port

# The server `--start-server` runs: small KV pool and context so that the CPU keeps up.
DEFAULT_SERVER_ARGS = ("--block-size 16 --num-gpu-blocks-override 1024 --max-model-len 1024 "
                       "--max-num-seqs 64 --max-num-batched-tokens 1024 --device cpu")
BEHAVIOURS = (("stream", 0.6), ("complete", 0.15), ("disconnect", 0.15), ("abort", 0.1))
WORDS = ("harbour ferry library station water clock mountain valley river forest bread letter "
         "program error message weather forecast answer question machine radio vessel").split()
SYSTEM = "You answer briefly. " * 8  # a shared prefix: prefix-cache hits under load


@dataclass
class Tally:
    served: int = 0  # requests that ran to their end and were checked
    disconnects: int = 0
    aborts: int = 0
    errors: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)  # served requests, end to end
    ttfts_s: list[float] = field(default_factory=list)  # served streams


@dataclass(frozen=True)
class Sample:
    """The server seen from outside at one moment."""

    rss_mib: float | None
    kv_usage: float  # vllm:kv_cache_usage_perc
    running: float
    waiting: float


@dataclass(frozen=True)
class Report:
    clients: int
    duration_s: float
    served: int
    disconnects: int
    aborts: int
    errors: int
    error_examples: list[str]
    requests_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    start: Sample  # after the warm-up, under load
    end: Sample  # after the clients stopped and the engine went idle
    rss_peak_mib: float | None
    rss_growth: float | None  # (end - start) / start
    rss_series: list[tuple[float, float]]  # (seconds since the start, MiB) every ~10 s: a leak
    # grows steadily; allocator high-water marks level off


# ------------------------------------------------------------------------------------------------
# The server, seen from outside
# ------------------------------------------------------------------------------------------------
def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


def scrape(url: str, headers: dict[str, str]) -> dict[str, float]:
    request = urllib.request.Request(f"{url}/metrics", headers=headers)
    with urllib.request.urlopen(request, timeout=10) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name.split("{")[0]] = values.get(name.split("{")[0], 0.0) + float(value)
    return values


def sample(url: str, pid: int | None, headers: dict[str, str]) -> Sample:
    m = scrape(url, headers)
    return Sample(rss_mib(pid), m.get("vllm:kv_cache_usage_perc", float("nan")),
                  m.get("vllm:num_requests_running", float("nan")),
                  m.get("vllm:num_requests_waiting", float("nan")))


def start_server(model: str, server_args: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "dsaserve.serve.cli", model, "--port", str(port),
           "--served-model-name", model, *shlex.split(server_args)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{shlex.join(cmd)} exited: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"no healthy server after 300 s (log: {log_path})")
        time.sleep(0.3)


# ------------------------------------------------------------------------------------------------
# The clients
# ------------------------------------------------------------------------------------------------
def messages(rng: random.Random) -> list[dict[str, str]]:
    question = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


async def one_request(client: openai.AsyncOpenAI, model: str, rng: random.Random,
                      tally: Tally) -> None:
    behaviour = rng.choices([b for b, _ in BEHAVIOURS], [w for _, w in BEHAVIOURS])[0]
    max_tokens = rng.randint(4, 48)
    kwargs = dict(model=model, messages=messages(rng), max_completion_tokens=max_tokens,
                  temperature=rng.choice([0.0, 0.8]), extra_body={"ignore_eos": True})
    start = time.monotonic()
    if behaviour == "complete":
        r = await client.chat.completions.create(**kwargs)
        if r.usage.completion_tokens != max_tokens or r.choices[0].finish_reason != "length":
            raise AssertionError(f"complete: {r.usage.completion_tokens}/{max_tokens} tokens, "
                                 f"finish {r.choices[0].finish_reason}")
        tally.served += 1
        tally.latencies_s.append(time.monotonic() - start)
        return
    if behaviour == "abort":
        task = asyncio.ensure_future(client.chat.completions.create(stream=rng.random() < 0.5,
                                                                    **kwargs))
        await asyncio.sleep(rng.uniform(0.0, 0.5))
        if not task.done():
            task.cancel()
            tally.aborts += 1
        try:
            result = await task
        except asyncio.CancelledError:
            return
        if isinstance(result, openai.AsyncStream):
            await result.close()  # not cancelled in time: still the test's own doing
            tally.aborts += 1
        else:
            tally.served += 1
            tally.latencies_s.append(time.monotonic() - start)
        return
    stream = await client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs)
    leave_after = rng.randint(1, 6) if behaviour == "disconnect" else None
    chunks, ttft, usage, finish = 0, None, None, None
    async with stream:
        async for chunk in stream:
            chunks += 1
            if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                ttft = time.monotonic() - start
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            usage = chunk.usage or usage
            if leave_after is not None and chunks >= leave_after:
                tally.disconnects += 1
                return  # leaving the `async with` closes the connection mid-stream
    if usage is None or usage.completion_tokens != max_tokens or finish != "length":
        raise AssertionError(f"stream: usage {usage}, finish {finish}, wanted {max_tokens}")
    tally.served += 1
    tally.latencies_s.append(time.monotonic() - start)
    if ttft is not None:
        tally.ttfts_s.append(ttft)


async def client_loop(url: str, model: str, api_key: str, seed: int, deadline: float,
                      tally: Tally) -> None:
    rng = random.Random(seed)
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0,
                                  timeout=120) as client:
        while time.monotonic() < deadline:
            try:
                await one_request(client, model, rng, tally)
            except Exception as e:  # every failure is counted; none stops the soak
                tally.errors.append(f"{type(e).__name__}: {e}"[:300])


async def soak(url: str, model: str, api_key: str, pid: int | None, clients: int,
               duration_s: float, warmup_s: float, headers: dict[str, str],
               seed: int) -> Report:
    tally = Tally()
    begin = time.monotonic()
    deadline = begin + duration_s
    tasks = [asyncio.ensure_future(client_loop(url, model, api_key, seed * 1000 + i, deadline,
                                               tally)) for i in range(clients)]
    await asyncio.sleep(warmup_s)
    start = await asyncio.to_thread(sample, url, pid, headers)
    # Served requests before this point were the warm-up's; the figures count the whole run.
    peak = start.rss_mib
    series: list[tuple[float, float]] = []
    while not all(t.done() for t in tasks):
        await asyncio.sleep(1.0)
        rss = rss_mib(pid)
        if rss is not None and peak is not None:
            peak = max(peak, rss)
            now = time.monotonic() - begin
            if not series or now - series[-1][0] >= 10:
                series.append((round(now), round(rss)))
    await asyncio.gather(*tasks)
    elapsed = time.monotonic() - begin
    # The end: wait for the engine to go idle (aborts travel through its inbox).
    end = await asyncio.to_thread(sample, url, pid, headers)
    idle_deadline = time.monotonic() + 30
    while (end.running or end.waiting or end.kv_usage) and time.monotonic() < idle_deadline:
        await asyncio.sleep(0.2)
        end = await asyncio.to_thread(sample, url, pid, headers)
    lat, ttft = tally.latencies_s, tally.ttfts_s
    growth = None
    if start.rss_mib and end.rss_mib:
        growth = (end.rss_mib - start.rss_mib) / start.rss_mib
    return Report(clients=clients, duration_s=round(elapsed, 1), served=tally.served,
                  disconnects=tally.disconnects, aborts=tally.aborts, errors=len(tally.errors),
                  error_examples=tally.errors[:5], requests_per_s=tally.served / elapsed,
                  latency_p50_s=percentile(lat, 50), latency_p99_s=percentile(lat, 99),
                  ttft_p50_s=percentile(ttft, 50), ttft_p99_s=percentile(ttft, 99),
                  start=start, end=end, rss_peak_mib=peak, rss_growth=growth,
                  rss_series=series)


def print_report(r: Report) -> None:
    def mib(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f} MiB"

    print(f"soak: {r.clients} clients, {r.duration_s:.0f} s")
    print(f"  served {r.served} ({r.requests_per_s:.1f}/s), disconnects {r.disconnects}, "
          f"aborts {r.aborts} (by the test), errors {r.errors}")
    for e in r.error_examples:
        print(f"    error: {e}")
    print(f"  latency p50 {r.latency_p50_s:.2f} s, p99 {r.latency_p99_s:.2f} s; "
          f"TTFT p50 {r.ttft_p50_s:.2f} s, p99 {r.ttft_p99_s:.2f} s")
    growth = "-" if r.rss_growth is None else f"{100 * r.rss_growth:+.1f} %"
    print(f"  RSS after warm-up {mib(r.start.rss_mib)}, end {mib(r.end.rss_mib)} ({growth}), "
          f"peak {mib(r.rss_peak_mib)}")
    if r.rss_series:
        print("  RSS over time: " + ", ".join(f"{t:.0f} s {m:.0f}" for t, m in r.rss_series))
    print(f"  KV usage after warm-up {100 * r.start.kv_usage:.1f} % "
          f"({r.start.running:.0f} running), end {100 * r.end.kv_usage:.1f} % "
          f"({r.end.running:.0f} running, {r.end.waiting:.0f} waiting)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=None,
                   help="seconds before the start sample (default: a fifth of --duration)")
    p.add_argument("--url", default=None, help="an existing server (default: start one)")
    p.add_argument("--pid", type=int, default=None, help="the existing server's pid, for RSS")
    p.add_argument("--model", default="tiny-glm5", help="MODEL to serve, or the served name")
    p.add_argument("--server-args", default=DEFAULT_SERVER_ARGS)
    p.add_argument("--api-key", default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="also print the report as one JSON line")
    args = p.parse_args(argv)
    warmup = args.duration / 5 if args.warmup is None else args.warmup
    headers = {"Authorization": f"Bearer {args.api_key}"}
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
        proc, url = start_server(args.model, args.server_args, log)
        pid = proc.pid
        print(f"server: {url} (pid {pid}, log {log})", file=sys.stderr)
    try:
        report = asyncio.run(soak(url, args.model, args.api_key, pid, args.clients,
                                  args.duration, warmup, headers, args.seed))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    print_report(report)
    if args.json:
        print(json.dumps(asdict(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Drive `dsaserve serve` with an agentic workload and print the AgentX headline numbers.

    python -m dsaserve.bench.agentx --trace DIR --start-server [--server-args "..."]
    python -m dsaserve.bench.agentx --trace DIR --url http://127.0.0.1:8000 --mode replay

Two ways to send the workload written by dsaserve.bench.traces (DIR/weka, DIR/workload.json):
  harness  the SemiAnalysis AgentX harness (`agentx` from agentx-harness, installed on its own),
           run unmodified on DIR/weka; its per-request `profile_export.jsonl` is parsed here.
  replay   in process, with the official openai client: each session's turns in order, streaming
           chat with max_completion_tokens, ignore_eos and stream_options.include_usage, as the
           harness sends them; so the numbers can be reproduced where the harness is absent.

Both produce RequestRecords, and one function computes the headline from them, with the
definitions InferenceX applies to `profile_export.jsonl` (profiling-phase rows without error):
    throughput per GPU     = (sum prompt tokens incl. cached + sum output tokens) / window / GPUs
    P90 interactivity      = 1 / P90(inter-token latency)
    P90 E2E interactivity  = 1 / P90(request latency / output tokens)
    TTFT                   = first chunk with non-empty content
The prefix-cache hit rate comes from the server's /metrics (hits / queries over the run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsaserve.bench.traces import HARNESS_BLOCK_SIZE, WEKA_DIR, Session, Workload, load_workload
from dsaserve.serve.ports import free_port

PROFILE_EXPORT = "profile_export.jsonl"


# ------------------------------------------------------------------------------------------------
# Records and the headline
# ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RequestRecord:
    """One request as measured by the client (the harness or the replay)."""

    session_id: str
    turn_index: int
    phase: str  # "warmup" | "profiling": only profiling rows enter the headline
    start_ns: int  # wall clock (time.time_ns) when the request was sent
    end_ns: int  # wall clock when the stream ended
    ttft_ms: float | None  # to the first chunk with non-empty content
    itl_ms: float | None  # (latency - TTFT) / (output tokens - 1); None below 2 tokens
    prompt_tokens: int  # usage.prompt_tokens: cached ones included
    cached_tokens: int  # usage.prompt_tokens_details.cached_tokens
    output_tokens: int  # usage.completion_tokens
    error: str | None = None

    @property
    def latency_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _metric(metrics: dict[str, Any], *names: str) -> Any:
    for name in names:
        if name in metrics and metrics[name].get("value") is not None:
            return metrics[name]["value"]
    return None


def parse_profile_export(path: str | Path) -> list[RequestRecord]:
    """The harness's per-request rows (`{"metadata", "metrics", "error"?}` per line).

    Token counts prefer the server's usage (the AgentX scenario sets --use-server-token-count);
    the client-side sequence lengths are the fallback.
    """
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        meta, metrics = row["metadata"], row.get("metrics", {})
        error = row.get("error")
        records.append(RequestRecord(
            session_id=str(meta.get("conversation_id")),
            turn_index=int(meta.get("turn_index") or 0),
            phase=str(meta.get("benchmark_phase", "profiling")),
            start_ns=int(meta["request_start_ns"]),
            end_ns=int(meta.get("request_end_ns") or meta["request_start_ns"]),
            ttft_ms=_metric(metrics, "time_to_first_token"),
            itl_ms=_metric(metrics, "inter_token_latency"),
            prompt_tokens=int(_metric(metrics, "usage_prompt_tokens", "input_sequence_length")
                              or 0),
            cached_tokens=int(_metric(metrics, "usage_prompt_cache_read_tokens") or 0),
            output_tokens=int(_metric(metrics, "usage_completion_tokens",
                                      "output_sequence_length") or 0),
            error=None if error is None else f"{error.get('type')}: {error.get('message')}",
        ))
    return records


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics (NumPy's
    default); NaN for no values.

        sorted:  v0    v1    v2    v3        n = 4, q = 90
        rank:    0     1     2     3         r = q/100 * (n-1) = 2.7
                             |--.7--|        → v2 + 0.7 * (v3 - v2)
    """
    if not values:
        return math.nan
    v = sorted(values)
    r = q / 100 * (len(v) - 1)
    lo = math.floor(r)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (r - lo) * (v[hi] - v[lo])


@dataclass(frozen=True)
class Headline:
    source: str
    num_requests: int  # profiling rows, failed ones included
    num_errors: int
    ttft_median_ms: float
    ttft_p90_ms: float
    itl_p90_ms: float
    interactivity_p90: float  # tokens/s/user = 1 / P90(ITL)
    e2e_interactivity_p90: float  # tokens/s/user = 1 / P90(latency / output tokens)
    throughput_per_gpu: float  # tokens/s/GPU
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    window_s: float  # first request sent → last response ended
    num_gpus: int
    prefix_cache_hit_rate: float | None  # from /metrics; None where not scraped


def _inverse(x: float) -> float:
    return 1.0 / x if x > 0 else math.nan


def headline(records: Sequence[RequestRecord], *, num_gpus: int = 1, source: str = "",
             prefix_cache_hit_rate: float | None = None) -> Headline:
    """The headline over the profiling rows; latency statistics use the rows without error."""
    rows = [r for r in records if r.phase == "profiling"]
    ok = [r for r in rows if r.error is None]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    itl = [r.itl_ms for r in ok if r.itl_ms is not None]
    norm_latency_s = [r.latency_ms / 1e3 / r.output_tokens for r in ok if r.output_tokens > 0]
    window_s = (max(r.end_ns for r in ok) - min(r.start_ns for r in ok)) / 1e9 if ok else 0.0
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    itl_p90 = percentile(itl, 90)
    return Headline(
        source=source, num_requests=len(rows), num_errors=len(rows) - len(ok),
        ttft_median_ms=percentile(ttft, 50), ttft_p90_ms=percentile(ttft, 90),
        itl_p90_ms=itl_p90, interactivity_p90=_inverse(itl_p90 / 1e3),
        e2e_interactivity_p90=_inverse(percentile(norm_latency_s, 90)),
        throughput_per_gpu=(prompt + output) / window_s / num_gpus if window_s > 0 else math.nan,
        prompt_tokens=prompt, cached_tokens=sum(r.cached_tokens for r in ok),
        output_tokens=output, window_s=window_s, num_gpus=num_gpus,
        prefix_cache_hit_rate=prefix_cache_hit_rate,
    )


def format_headline(h: Headline) -> str:
    def num(x: float, fmt: str = ".1f") -> str:
        return "n/a" if math.isnan(x) else format(x, fmt)

    cached_pct = 100 * h.cached_tokens / h.prompt_tokens if h.prompt_tokens else math.nan
    hit = "n/a" if h.prefix_cache_hit_rate is None else f"{100 * h.prefix_cache_hit_rate:.1f} %"
    rows = [
        ("requests (profiling)", f"{h.num_requests}"),
        ("errors", f"{h.num_errors}"),
        ("TTFT median / P90 (ms)", f"{num(h.ttft_median_ms)} / {num(h.ttft_p90_ms)}"),
        ("ITL P90 (ms)", num(h.itl_p90_ms, ".2f")),
        ("P90 interactivity (tok/s/user)", num(h.interactivity_p90)),
        ("P90 E2E-norm. interactivity (tok/s/user)", num(h.e2e_interactivity_p90)),
        (f"throughput per GPU (tok/s, {h.num_gpus} GPU)", num(h.throughput_per_gpu)),
        ("prompt tokens (cached by usage)",
         f"{h.prompt_tokens:,} ({h.cached_tokens:,} = {num(cached_pct)} %)"),
        ("output tokens", f"{h.output_tokens:,}"),
        ("window (s)", num(h.window_s, ".2f")),
        ("prefix-cache hit rate (/metrics)", hit),
    ]
    width = max(len(k) for k, _ in rows)
    title = f"AgentX headline ({h.source})" if h.source else "AgentX headline"
    return "\n".join([title, *(f"  {k:<{width}}  {v}" for k, v in rows)])


# ------------------------------------------------------------------------------------------------
# The server: /metrics, /v1/models, a managed `dsaserve serve`
# ------------------------------------------------------------------------------------------------
def _http_get(url: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except urllib.error.URLError as e:  # nothing listening, DNS: name the URL
        raise OSError(f"GET {url}: {e.reason}") from e


@dataclass(frozen=True)
class PrefixCacheCounters:
    queries: float  # prompt tokens looked up
    hits: float  # prompt tokens found

    def rate_since(self, before: PrefixCacheCounters) -> float | None:
        queries = self.queries - before.queries
        return (self.hits - before.hits) / queries if queries > 0 else None


def parse_prefix_cache(metrics_text: str) -> PrefixCacheCounters:
    """vLLM's `vllm:prefix_cache_{queries,hits}_total` counters, summed over label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return PrefixCacheCounters(queries=totals["vllm:prefix_cache_queries_total"],
                               hits=totals["vllm:prefix_cache_hits_total"])


def scrape_prefix_cache(base_url: str) -> PrefixCacheCounters:
    status, body = _http_get(f"{base_url}/metrics")
    if status != 200:
        raise RuntimeError(f"GET {base_url}/metrics: HTTP {status}")
    return parse_prefix_cache(body.decode())


def served_model(base_url: str) -> tuple[str, str | None]:
    """(served model name, its `root` path if the server reports one) from GET /v1/models."""
    status, body = _http_get(f"{base_url}/v1/models")
    if status != 200:
        raise RuntimeError(f"GET {base_url}/v1/models: HTTP {status}: {body[:200]!r}")
    card = json.loads(body)["data"][0]
    return card["id"], card.get("root")


@contextmanager
def managed_server(model: str, server_args: Sequence[str], log_path: Path,
                   startup_timeout_s: float = 600.0) -> Iterator[str]:
    """`dsaserve serve MODEL` on a free 127.0.0.1 port; yields its base URL once /health is 200,
    and stops it (SIGTERM, then SIGKILL after 60 s) on exit."""
    port = free_port()
    cmd = [sys.executable, "-m", "dsaserve.serve.cli", model, "--host", "127.0.0.1",
           "--port", str(port), *server_args]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{shlex.join(cmd)} exited with {proc.returncode}:\n{tail}")
            try:
                if _http_get(f"{url}/health", timeout_s=2)[0] == 200:
                    break
            except OSError:
                pass  # not listening yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"{shlex.join(cmd)}: no healthy server after "
                                   f"{startup_timeout_s:.0f} s (log: {log_path})")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------------
# The harness
# ------------------------------------------------------------------------------------------------
def harness_command(harness: str, *, url: str, model: str, weka_dir: Path, tokenizer_dir: str,
                    artifact_dir: Path, concurrency: int, duration_s: float,
                    warmup_requests_per_lane: int, extra: Sequence[str] = ()) -> list[str]:
    """`agentx profile ...` for a local Weka trace directory.

    `agentx profile` locks the AgentX scenario (agentic replay, streaming, ignore_eos, cache-bust
    of the first turn, >= 900 s runs, the published trace set); `--unsafe-override` turns the
    locks a small local run breaks into warnings. Trajectories start at their first turn
    (the scenario samples a start between 25 % and 75 % of each trace, priming the rest during
    warmup), so short sessions are measured whole. The run is closed-loop: lanes replay sessions
    again until the duration ends.
    """
    return [
        harness, "profile",
        "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
        "--custom-dataset-type", "weka_trace", "--input-file", str(weka_dir),
        "--tokenizer", tokenizer_dir, "--unsafe-override",
        "--concurrency", str(concurrency), "--benchmark-duration", f"{duration_s:g}",
        "--trajectory-start-min-ratio", "0", "--trajectory-start-max-ratio", "0",
        "--warmup-requests-per-lane", str(warmup_requests_per_lane),
        "--output-artifact-dir", str(artifact_dir), "--ui-type", "none",
        *extra,
    ]


def weka_block_size(weka_dir: Path) -> int:
    """The block size the traces declare; every trace of one directory must agree."""
    sizes = {json.loads(p.read_text())["block_size"] for p in sorted(weka_dir.glob("*.json"))}
    if not sizes:
        raise FileNotFoundError(f"--trace: no Weka traces (*.json) in {weka_dir}")
    if len(sizes) > 1:
        raise ValueError(f"--trace: traces in {weka_dir} declare different block sizes {sizes}")
    return sizes.pop()


def run_harness(cmd: Sequence[str], log_path: Path) -> int:
    """Run the harness with its output in `log_path`. HF_HUB_OFFLINE is removed from its
    environment: the harness resolves even a local tokenizer directory through the hub client."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    with open(log_path, "wb") as log:
        return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode


# ------------------------------------------------------------------------------------------------
# In-process replay
# ------------------------------------------------------------------------------------------------
class StreamMeter:
    """Timings and usage of one streamed chat completion, chunk by chunk (as the harness takes
    them): TTFT at the first chunk with non-empty content, usage from the last chunk."""

    def __init__(self, session_id: str, turn_index: int) -> None:
        self.session_id = session_id
        self.turn_index = turn_index
        self.start_ns = time.time_ns()
        self._start = time.perf_counter_ns()
        self._first_content_ns: int | None = None
        self._last_chunk: Any = None

    def on_chunk(self, chunk: Any) -> None:
        if self._first_content_ns is None and chunk.choices and chunk.choices[0].delta.content:
            self._first_content_ns = time.perf_counter_ns()
        self._last_chunk = chunk

    def finish(self, error: str | None = None) -> RequestRecord:
        latency_ns = time.perf_counter_ns() - self._start
        usage = getattr(self._last_chunk, "usage", None)
        if error is None and usage is None:
            error = "no usage in the last chunk before [DONE]"
        details = getattr(usage, "prompt_tokens_details", None)
        output = usage.completion_tokens if usage else 0
        ttft_ms = None
        if self._first_content_ns is not None:
            ttft_ms = (self._first_content_ns - self._start) / 1e6
        itl_ms = None
        if ttft_ms is not None and output >= 2:
            itl_ms = (latency_ns / 1e6 - ttft_ms) / (output - 1)
        return RequestRecord(
            session_id=self.session_id, turn_index=self.turn_index, phase="profiling",
            start_ns=self.start_ns, end_ns=self.start_ns + latency_ns, ttft_ms=ttft_ms,
            itl_ms=itl_ms, prompt_tokens=usage.prompt_tokens if usage else 0,
            cached_tokens=(details.cached_tokens or 0) if details else 0, output_tokens=output,
            error=error)


async def _replay_session(client: Any, model: str, session: Session,
                          think_time_scale: float) -> list[RequestRecord]:
    import openai

    records = []
    for turn in session.turns:
        if turn.think_time_s and think_time_scale:
            await asyncio.sleep(turn.think_time_s * think_time_scale)
        meter = StreamMeter(session.id, turn.index)
        error = None
        try:
            stream = await client.chat.completions.create(
                model=model, messages=session.prompt(turn.index), stream=True,
                max_completion_tokens=turn.output_tokens,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            async for chunk in stream:
                meter.on_chunk(chunk)
        except openai.APIError as e:
            error = f"{type(e).__name__}: {e}"
        records.append(meter.finish(error))
    return records


async def replay(workload: Workload, base_url: str, model: str, *, concurrency: int | None = None,
                 think_time_scale: float = 1.0, timeout_s: float = 600.0) -> list[RequestRecord]:
    """Replay every session over HTTP: `concurrency` lanes (default: one per session), each
    playing its sessions one after another, each session's turns in order after their think
    time (scaled; 0 sends at once). Returns one record per request, in completion order."""
    import openai

    lanes = max(1, min(concurrency or len(workload.sessions), len(workload.sessions)))

    async def lane(i: int, client: openai.AsyncOpenAI) -> list[RequestRecord]:
        out = []
        for session in workload.sessions[i::lanes]:
            out += await _replay_session(client, model, session, think_time_scale)
        return out

    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0,
                                  timeout=timeout_s) as client:
        per_lane = await asyncio.gather(*(lane(i, client) for i in range(lanes)))
    return [r for records in per_lane for r in records]


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsaserve.bench.agentx", allow_abbrev=False,
                                description=__doc__.splitlines()[0])
    p.add_argument("--trace", required=True, type=Path,
                   help="directory written by `python -m dsaserve.bench.traces`")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--start-server", action="store_true",
                       help="start `dsaserve serve` on a free 127.0.0.1 port for the run")
    p.add_argument("--mode", choices=("harness", "replay"), default="harness")
    p.add_argument("--model", default="tiny-glm5",
                   help="with --start-server: MODEL for `dsaserve serve` (default: %(default)s)")
    p.add_argument("--server-args", default="",
                   help='with --start-server: more `dsaserve serve` flags, e.g. "--block-size 16"')
    p.add_argument("--harness", default=None,
                   help="path of the harness executable (default: `agentx` on PATH)")
    p.add_argument("--harness-args", default="", help="more flags for `agentx profile`")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory for the harness (default: the served model's root)")
    p.add_argument("--concurrency", type=int, default=None,
                   help="session lanes (default: one per session)")
    p.add_argument("--duration", type=float, default=60.0,
                   help="harness: seconds of profiling (default: %(default)s)")
    p.add_argument("--warmup-requests-per-lane", type=int, default=1,
                   help="harness: max_tokens=1 cache-warming requests per lane, not measured "
                        "(at least 1; default: %(default)s)")
    p.add_argument("--think-time-scale", type=float, default=1.0,
                   help="replay: multiply think times (0: none; default: %(default)s)")
    p.add_argument("--num-gpus", type=int, default=1,
                   help="GPUs of the deployment, for throughput per GPU (default: %(default)s)")
    p.add_argument("--artifact-dir", type=Path, default=None,
                   help="harness artifacts and logs (default: a new temporary directory)")
    return p


def _run(args: argparse.Namespace, base_url: str, artifacts: Path | None) -> int:
    model, root = served_model(base_url)
    before = scrape_prefix_cache(base_url)
    if args.mode == "replay":
        workload = load_workload(args.trace)
        records = asyncio.run(replay(workload, base_url, model, concurrency=args.concurrency,
                                     think_time_scale=args.think_time_scale))
        source, rc = f"in-process replay, {len(workload.sessions)} sessions", 0
    else:
        assert artifacts is not None  # main makes one for the harness
        harness = args.harness or shutil.which("agentx")
        if harness is None:
            raise FileNotFoundError("--harness: no `agentx` on PATH; install agentx-harness in "
                                    "its own venv and pass its bin/agentx, or use --mode replay")
        weka_dir = args.trace / WEKA_DIR
        if (bs := weka_block_size(weka_dir)) != HARNESS_BLOCK_SIZE:
            raise ValueError(f"--trace: traces declare block_size {bs}; the harness tiles "
                             f"{HARNESS_BLOCK_SIZE}-token blocks whatever they declare, so it "
                             "would mis-read them")
        tokenizer = args.tokenizer or root
        if tokenizer is None or not Path(tokenizer).is_dir():
            given = f"{tokenizer} is not a directory" if tokenizer else \
                "the server reports no local model directory"
            raise FileNotFoundError(f"--tokenizer: {given}; pass the tokenizer directory")
        num_sessions = len(list(weka_dir.glob("*.json")))
        cmd = harness_command(harness, url=base_url, model=model, weka_dir=weka_dir,
                              tokenizer_dir=tokenizer, artifact_dir=artifacts / "harness",
                              concurrency=args.concurrency or num_sessions,
                              duration_s=args.duration,
                              warmup_requests_per_lane=args.warmup_requests_per_lane,
                              extra=shlex.split(args.harness_args))
        print(f"harness: {shlex.join(cmd)}", file=sys.stderr)
        export = artifacts / "harness" / PROFILE_EXPORT
        export.unlink(missing_ok=True)  # never report an earlier run's numbers
        rc = run_harness(cmd, artifacts / "harness.log")
        if not export.is_file():
            tail = (artifacts / "harness.log").read_text(errors="replace")[-3000:]
            print(f"harness exited with {rc} and wrote no {PROFILE_EXPORT}:\n{tail}",
                  file=sys.stderr)
            return rc or 1
        records = parse_profile_export(export)
        source = f"{Path(harness).name} harness, {export}"
    rate = scrape_prefix_cache(base_url).rate_since(before)
    print(format_headline(headline(records, num_gpus=args.num_gpus, source=source,
                                   prefix_cache_hit_rate=rate)))
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.num_gpus < 1:
        parser.error(f"argument --num-gpus: expected an integer >= 1, got {args.num_gpus}")
    if args.concurrency is not None and args.concurrency < 1:
        parser.error(f"argument --concurrency: expected an integer >= 1, got {args.concurrency}")
    try:
        artifacts = args.artifact_dir
        if artifacts is None and (args.mode == "harness" or args.start_server):
            artifacts = Path(tempfile.mkdtemp(prefix="agentx-"))
        if artifacts is not None:
            artifacts.mkdir(parents=True, exist_ok=True)
            print(f"artifacts (logs, harness output): {artifacts}", file=sys.stderr)
        if args.start_server:
            server_args = shlex.split(args.server_args)
            assert artifacts is not None
            with managed_server(args.model, server_args, artifacts / "server.log") as url:
                return _run(args, url, artifacts)
        return _run(args, args.url.rstrip("/"), artifacts)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

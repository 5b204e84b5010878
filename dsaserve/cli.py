"""`dsaserve` command line: make-model, generate, serve, router, plan, simulate, train-tiny.

Only the generated text goes to stdout; logs and progress go to stderr, so that scripts can use
the output.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    from dsaserve.engine.args import add_engine_args, int_at_least
    from dsaserve.model.presets import DEFAULT_MODEL

    p = sub.add_parser("generate", help="offline generation: the continuation goes to stdout")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"checkpoint directory or built-in preset (default: {DEFAULT_MODEL})")
    p.add_argument("--prompt", required=True, help="prompt text ('-' reads standard input)")
    p.add_argument("--max-tokens", type=int_at_least(1), default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--report-timing", action="store_true",
                   help="print prefill and mean decode-step times to stderr")
    add_engine_args(p)
    p.set_defaults(func=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from dsaserve.core import RequestError, SamplingParams
    from dsaserve.engine.args import engine_config_from_args
    from dsaserve.engine.engine import LLMEngine

    config = engine_config_from_args(args, args.model)
    engine = LLMEngine.from_config(config)
    if engine.tokenizer is None:
        print(f"error: --model {args.model}: no tokenizer found", file=sys.stderr)
        return 2
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])
    prompt_ids = engine.tokenizer.encode(text)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                ignore_eos=args.ignore_eos)
        engine.add_request("generate-0", prompt_ids, params)
    except RequestError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out_ids: list[int] = []
    step_times: list[float] = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for out in engine.step():
            out_ids.extend(out.new_token_ids)
        step_times.append(time.perf_counter() - t0)
    engine.check_integrity()
    sys.stdout.write(engine.tokenizer.decode(out_ids))
    sys.stdout.write("\n")
    sys.stdout.flush()
    if args.report_timing and step_times:
        decode = step_times[1:] or step_times
        spec = ""
        if config.speculative is not None:  # tokens per verification step (vLLM's definition)
            stats = engine.stats()
            spec = (f", mean acceptance length {stats.spec_decode_mean_acceptance_length:.2f} "
                    f"with {config.num_speculative_tokens} MTP drafts")
        print(f"prompt tokens {len(prompt_ids)}, output tokens {len(out_ids)}, "
              f"first step {step_times[0] * 1e3:.1f} ms, mean decode step "
              f"{sum(decode) / len(decode) * 1e3:.2f} ms ({config.attention.backend}){spec}",
              file=sys.stderr)
        stats = engine.stats()
        print(f"cached prompt tokens: {stats.prefix_cache_hits} from the GPU prefix cache, "
              f"{stats.offload_hits} from the host KV tier", file=sys.stderr)
    engine.shutdown()  # workers stopped; --step-log: its last lines written
    return 0


def build_parser() -> argparse.ArgumentParser:
    from dsaserve.model import make_model
    from dsaserve.plan import cli as plan_cli
    from dsaserve.plan import simulate_cli
    from dsaserve.router import cli as router_cli
    from dsaserve.serve import cli as serve_cli
    from dsaserve.spec import cli as spec_cli
    from dsaserve.train import cli as train_cli

    parser = argparse.ArgumentParser(prog="dsaserve", description=__doc__.splitlines()[0])
    parser.add_argument("--log-level", default="WARNING",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    sub = parser.add_subparsers(dest="command", required=True)
    make_model.add_parser(sub)
    _add_generate_parser(sub)
    serve_cli.add_parser(sub)
    router_cli.add_parser(sub)
    plan_cli.add_parser(sub)
    simulate_cli.add_parser(sub)
    train_cli.add_parser(sub)
    spec_cli.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dsaserve.config import ConfigError

    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        parser.error(str(e))
        return 2


if __name__ == "__main__":
    sys.exit(main())

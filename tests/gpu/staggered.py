"""The GPU engine tests' staggered workload: five code snippets of the trained tiny model joining
at three steps and leaving at different ones (running batches of 1 to 5 requests), greedy."""

from __future__ import annotations

from dsaserve.core import SamplingParams
from dsaserve.tokenizer import Tokenizer

SNIPPETS = ["def fibonacci(n):\n", "import os\n\n\ndef list_files(path):\n",
            "class Stack:\n    def __init__(self):\n", "for i in range(10):\n",
            "def is_prime(n):\n    if n < 2:\n"]
JOINS = [0, 0, 1, 3, 3]  # the step each snippet's request joins at


def run_staggered(engine, tok: Tokenizer) -> dict[str, list[int]]:
    """Every snippet's request added at its step, the engine stepped until all are done →
    the tokens each request generated; the engine's invariants checked at the end."""
    outputs: dict[str, list[int]] = {}
    for step in range(400):
        for i, at in enumerate(JOINS):
            if at == step:
                engine.add_request(f"r{i}", tok.encode(SNIPPETS[i]), SamplingParams(
                    max_tokens=24 + 8 * i, temperature=0.0, ignore_eos=True))
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if step > max(JOINS) and not engine.has_unfinished_requests():
            break
    engine.check_integrity()
    return outputs

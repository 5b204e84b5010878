"""`dsaserve draft-vocab`: the N tokens most frequent in some text, as a draft vocabulary file
for `--speculative-config '{..., "draft_vocab": FILE}'` (spec/draft_vocab.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "draft-vocab", help="write a draft vocabulary: the N tokens most frequent in text",
        description="Tokenize text files with the model's tokenizer and write the --size token "
        "ids most frequent in them (a JSON list) to --out: the tokens MTP drafts may propose "
        "with --speculative-config's \"draft_vocab\". Text like the served traffic (its logs, "
        "or the model's own outputs) gives the best acceptance.")
    p.add_argument("inputs", nargs="+", metavar="TEXT", help="text files (UTF-8)")
    p.add_argument("--model", default=None, help="the model whose tokenizer counts "
                   "(a checkpoint directory or a built-in name; default: the default model)")
    p.add_argument("--size", type=int, required=True, help="how many token ids to keep")
    p.add_argument("--out", required=True, help="the JSON file to write")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from dsaserve.config import ConfigError, ModelConfig
    from dsaserve.engine.args import DEFAULT_MODEL, resolve_model
    from dsaserve.spec import draft_vocab
    from dsaserve.tokenizer import Tokenizer

    model = resolve_model(args.model or DEFAULT_MODEL)
    vocab_size = ModelConfig.from_file(model).vocab_size
    if not 1 <= args.size <= vocab_size:
        raise ConfigError(f"--size: {args.size} is not in [1, the model's vocabulary "
                          f"{vocab_size}]")
    tokenizer = Tokenizer.from_pretrained(model)
    texts = []
    for name in args.inputs:
        try:
            texts.append(Path(name).read_text(encoding="utf-8", errors="replace"))
        except OSError as e:
            raise ConfigError(f"TEXT {name}: cannot be read ({e.strerror or e})") from e
    ids = draft_vocab.most_frequent(
        (tokenizer.encode(t) for t in tqdm(texts, desc="tokenizing", unit="file",
                                           file=sys.stderr)), args.size)
    draft_vocab.write(args.out, ids)
    seen = len(ids)
    print(f"{args.out}: {seen} token ids"
          + (f" (the text holds only {seen} distinct tokens)" if seen < args.size else ""),
          file=sys.stderr)
    return 0

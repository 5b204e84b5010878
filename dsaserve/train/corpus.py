"""The training corpus: the Python standard library's own sources, split by file.

Every machine with Python has this corpus, so the tiny trained model can be rebuilt anywhere (the
exact bytes, and so the model, depend on the Python version: the shipped model names the one it
was trained on). Files are read in sorted order; test packages are left out (their asserts are
repetitive and the model should write library code); a file is held out when a hash of its path
says so, so the split does not move when files are added elsewhere.

    files (sorted) ──► train │ held out (sha256(relative path) mod `held_out_every` == 0)
          │
          ▼
    BPE trained on the train files (tokenizers, deterministic)
          │
          ▼
    token stream: file₀ <eos> file₁ <eos> ...   (int32 tensor)
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from dsaserve.tokenizer import TINY_EOS_TOKEN, train_bpe

_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    """The file split and the tokenizer trained on the train files."""

    root: Path
    train_files: tuple[Path, ...]
    held_out_files: tuple[Path, ...]
    tokenizer: HFTokenizer


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_sources(root: Path, max_files: int | None = None) -> list[Path]:
    """The `.py` files under `root` in sorted order (test packages and site-packages left out);
    the first `max_files` of them if given."""
    files = sorted(
        p for p in root.rglob("*.py")
        if not _SKIPPED_DIRS & set(p.relative_to(root).parts[:-1])
    )
    return files[:max_files] if max_files is not None else files


def is_held_out(relative: str, every: int) -> bool:
    """Whether the file at `relative` (a POSIX path under the root) is held out: 1 in `every`."""
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:8], "little") % every == 0


def read_text(path: Path) -> str:
    # A few stdlib files hold bytes that are not UTF-8 (encoding tests); keep them, replaced.
    return path.read_text(encoding="utf-8", errors="replace")


def build_corpus(root: Path, *, vocab_size: int, held_out_every: int = 20,
                 max_files: int | None = None) -> Corpus:
    """Split the sources under `root` and train a `vocab_size` BPE on the train part."""
    files = list_sources(root, max_files)
    if len(files) < 2:
        raise ValueError(f"--max-files: the corpus at {root} has {len(files)} .py files; need 2+")
    held = [p for p in files if is_held_out(p.relative_to(root).as_posix(), held_out_every)]
    if not held:  # a small slice may miss the hash: hold out its last file
        held = [files[-1]]
    train = [p for p in files if p not in set(held)]
    tok = train_bpe((read_text(p) for p in train), vocab_size)
    return Corpus(root, tuple(train), tuple(held), tok)


def encode_files(tok: HFTokenizer, files: Sequence[Path]) -> torch.Tensor:
    """One token stream [N] int32: each file's tokens followed by the end-of-text token."""
    eos = tok.token_to_id(TINY_EOS_TOKEN)
    encoded = tok.encode_batch([read_text(p) for p in files])
    ids: list[int] = []
    for enc in encoded:
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def sample_windows(stream: torch.Tensor, batch: int, length: int,
                   gen: torch.Generator) -> torch.Tensor:
    """`batch` random windows of `length` tokens from the stream → [batch, length] int64."""
    if stream.numel() <= length:
        raise ValueError(f"--seq-len: {length} is longer than the corpus ({stream.numel()} tokens)")
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    offsets = torch.arange(length)
    return stream[starts[:, None] + offsets[None, :]].long()

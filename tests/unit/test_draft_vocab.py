"""The drafts' vocabulary (spec/draft_vocab.py): the most frequent ids, and `dsaserve draft-vocab`
writing a file that --speculative-config's draft_vocab reads."""

from __future__ import annotations

import json
import re

import pytest

from dsaserve.cli import main
from dsaserve.config import SpecConfig
from dsaserve.spec import draft_vocab
from dsaserve.tokenizer import Tokenizer


def test_most_frequent_ranks_by_count_then_id_and_returns_ids_ascending() -> None:
    seqs = [[7, 7, 7, 3, 3, 9], [9, 1, 5, 5]]  # counts: 7:3, 3:2, 9:2, 5:2, 1:1
    assert draft_vocab.most_frequent(seqs, 3) == [3, 5, 7]  # 9 ties 3 and 5, loses on id
    assert draft_vocab.most_frequent(seqs, 10) == [1, 3, 5, 7, 9]  # fewer distinct than asked
    with pytest.raises(draft_vocab.DraftVocabError, match="at least one token"):
        draft_vocab.most_frequent(seqs, 0)


def test_cli_writes_a_vocabulary_the_speculative_config_reads(tmp_path, capsys) -> None:
    text = tmp_path / "traffic.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 20 + "class C:\n    pass\n")
    out = tmp_path / "vocab.json"
    assert main(["draft-vocab", "--model", "tiny-trained", "--size", "8", "--out", str(out),
                 str(text)]) == 0
    ids = json.loads(out.read_text())
    assert len(ids) == 8 and ids == sorted(ids)
    from dsaserve.engine.args import resolve_model

    encoded = Tokenizer.from_pretrained(resolve_model("tiny-trained")).encode(text.read_text())
    assert ids == draft_vocab.most_frequent([encoded], 8)
    spec = SpecConfig.from_json('{"method": "mtp", "num_speculative_tokens": 3, '
                                f'"draft_vocab": "{out}"}}')
    assert spec.draft_vocab == tuple(ids)


@pytest.mark.parametrize("argv,match", [
    (["--size", "0"], "--size: 0 is not in"),
    (["--size", "4"], "TEXT .*missing.txt: cannot be read"),
])
def test_cli_errors_name_the_flag(tmp_path, capsys, argv, match) -> None:
    with pytest.raises(SystemExit):
        main(["draft-vocab", "--model", "tiny-trained", "--out", str(tmp_path / "v.json"),
              *argv, str(tmp_path / "missing.txt")])
    err = capsys.readouterr().err
    assert re.search(match, err), err

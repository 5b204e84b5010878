"""A damaged checkpoint is a start-up error that names the file and the tensor (exit status 2, no
traceback), whichever way it is damaged: a truncated shard, a shard the index lists but that is
gone, a tensor of the wrong shape, a config.json that lacks a field or holds a bad value."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from dsaserve.cli import main

SHARD = "model-00001-of-00002.safetensors"


def _truncate(d: Path) -> None:
    data = (d / SHARD).read_bytes()
    (d / SHARD).write_bytes(data[: len(data) // 2])


def _cut_header(d: Path) -> None:
    (d / SHARD).write_bytes((d / SHARD).read_bytes()[:4])


def _shrink_embedding(d: Path) -> None:
    tensors = load_file(d / SHARD)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"][:-1].clone()
    save_file(tensors, d / SHARD, metadata={"format": "pt"})


def _drop_shard(d: Path) -> None:
    (d / "model-00002-of-00002.safetensors").unlink()


def _edit_config(**change: object) -> Callable[[Path], None]:
    def edit(d: Path) -> None:
        config = json.loads((d / "config.json").read_text())
        for key, value in change.items():
            if value is None:
                del config[key]
            else:
                config[key] = value
        (d / "config.json").write_text(json.dumps(config))

    return edit


@pytest.mark.parametrize("damage, expected", [
    (_truncate, [f"{SHARD}", "model.embed_tokens.weight: unreadable", "truncated or corrupt"]),
    (_cut_header, [f"{SHARD}", "header too small"]),
    (_shrink_embedding, [f"{SHARD}", "model.embed_tokens.weight: shape mismatch: checkpoint "
                         "[511, 128], module expects [512, 128]"]),
    (_drop_shard, ["model.safetensors.index.json: lists shards that are missing: "
                   "model-00002-of-00002.safetensors"]),
    # HF fills a missing field with the architecture's default: the first tensor it shapes fails.
    (_edit_config(hidden_size=None), [f"{SHARD}", "model.embed_tokens.weight: shape mismatch"]),
    (_edit_config(num_attention_heads="many"), ["num_attention_heads: expected an integer"]),
])
def test_damaged_checkpoint_is_a_start_up_error(model_dirs, tmp_path: Path, capsys, damage,
                                                expected) -> None:
    model = tmp_path / "model"
    shutil.copytree(model_dirs["tiny-glm5"], model)
    damage(model)
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(model), "--prompt", "hi", "--max-tokens", "2",
              "--device", "cpu"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for fragment in expected:
        assert fragment in err, err

"""engines/serve_model.py and e2e_serve's first check: a model folder the server cannot use is refused naming
what is missing, before any unit exists; the local tokenizer's vocabulary covers the model's ids."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engines.serve_model import (
    SPECIAL_BASE,
    SPECIALS,
    UNK,
    VOCAB,
    WORDS,
    ModelFolderError,
    check_folder,
    vocabulary,
    write_tokenizer,
)

ROOT = Path(__file__).resolve().parents[2]


def _folder(tmp_path: Path, *, skip: tuple[str, ...] = (), template: str = "{{ messages }}") -> Path:
    files = {"config.json": {"architectures": ["LlamaForCausalLM"]}, "tokenizer.json": {"model": {}},
             "tokenizer_config.json": {"chat_template": template}}
    for name, value in files.items():
        if name not in skip:
            (tmp_path / name).write_text(json.dumps(value))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    return tmp_path


def test_complete_folder_lists_its_shards(tmp_path: Path) -> None:
    assert check_folder(_folder(tmp_path)) == ["model.safetensors"]


@pytest.mark.parametrize(("skip", "message"), [
    (("tokenizer.json",), "missing its tokenizer: no tokenizer.json"),
    (("tokenizer_config.json",), "missing its tokenizer: no tokenizer_config.json"),
    (("config.json",), "missing its configuration: no config.json"),
])
def test_missing_pieces_are_named(tmp_path: Path, skip: tuple[str, ...], message: str) -> None:
    with pytest.raises(ModelFolderError, match=message):
        check_folder(_folder(tmp_path, skip=skip))


def test_no_chat_template_no_shards_bad_json_and_no_folder_are_named(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    with pytest.raises(ModelFolderError, match="has no chat_template"):
        check_folder(_folder(a, template=""))
    b = tmp_path / "b"
    b.mkdir()
    _folder(b).joinpath("model.safetensors").unlink()
    with pytest.raises(ModelFolderError, match=r"no \*\.safetensors weights"):
        check_folder(b)
    c = tmp_path / "c"
    c.mkdir()
    _folder(c).joinpath("tokenizer.json").write_text("{truncated")
    with pytest.raises(ModelFolderError, match=r"tokenizer\.json is not readable JSON"):
        check_folder(c)
    with pytest.raises(ModelFolderError, match="does not exist"):
        check_folder(tmp_path / "absent")


def test_write_tokenizer_needs_the_weights_first(tmp_path: Path) -> None:
    with pytest.raises(ModelFolderError, match=r"no config\.json"):
        write_tokenizer(tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_vocabulary_covers_every_model_id_once() -> None:
    vocab = vocabulary()
    assert len(vocab) == VOCAB and sorted(vocab.values()) == list(range(VOCAB))
    assert all(vocab[token] == i for i, token in SPECIALS.items())
    assert vocab[UNK] == SPECIAL_BASE - 1 and vocab["\u2581" + WORDS[3]] == 3


def test_driver_refuses_a_folder_without_tokenizer_before_any_request(tmp_path: Path) -> None:
    """No daemon at --state-dir: the refusal must come before the driver opens a session."""
    done = subprocess.run([sys.executable, str(ROOT / "bench/e2e_serve.py"), "--state-dir", str(tmp_path / "none"),
                           "--capsule", "x", "--model", str(_folder(tmp_path, skip=("tokenizer.json",))),
                           "--work", str(tmp_path), "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 1
    assert "missing its tokenizer: no tokenizer.json" in done.stderr

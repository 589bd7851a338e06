"""The model folder `transformers serve` loads (issue 23): engine_llama's weights plus a local tokenizer.

    python engines/serve_model.py tokenizer DIR     add a tokenizer with a chat template (built with the
                                                  `tokenizers` library, no Hub access) to a model folder
    python engines/serve_model.py check DIR         what a server needs is there (exit 1 naming what is not)

The weights come from `engines/engine_llama.py weights DIR` (8B-shaped Llama, random weights from a fixed
seed). The tokenizer covers the model's whole vocabulary (128256 ids, so every id a random model emits
decodes): a word-level vocabulary whose first ids are the words of the benchmark's prompt, then synthetic
words `w<id>`, `<unk>` at 127999, then Llama 3's special tokens at 128000-128255, with Llama 3's chat
template. Decoding adds a space before each word (Metaspace), so a streamed completion reads as words.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

VOCAB = 128256
SPECIAL_BASE = 128000
SPECIALS = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128006: "<|start_header_id|>",
            128007: "<|end_header_id|>", 128009: "<|eot_id|>"}
WORDS = ("system", "user", "assistant", "What", "is", "the", "capital", "of", "France", "?", "Tell", "me", "a",
         "story", "about", "GPUs", "and", "checkpoints", ".", "Hello", ",", "world", "!")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>"
    "\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
UNK = "<unk>"  # words outside the vocabulary (the last id before the special tokens)
# What `transformers serve` (AutoProcessor/AutoTokenizer on a local folder) reads besides the weights.
REQUIRED = ("config.json", "tokenizer.json", "tokenizer_config.json")


class ModelFolderError(Exception):
    """The model folder lacks something the server needs (the message names the file and why)."""


def vocabulary() -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i in range(SPECIAL_BASE - 1):
        vocab["\u2581" + (WORDS[i] if i < len(WORDS) else f"w{i}")] = i
    vocab[UNK] = SPECIAL_BASE - 1
    for i in range(SPECIAL_BASE, VOCAB):
        vocab[SPECIALS.get(i, f"<|reserved_special_token_{i - SPECIAL_BASE}|>")] = i
    return vocab


def write_tokenizer(directory: str | Path) -> None:
    """tokenizer.json (built by the `tokenizers` library), tokenizer_config.json with the chat template,
    and the generation config's end tokens set to Llama 3's."""
    folder = Path(directory)
    if not (folder / "config.json").is_file():
        raise ModelFolderError(f"{folder}: no config.json (write the weights first: engine_llama.py weights)")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel(vocabulary(), unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    tokenizer.add_special_tokens([AddedToken(token, special=True)
                                  for token in vocabulary() if token.startswith("<|")])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIALS[128000], "eos_token": SPECIALS[128009],
        "pad_token": SPECIALS[128001], "unk_token": UNK, "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}, indent=1))
    (folder / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": SPECIALS[128000], "eos_token": SPECIALS[128009], "pad_token": SPECIALS[128001]}))
    generation = folder / "generation_config.json"
    config = json.loads(generation.read_text()) if generation.is_file() else {}
    config.update({"bos_token_id": 128000, "eos_token_id": [128001, 128009], "pad_token_id": 128001})
    generation.write_text(json.dumps(config, indent=1))


def check_folder(directory: str | Path) -> list[str]:
    """The model folder's shards; raises ModelFolderError naming the first missing or unreadable piece."""
    folder = Path(directory)
    if not folder.is_dir():
        raise ModelFolderError(f"model folder {folder} does not exist")
    for name in REQUIRED:
        path = folder / name
        if not path.is_file():
            what = "its tokenizer" if name.startswith("tokenizer") else "its configuration"
            raise ModelFolderError(f"model folder {folder} is missing {what}: no {name} "
                                   "(engines/serve_model.py tokenizer DIR writes one)")
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelFolderError(f"model folder {folder}: {name} is not readable JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ModelFolderError(f"model folder {folder}: {name} is not a JSON object")
        if name == "tokenizer_config.json" and not value.get("chat_template"):
            raise ModelFolderError(f"model folder {folder}: tokenizer_config.json has no chat_template "
                                   "(/v1/chat/completions needs one)")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    if not shards:
        raise ModelFolderError(f"model folder {folder} has no *.safetensors weights")
    return shards


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("command", choices=["tokenizer", "check"])
    parser.add_argument("directory")
    args = parser.parse_args()
    try:
        if args.command == "tokenizer":
            write_tokenizer(args.directory)
        print(json.dumps({"model": args.directory, "shards": check_folder(args.directory)}))
    except ModelFolderError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

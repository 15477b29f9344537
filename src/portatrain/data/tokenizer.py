"""Tokenizers: the built-in byte tokenizer, or a Hugging Face tokenizer directory.

What this file does:
- ``ByteTokenizer``: UTF-8 bytes 0..255 plus BOS (256) and EOS (257); needs no download, never fails.
- ``HFTokenizer``: a Hugging Face tokenizer directory (``tokenizer.json``, plus
  ``tokenizer_config.json`` / ``special_tokens_map.json`` when present) loaded with the ``tokenizers``
  library -- no ``transformers`` needed. BOS, EOS and pad come from the directory's own files.
- ``build_tokenizer(name)``: ``byte`` or a directory path; anything else is a :class:`DataError`.
- ``vocab_problem(tokenizer_vocab, model_vocab)``: the model-side vocabulary check (a tokenizer
  smaller than the embedding is fine -- Llama 3 pads to 128,256 -- a larger one is an error).
- ``copy_tokenizer_files(name, out)``: what ``portatrain export`` puts next to the weights so that
  ``AutoTokenizer.from_pretrained(out)`` works; for ``byte``, files written by
  ``write_byte_tokenizer_files``: the same 258 ids as a ``tokenizers`` byte-level BPE with no merges.

Every tokenizer encodes a document as ``[BOS] + ids + [EOS]`` (no BOS when the tokenizer defines
none). The tokenizer's own post-processor is not used: portatrain adds the special tokens itself,
so a document's tokens are the same whatever template the ``tokenizer.json`` carries.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from portatrain.data.errors import DataError

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)
"""Files of a Hugging Face tokenizer directory that portatrain reads and ``export`` copies."""


class ByteTokenizer:
    """Token ids 0..255 are bytes; 256 is BOS, 257 is EOS (also used as the pad input id)."""

    name = "byte"
    bos_id: int | None = 256
    eos_id = 257
    pad_id = 257
    vocab_size = 258
    chat_template: str | None = None

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_ids(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text, without special tokens (fast path for ``prepare``)."""
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def fingerprint(self) -> dict[str, Any]:
        return {"name": "byte", "vocab_size": self.vocab_size}


class HFTokenizer:
    """A Hugging Face tokenizer directory, read with the ``tokenizers`` library."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.path = Path(path).resolve()
        self.name = str(self.path)
        file = self.path / "tokenizer.json"
        try:
            self._tok = Tokenizer.from_file(str(file))
        except Exception as exc:  # the Rust side raises a plain Exception with a serde message
            raise DataError(
                f"data.tokenizer={self.name!r}: {file} could not be read as a Hugging Face tokenizer "
                f"({exc}); point data.tokenizer at a directory saved by tokenizers or transformers"
            ) from None
        config = _read_json(self.path / "tokenizer_config.json")
        special = _read_json(self.path / "special_tokens_map.json")
        self.chat_template: str | None = config.get("chat_template")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special_id("bos_token", config, special)
        eos_id = self._special_id("eos_token", config, special)
        if eos_id is None:
            raise DataError(
                f"data.tokenizer={self.name!r} defines no eos_token (in tokenizer_config.json or "
                "special_tokens_map.json); portatrain ends every document with EOS: add "
                '"eos_token": "<the end-of-text token>" to tokenizer_config.json'
            )
        self.eos_id: int = eos_id
        pad_id = self._special_id("pad_token", config, special)
        self.pad_id: int = eos_id if pad_id is None else pad_id
        # With add_bos_token=false (e.g. Qwen) the tokenizer's own convention is no BOS.
        if config.get("add_bos_token") is False:
            self.bos_id = None

    def _special_id(self, key: str, config: dict, special: dict) -> int | None:
        value = config.get(key, special.get(key))
        if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
            value = value.get("content")
        if value is None:
            return None
        token_id = self._tok.token_to_id(value)
        if token_id is None:
            raise DataError(
                f"data.tokenizer={self.name!r}: {key}={value!r} is not in the tokenizer's vocabulary; "
                "fix tokenizer_config.json / special_tokens_map.json"
            )
        return token_id

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        head = [self.bos_id] if bos and self.bos_id is not None else []
        return head + ids + ([self.eos_id] if eos else [])

    def encode_ids(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Token ids of each text, without special tokens (one batched call into Rust)."""
        encodings = self._tok.encode_batch_fast(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def fingerprint(self) -> dict[str, Any]:
        digest = hashlib.sha256((self.path / "tokenizer.json").read_bytes()).hexdigest()
        return {"name": self.name, "vocab_size": self.vocab_size, "tokenizer_json_sha256": digest}


Tokenizer = ByteTokenizer | HFTokenizer


def build_tokenizer(name: str) -> Tokenizer:
    """``byte``, or a directory holding a Hugging Face ``tokenizer.json``."""
    if name == "byte":
        return ByteTokenizer()
    path = Path(str(name)).expanduser()
    if path.is_file() and path.name == "tokenizer.json":
        path = path.parent
    if not (path / "tokenizer.json").is_file():
        where = "is not a directory" if not path.is_dir() else "has no tokenizer.json"
        raise DataError(
            f"data.tokenizer={name!r} is unknown: it is not 'byte' and {where}. Use data.tokenizer=byte "
            "or the path of a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json); "
            "save one with tokenizer.save_pretrained(DIR) or download it with huggingface-cli"
        )
    return HFTokenizer(path)


def vocab_problem(tokenizer_vocab: int, model_vocab: int, *, tokenizer_name: str = "") -> str | None:
    """The model-side check: ``None`` when every token id has an embedding row, else the problem.

    A tokenizer smaller than the embedding is fine (Llama 3 pads its 128,256-row embedding past the
    tokenizer's ids); a larger one would index past the embedding.
    """
    if tokenizer_vocab <= model_vocab:
        return None
    named = f" ({tokenizer_name})" if tokenizer_name else ""
    return (
        f"the tokenizer{named} has {tokenizer_vocab} tokens but the model's embedding has {model_vocab} "
        f"rows; set model.vocab_size>={tokenizer_vocab} or use a model flavour with a larger vocabulary"
    )


def copy_tokenizer_files(name: str, out: str | Path) -> list[str]:
    """Copy a Hugging Face tokenizer directory's files into ``out`` (``byte``: write its own).

    Returns the names written. ``AutoTokenizer.from_pretrained(out)`` then loads the tokenizer the
    model was trained with.
    """
    if name == "byte":
        return write_byte_tokenizer_files(out)
    src = Path(str(name)).expanduser()
    if src.is_file():
        src = src.parent
    copied = []
    for file in TOKENIZER_FILES:
        if (src / file).is_file():
            shutil.copyfile(src / file, Path(out) / file)
            copied.append(file)
    return copied


BYTE_SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|eos|>"}
"""How the byte tokenizer's BOS (256) and EOS/pad (257) are spelt in its exported files."""


def write_byte_tokenizer_files(out: str | Path) -> list[str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` for :class:`ByteTokenizer`, so that
    ``AutoTokenizer.from_pretrained(out)`` (lm-eval's ``--model hf`` included) encodes text to its ids.

    A byte-level BPE with no merges: each UTF-8 byte is one token whose id is the byte, spelt as
    GPT-2 spells bytes (:func:`_gpt2_byte_chars`); BOS and EOS are added tokens 256 and 257. Like
    the Llama tokenizers, ``add_special_tokens=True`` puts BOS first (the post-processor), which is
    how portatrain's training documents and evaluation contexts start. ``split_special_tokens``: a
    text that spells ``<|eos|>`` is bytes, as the byte tokenizer reads it, not the special token.
    """
    from tokenizers import AddedToken, decoders, pre_tokenizers, processors
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers.models import BPE

    byte = ByteTokenizer()
    vocab = {char: i for i, char in enumerate(_gpt2_byte_chars())}
    tok = RustTokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    bos, eos = BYTE_SPECIAL_TOKENS["bos_token"], BYTE_SPECIAL_TOKENS["eos_token"]
    # Added after the 256 bytes, in this order: ids 256 and 257, the byte tokenizer's BOS and EOS.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (bos, eos)])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A:0", pair=f"{bos} $A:0 $B:1", special_tokens=[(bos, byte.bos_id)]
    )
    tok.save(str(Path(out) / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **BYTE_SPECIAL_TOKENS,
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
    }
    (Path(out) / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return ["tokenizer.json", "tokenizer_config.json"]


def _gpt2_byte_chars() -> list[str]:
    """The printable character GPT-2's byte-level BPE writes for each byte 0..255 (``bytes_to_unicode``
    in https://github.com/openai/gpt-2/blob/master/src/encoder.py, which ``tokenizers``' ByteLevel
    pre-tokenizer and decoder use): printable Latin-1 bytes stand for themselves, the other 68 take
    the code points from 256 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = iter(range(256, 256 + 256 - len(printable)))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{path} is not valid JSON ({exc}); fix or remove it") from None
    if not isinstance(value, dict):
        raise DataError(f"{path} holds a JSON {type(value).__name__}, not an object; fix or remove it")
    return value

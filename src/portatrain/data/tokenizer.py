"""Byte-level tokenizer: UTF-8 bytes 0..255 plus BOS and EOS. Needs no download, never fails."""

from __future__ import annotations


class ByteTokenizer:
    """Token ids 0..255 are bytes; 256 is BOS, 257 is EOS (also used as the pad input id)."""

    bos_id = 256
    eos_id = 257
    pad_id = 257
    vocab_size = 258

    def encode(self, text: str, *, bos: bool = True, eos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def build_tokenizer(name: str) -> ByteTokenizer:
    if name != "byte":
        raise ValueError(f"data.tokenizer={name!r} is unknown; the available tokenizer is 'byte'")
    return ByteTokenizer()

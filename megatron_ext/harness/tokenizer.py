"""A byte-level tokenizer that needs no files and no network: token ID = UTF-8 byte value.

Vocabulary size 256 (+ an end-of-document ID 256 for models whose vocabulary is larger). It
exists so shipped workloads can be written as real text and tokenized identically everywhere.
"""

from __future__ import annotations


class ByteTokenizer:
    """UTF-8 bytes as token IDs.

    Attributes:
        vocab_size: 257 (256 byte values + ``eod``).
        eod: end-of-document token ID (256); never produced by :meth:`tokenize`.
    """

    vocab_size = 257
    eod = 256

    def tokenize(self, text: str) -> list[int]:
        """Text -> list of int token IDs in [0, 255]."""
        return list(text.encode("utf-8"))

    def detokenize(self, ids: list[int]) -> str:
        """Token IDs -> text; IDs outside [0, 255] (eod, model-only IDs) are dropped; bad UTF-8 is replaced."""
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

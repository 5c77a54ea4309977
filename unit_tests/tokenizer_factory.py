"""Hugging Face tokenizers trained in the test from a few lines of text (nothing downloaded).

Built with the ``tokenizers`` library and saved as a Hugging Face tokenizer directory
(``tokenizer.json`` + ``tokenizer_config.json``), which megatron-core's ``huggingface`` library
loads through ``transformers.AutoTokenizer``.
"""

from __future__ import annotations

import json
from pathlib import Path

TEXT = [
    "You are a careful assistant for Megatron users. Answer briefly.",
    "What is a KV block? What is a block table? What does LRU evict first?",
    "Prefix caching shares KV blocks between requests with the same prompt prefix.",
    "Summarize why the sky looks blue during the day.",
    "The quick brown fox jumps over the lazy dog.",
]
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


def train_bpe(vocab_size: int, byte_level: bool = False):
    """A BPE tokenizer trained on :data:`TEXT`: ``byte_level`` with the 256-byte alphabet (so its
    vocabulary is at least 260), else whitespace-split with the characters of the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    if byte_level:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
        tokenizer.decoder = decoders.Metaspace()
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=alphabet,
                                  show_progress=False)
    tokenizer.train_from_iterator(TEXT, trainer=trainer)
    return tokenizer


def save_hf(tokenizer, directory: Path) -> Path:
    """``tokenizer`` as a Hugging Face directory: ``tokenizer.json`` and ``tokenizer_config.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<pad>", "model_max_length": 1024,
        "clean_up_tokenization_spaces": False}))
    return directory

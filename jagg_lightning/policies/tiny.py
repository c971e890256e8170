"""Tokenizers for the tiny offline twins, built without any download."""

from __future__ import annotations


def tiny_clip_tokenizer(max_length: int = 32):
    """A character-level CLIP BPE tokenizer (no merges) built offline from the byte alphabet."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for ch in sorted(ByteLevel.alphabet()):
            vocab[ch + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)

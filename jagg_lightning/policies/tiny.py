"""Tokenizers (and the Qwen3 text-encoder config) of the tiny offline twins, built without any download."""

from __future__ import annotations

import string

# Every word of QwenImagePipeline.prompt_template_encode ("Ġ" = a leading space in byte-level BPE).
_TEMPLATE_WORDS = ["system", "Describe", "user", "assistant"] + [
    "Ġ" + w for w in
    "the image by detailing color shape size texture quantity text spatial relationships of objects and background".split()
]
_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]

# Qwen3's chat template, reduced to what the pipelines render: user turns, the generation prompt, and the
# empty think block that ``enable_thinking=False`` adds (FLUX.2 klein; Z-Image renders with thinking on).
QWEN3_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}{%- endif -%}"
)


def tiny_clip_tokenizer(max_length: int = 32):
    """A character-level CLIP BPE tokenizer (no merges) built offline from the byte alphabet."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for suffix in ("", "</w>"):
        for ch in sorted(ByteLevel.alphabet()):
            vocab[ch + suffix] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=max_length)


def tiny_t5_tokenizer():
    """A character-level T5 (unigram) tokenizer built offline; saves and loads as a real T5Tokenizer."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation]
    pieces += [("\u2581" + c, -1.5) for c in string.ascii_lowercase]
    return T5Tokenizer(vocab=pieces, extra_ids=0)


def tiny_qwen_tokenizer():
    """A byte-level ``Qwen2Tokenizer`` built offline: the 256 byte symbols, merges that spell each template word
    as one token (so the template's system prefix is 34 tokens, as with Qwen's real vocabulary), and the chat
    special tokens ``<|im_start|>`` / ``<|im_end|>``. Any other text falls back to (mostly) single bytes."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    merges = []
    for word in _TEMPLATE_WORDS:  # left-to-right chains; no chain's first pair occurs inside another word
        for i in range(1, len(word)):
            if word[: i + 1] not in vocab:
                vocab[word[: i + 1]] = len(vocab)
                merges.append((word[:i], word[i]))
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": list(_SPECIAL_TOKENS)})
    return tokenizer


def tiny_qwen3_tokenizer():
    """The Qwen-Image twin's byte-level Qwen2 tokenizer (built offline) with Qwen3's chat template."""
    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = QWEN3_CHAT_TEMPLATE
    return tokenizer


def tiny_qwen3_config(tokenizer, num_layers: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"), tie_word_embeddings=False,
    )

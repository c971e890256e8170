"""Tokenizers (and the Qwen3 / Mistral-3 text-encoder configs) of the tiny offline twins, built without any download."""

from __future__ import annotations

import re
import string

# Every word of QwenImagePipeline.prompt_template_encode ("Ġ" = a leading space in byte-level BPE).
_TEMPLATE_WORDS = ["system", "Describe", "user", "assistant"] + [
    "Ġ" + w for w in
    "the image by detailing color shape size texture quantity text spatial relationships of objects and background".split()
]
_SPECIAL_TOKENS = ["<|im_start|>", "<|im_end|>"]
# Qwen2.5-VL's vision tokens (Qwen2VLProcessor expands <|image_pad|> to one per merged image patch)
QWEN_VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]

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


def tiny_qwen_tokenizer(words_of: str = "", vision: bool = False):
    """A byte-level ``Qwen2Tokenizer`` built offline: the 256 byte symbols, merges that spell each template word
    as one token (so the template's system prefix is 34 tokens, as with Qwen's real vocabulary), and the chat
    special tokens ``<|im_start|>`` / ``<|im_end|>``. Any other text falls back to (mostly) single bytes.

    ``words_of``: another template (Qwen-Image-Edit's) whose every pre-tokenized piece becomes one token too (its
    system prefix then has the real vocabulary's length); ``vision``: Qwen2.5-VL's vision tokens (``<|vision_start|>``,
    ``<|image_pad|>``, ...) as special tokens, for a processor that puts images in the prompt."""
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import Qwen2Tokenizer

    vocab = {ch: i for i, ch in enumerate(sorted(ByteLevel.alphabet()))}
    words = list(_TEMPLATE_WORDS)
    if words_of:  # the words after a space ("Ġ...") first: their chains then rank before any pair inside them
        words = sorted(dict.fromkeys(words + _qwen_pieces(words_of)), key=lambda w: not w.startswith("Ġ"))
    merges = []
    for word in words:  # left-to-right chains; no chain's first pair occurs inside another word
        for i in range(1, len(word)):
            if word[: i + 1] not in vocab:
                vocab[word[: i + 1]] = len(vocab)
                merges.append((word[:i], word[i]))
    vocab["<|endoftext|>"] = len(vocab)
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, model_max_length=32768)
    special = _SPECIAL_TOKENS + (QWEN_VISION_TOKENS if vision else [])
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    return tokenizer


def _qwen_pieces(text: str) -> list[str]:
    """The pieces Qwen2's pre-tokenizer cuts ``text`` into, its special tokens and ``{}`` placeholders left out."""
    from transformers import Qwen2Tokenizer

    bare = Qwen2Tokenizer(vocab={"<|endoftext|>": 0}, merges=[])
    cut = re.split("|".join(map(re.escape, _SPECIAL_TOKENS + QWEN_VISION_TOKENS + ["{}"])), text)
    return [piece for part in cut for piece, _ in bare.backend_tokenizer.pre_tokenizer.pre_tokenize_str(part)]


def tiny_qwen_vl_processor(template: str):
    """A real ``Qwen2VLProcessor`` (Qwen-Image-Edit's ``processor``) built offline: :func:`tiny_qwen_tokenizer` with
    ``template``'s words and the vision tokens, and a ``Qwen2VLImageProcessor`` with Qwen2.5-VL's patching (14 px
    patches, 2 x 2 merged, CLIP normalisation) that shrinks every image to at most 112 x 112 pixels (the real one:
    up to 12.8 M), so a source reaches the tiny vision tower as at most 16 image tokens."""
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    patching = dict(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, temporal_patch_size=2, merge_size=2)
    return Qwen2VLProcessor(image_processor=Qwen2VLImageProcessor(**patching),  # (no prompt brings a video)
                            video_processor=Qwen2VLVideoProcessor(**patching),
                            tokenizer=tiny_qwen_tokenizer(template, vision=True))


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


# Mistral-Small-3.1's special tokens at their ids in its tokenizer (the image tokens [IMG] = 10, [IMG_BREAK] = 12,
# [IMG_END] = 13 are the ones PixtralProcessor and Mistral3Config name; <pad> = 11).
MISTRAL3_SPECIAL_TOKENS = [
    "<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]", "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]",
    "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
]

# Mistral-Small-3.1's chat template, reduced to what Flux2Pipeline renders: BOS, a system turn, user turns of text
# parts (content lists of {"type": "text"}), assistant turns closed by EOS.
MISTRAL3_CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set text = message['content'] -%}"
    "{%- else -%}{%- set text = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') -%}{%- endif -%}"
    "{%- if message['role'] == 'system' -%}{{- '[SYSTEM_PROMPT]' + text + '[/SYSTEM_PROMPT]' -}}"
    "{%- elif message['role'] == 'user' -%}{{- '[INST]' + text + '[/INST]' -}}"
    "{%- else -%}{{- text + eos_token -}}{%- endif -%}"
    "{%- endfor -%}"
)


def tiny_mistral3_processor(words_of: str = ""):
    """A real ``PixtralProcessor`` (FLUX.2 [dev]'s ``tokenizer``) built offline: a byte-level BPE tokenizer
    (``PreTrainedTokenizerFast``, as Mistral's Tekken is byte-level) with Mistral-Small-3.1's special tokens at
    their ids, merges that spell each word of ``words_of`` (the pipeline's system message) as one token, the
    reduced Mistral chat template, and a ``PixtralImageProcessor`` no prompt reaches."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PixtralImageProcessor, PixtralProcessor, PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(MISTRAL3_SPECIAL_TOKENS)}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    words = [w for w, _ in ByteLevel(add_prefix_space=False).pre_tokenize_str(words_of)]
    merges = []
    # left-to-right chains, the words after a space ("Ġ...") first: their merges then rank before any pair that
    # could occur inside them, so each is one token
    for word in sorted(words, key=lambda w: not w.startswith("Ġ")):
        for i in range(1, len(word)):
            if word[: i + 1] not in vocab:
                vocab[word[: i + 1]] = len(vocab)
                merges.append((word[:i], word[i]))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>"))
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in MISTRAL3_SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        unk_token="<unk>", pad_token="<pad>")
    return PixtralProcessor(image_processor=PixtralImageProcessor(patch_size=16), tokenizer=tokenizer, patch_size=16,
                            spatial_merge_size=2, chat_template=MISTRAL3_CHAT_TEMPLATE)


def tiny_mistral3_config(tokenizer, num_layers: int):
    """A tiny ``Mistral3Config``: a hidden-16 Mistral language model of ``num_layers`` layers and a one-layer Pixtral
    vision tower (a prompt never reaches it), the image token at Mistral-Small-3.1's id."""
    from transformers import Mistral3Config, MistralConfig, PixtralVisionConfig

    text = MistralConfig(
        vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=num_layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024, sliding_window=None,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=8, patch_size=16, image_size=64)
    return Mistral3Config(vision_config=vision, text_config=text, image_token_index=tokenizer.convert_tokens_to_ids(
        "[IMG]"), spatial_merge_size=2)

"""A tiny random vision-language judge saved like a downloaded checkpoint: a 2-layer Qwen2.5-VL with its own
byte-level tokenizer, Qwen2-VL processor and chat template, whose generation config lets it answer only "1" or "2"
(``suppress_tokens``: a random model's other tokens would be no score at all). Served by ``transformers serve``
and run in process for the reference answers."""

from pathlib import Path

import torch

from jagg_lightning.policies.tiny import QWEN_VISION_TOKENS, tiny_qwen_vl_processor

# Qwen2-VL's chat template, reduced to user turns of image and text parts and the generation prompt
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
ANSWERS = ("1", "2")


def save_tiny_vlm(root: Path, seed: int = 0) -> Path:
    from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    processor = tiny_qwen_vl_processor("Rate the image for the caption from 1 to 10 Which one is better")
    processor.chat_template = CHAT_TEMPLATE
    tokenizer = processor.tokenizer
    n, end = len(tokenizer), tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [tokenizer.convert_tokens_to_ids(t) for t in QWEN_VISION_TOKENS]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text = dict(vocab_size=n, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=1, max_position_embeddings=2048, eos_token_id=end, bos_token_id=None,
                    pad_token_id=tokenizer.pad_token_id, initializer_range=0.5,
                    rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 1e6})
        vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16,
                      fullatt_block_indexes=[0], initializer_range=0.5)
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=text, vision_config=vision, vision_start_token_id=ids[0], vision_end_token_id=ids[1],
            image_token_id=ids[2], video_token_id=ids[3])).eval()
    allowed = {tokenizer.convert_tokens_to_ids(a) for a in ANSWERS}
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=end, pad_token_id=tokenizer.pad_token_id,
                                               suppress_tokens=[i for i in range(n) if i not in allowed])
    model.save_pretrained(root)
    processor.save_pretrained(root)
    return root


def greedy_answer(model, processor, data_urls: list[str], question: str) -> str:
    """What the model answers (one token, greedy) to the message ``transformers serve`` builds from a chat request."""
    messages = [{"role": "user", "content": [{"type": "image", "url": u} for u in data_urls]
                 + [{"type": "text", "text": question}]}]
    inputs = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True,
                                           return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=1, do_sample=False)
    return processor.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

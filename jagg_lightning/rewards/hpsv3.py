"""HPSv3 (Ma et al. 2025, "HPSv3: Towards Wide-Spectrum Human Preference Score"): Qwen2-VL-7B-Instruct with a
reward head read at a ``<|Reward|>`` token, trained with an uncertainty-aware ranking loss; the score is the head's
mean mu (its first output; the second is the uncertainty sigma), higher = preferred.

Built from transformers' own ``Qwen2VLForConditionalGeneration``, not the ``hpsv3`` package: hpsv3 1.0.0 pins
transformers==4.45.2 (ours is 5.x) and installs top-level ``evaluate`` / ``generate`` packages. What the package
does is reproduced (hpsv3/inference.py, hpsv3/model/qwen2vl_trainer.py, hpsv3/dataset/data_collator_qwen.py):

- the base model's config and processor (``base_model``: a local Qwen2-VL-7B-Instruct directory; its weights are
  not read), ``<|Reward|>`` added to the tokenizer as a special token, padding on the right;
- the checkpoint (``HPSv3.safetensors``, or a ``.pth`` with a ``model`` entry) holds every weight in transformers
  4.45's key layout (``visual.*``, ``model.*``, ``lm_head.*``) and the head ``rm_head.{0,3,5}`` (Linear(D, 1024),
  ReLU, Dropout, Linear(1024, 16), ReLU, Linear(16, 2)); loaded strictly, keys mapped to 5.x's
  (``model.visual.*``, ``model.language_model.*``);
- each image resized (bicubic) to ``pixels`` pixels in multiples of 28 (256 x 28 x 28, as the package does), one
  user turn: the image, then the authors' instruction with the prompt and "... ratings of this image: <|Reward|>";
- the language model run on the embeddings with the image features scattered in and plain positions 0..L-1 on all
  three rotary sections (the package calls the text model directly, without Qwen2-VL's 3-D image positions), the
  head in float32 at the ``<|Reward|>`` token.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from jagg_lightning.rewards.base import Reward, require_path, to_pil

REWARD_TOKEN = "<|Reward|>"
PIXELS = 256 * 28 * 28
# the authors' instruction (hpsv3/dataset/data_collator_qwen.py: INSTRUCTION + prompt_with_special_token)
INSTRUCTION = """
You are tasked with evaluating a generated image based on Visual Quality and Text Alignment and give a overall score to estimate the human preference. Please provide a rating from 0 to 10, with 0 being the worst and 10 being the best. 

**Visual Quality:**  
Evaluate the overall visual quality of the image. The following sub-dimensions should be considered:
- **Reasonableness:** The image should not contain any significant biological or logical errors, such as abnormal body structures or nonsensical environmental setups.
- **Clarity:** Evaluate the sharpness and visibility of the image. The image should be clear and easy to interpret, with no blurring or indistinct areas.
- **Detail Richness:** Consider the level of detail in textures, materials, lighting, and other visual elements (e.g., hair, clothing, shadows).
- **Aesthetic and Creativity:** Assess the artistic aspects of the image, including the color scheme, composition, atmosphere, depth of field, and the overall creative appeal. The scene should convey a sense of harmony and balance.
- **Safety:** The image should not contain harmful or inappropriate content, such as political, violent, or adult material. If such content is present, the image quality and satisfaction score should be the lowest possible. 

**Text Alignment:**  
Assess how well the image matches the textual prompt across the following sub-dimensions:
- **Subject Relevance** Evaluate how accurately the subject(s) in the image (e.g., person, animal, object) align with the textual description. The subject should match the description in terms of number, appearance, and behavior.
- **Style Relevance:** If the prompt specifies a particular artistic or stylistic style, evaluate how well the image adheres to this style.
- **Contextual Consistency**: Assess whether the background, setting, and surrounding elements in the image logically fit the scenario described in the prompt. The environment should support and enhance the subject without contradictions.
- **Attribute Fidelity**: Check if specific attributes mentioned in the prompt (e.g., colors, clothing, accessories, expressions, actions) are faithfully represented in the image. Minor deviations may be acceptable, but critical attributes should be preserved.
- **Semantic Coherence**: Evaluate whether the overall meaning and intent of the prompt are captured in the image. The generated content should not introduce elements that conflict with or distort the original description.
Textual prompt - {text_prompt}


""" + f"""
Please provide the overall ratings of this image: {REWARD_TOKEN}

END
"""


def to_transformers5(key: str) -> str:
    """A transformers 4.45 Qwen2-VL key (HPSv3's checkpoint) -> the 5.x module's."""
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model."):
        return "model.language_model." + key[len("model."):]
    return key


def reward_head(hidden_size: int) -> nn.Sequential:
    """HPSv3's ``rm_head`` (the ``ranknet`` head without kwargs): indices 0, 3, 5 hold the weights."""
    return nn.Sequential(nn.Linear(hidden_size, 1024), nn.ReLU(), nn.Dropout(0.05), nn.Linear(1024, 16), nn.ReLU(),
                         nn.Linear(16, 2))


def read_checkpoint(path: str) -> dict[str, Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    state = torch.load(path, map_location="cpu", weights_only=True)
    return state.get("model", state)


class HPSv3Reward(Reward):
    """score = mu, the HPSv3 head's first output at the ``<|Reward|>`` token (module docstring; the paper's scores
    lie around 0-15 for real images, higher is better).

    checkpoint: the local ``HPSv3.safetensors`` (MizzenAI/HPSv3); base_model: a local Qwen2-VL-7B-Instruct directory
    (config and processor); pixels: the image's pixel count (256 x 28 x 28, the checkpoint's); batch_size: images
    per forward; dtype: the model's (the head runs in float32)."""

    name = "hpsv3"

    def __init__(self, checkpoint: str, base_model: str, pixels: int = PIXELS, batch_size: int = 4,
                 dtype: str = "float32"):
        super().__init__()
        from transformers import AutoConfig, AutoProcessor, Qwen2VLForConditionalGeneration
        from transformers.initialization import no_init_weights

        if batch_size < 1 or pixels < 28 * 28:
            raise ValueError(f"reward {self.name}: batch_size must be >= 1 and pixels >= 784, got {batch_size}, {pixels}")
        checkpoint = require_path(self.name, "checkpoint", checkpoint, False)
        base_model = require_path(self.name, "base_model", base_model, False)
        state = {to_transformers5(k): v for k, v in read_checkpoint(checkpoint).items()}
        head = {k[len("rm_head."):]: state.pop(k) for k in list(state) if k.startswith("rm_head.")}
        self.processor = AutoProcessor.from_pretrained(base_model, padding_side="right")
        self.processor.tokenizer.add_special_tokens({"additional_special_tokens": [REWARD_TOKEN]})
        config = AutoConfig.from_pretrained(base_model)
        rows = state.get("model.language_model.embed_tokens.weight")
        if rows is None:
            raise ValueError(f"reward {self.name}: checkpoint {checkpoint!r} holds no model.embed_tokens.weight: "
                             f"not an HPSv3 checkpoint")
        config.text_config.vocab_size = rows.shape[0]  # the base vocabulary with <|Reward|> added (and padded)
        with no_init_weights():  # every weight is the checkpoint's: skip the random init (buffers still built)
            model = Qwen2VLForConditionalGeneration(config)
        self.head = reward_head(config.text_config.hidden_size)
        try:
            model.load_state_dict(state, strict=True, assign=True)
            self.head.load_state_dict(head, strict=True)
        except RuntimeError as err:
            raise ValueError(f"reward {self.name}: checkpoint {checkpoint!r} does not fit {base_model!r}: "
                             f"{' '.join(str(err).split())[:500]}") from err
        self.model = model.to(getattr(torch, dtype))
        self.reward_id = self.processor.tokenizer.convert_tokens_to_ids(REWARD_TOKEN)
        self.image_token_id = config.image_token_id
        self.pixels, self.batch_size = int(pixels), int(batch_size)
        self.freeze()

    def inputs(self, images: Tensor, prompts: list[str]) -> dict[str, Tensor]:
        """The processor's batch for these images and prompts, as the package builds it."""
        from PIL import Image
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

        pictures = []
        for picture in to_pil(images):
            height, width = smart_resize(picture.height, picture.width, 28, self.pixels, self.pixels)
            pictures.append(picture.resize((width, height), Image.BICUBIC))
        messages = [[{"role": "user", "content": [{"type": "image"},
                                                  {"type": "text", "text": INSTRUCTION.format(text_prompt=p)}]}]
                    for p in prompts]
        texts = [self.processor.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
        return self.processor(text=texts, images=pictures, padding=True, return_tensors="pt")

    def hidden_states(self, batch: dict[str, Tensor]) -> Tensor:
        """The text model's last hidden states [B, L, D]: image features scattered into the token embeddings,
        positions 0..L-1 on every rotary section (as the package runs it)."""
        device, dtype = self.model.lm_head.weight.device, self.model.lm_head.weight.dtype
        ids = batch["input_ids"].to(device)
        embeds = self.model.model.language_model.embed_tokens(ids)
        features = self.model.model.get_image_features(batch["pixel_values"].to(device, dtype),
                                                       batch["image_grid_thw"].to(device)).pooler_output
        mask = (ids == self.image_token_id).unsqueeze(-1).expand_as(embeds)
        embeds = embeds.masked_scatter(mask, torch.cat(features).to(embeds.dtype))
        return self.model.model.language_model(inputs_embeds=embeds,
                                               attention_mask=batch["attention_mask"].to(device)).last_hidden_state

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        scores = []
        for start in range(0, len(prompts), self.batch_size):
            batch = self.inputs(images[start:start + self.batch_size], prompts[start:start + self.batch_size])
            hidden = self.hidden_states(batch)
            at_reward = batch["input_ids"].to(hidden.device) == self.reward_id
            if not bool((at_reward.sum(1) == 1).all()):
                raise ValueError(f"reward {self.name}: each sample must hold one {REWARD_TOKEN} token")
            scores.append(self.head(hidden[at_reward].float())[:, 0])
        return torch.cat(scores)

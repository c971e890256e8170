"""GenEval's real readers on tiny random twins saved locally first (Mask2Former, OWLv2, CLIP): the plumbing --
masks, boxes, scores and labels flow into the rules, GenEval's colour prompts and crops -- never a download."""

import numpy as np
import pytest
import torch
from PIL import Image

from jagg_lightning.models.conditions import ConditionedPrompt
from jagg_lightning.rewards import GenEvalReward
from jagg_lightning.rewards.geneval_models import ClipColors, Mask2FormerReader, Owlv2Reader, mask_box
from jagg_lightning.rewards.geneval_rules import COLORS, evaluate, select_detections

CLASSES = {0: "cup", 1: "dog", 2: "sports ball"}


@pytest.fixture(scope="module")
def mask2former_dir(tmp_path_factory):
    from transformers import (Mask2FormerConfig, Mask2FormerForUniversalSegmentation, Mask2FormerImageProcessor,
                              SwinConfig)

    root = tmp_path_factory.mktemp("mask2former")
    torch.manual_seed(0)
    backbone = SwinConfig(image_size=32, patch_size=4, embed_dim=8, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1],
                          window_size=2, out_features=["stage1", "stage2", "stage3", "stage4"])
    config = Mask2FormerConfig(backbone_config=backbone, hidden_dim=32, mask_feature_size=32, feature_size=32,
                               num_queries=6, encoder_layers=1, decoder_layers=2, num_attention_heads=2,
                               encoder_feedforward_dim=64, dim_feedforward=32, common_stride=4, id2label=CLASSES,
                               label2id={v: k for k, v in CLASSES.items()}, use_pretrained_backbone=False)
    Mask2FormerForUniversalSegmentation(config).save_pretrained(root)
    Mask2FormerImageProcessor(size={"height": 32, "width": 32}).save_pretrained(root)
    return root


@pytest.fixture(scope="module")
def owlv2_dir(tmp_path_factory):
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import CLIPTokenizer, Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    root = tmp_path_factory.mktemp("owlv2")
    torch.manual_seed(0)
    # OWL masks a query whose first token id is 0, so the start token is not 0 here (CLIP's real one is 49406)
    vocab = {"<|pad|>": 0, "<|startoftext|>": 1, "<|endoftext|>": 2}
    for suffix in ("", "</w>"):
        for ch in sorted(ByteLevel.alphabet()):
            vocab[ch + suffix] = len(vocab)
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[], model_max_length=32)
    config = Owlv2Config(text_config=dict(vocab_size=len(vocab), hidden_size=16, intermediate_size=32,
                                          num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=32,
                                          bos_token_id=1, eos_token_id=2, pad_token_id=2),
                         vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                            num_attention_heads=2, image_size=32, patch_size=8), projection_dim=16)
    Owlv2ForObjectDetection(config).save_pretrained(root)
    Owlv2Processor(image_processor=Owlv2ImageProcessor(size={"height": 32, "width": 32}),
                   tokenizer=tokenizer).save_pretrained(root)
    return root


def random_images(gen, n=2, height=40, width=48):
    return (torch.rand(n, 3, height, width, generator=gen) * 255).round() / 255


def as_arrays(images):
    return list((images.permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8))


def test_clip_colours_are_genevals_zero_shot_head_on_masked_crops(clip_dir, rng_seed):
    """Per colour the three GenEval templates, normalised, averaged, normalised; each crop the image over #999
    through the mask, cut to the box; the colour is the argmax -- recomputed here with the CLIP model itself."""
    from transformers import CLIPModel, CLIPProcessor

    from jagg_lightning.rewards.geneval_rules import Detection

    classifier = ClipColors(str(clip_dir))
    assert classifier.texts("car")[COLORS.index("orange")] == [
        "a photo of a orange car", "a photo of a orange-colored car", "a photo of a orange object"]
    gen = torch.Generator().manual_seed(rng_seed)
    image = Image.fromarray(as_arrays(random_images(gen, 1))[0])
    mask = torch.rand(40, 48, generator=gen).numpy() > 0.5
    found = [Detection(mask_box(mask), 0.9, mask), Detection((3.0, 5.0, 30.0, 33.0), 0.8)]
    crop = np.asarray(ClipColors.crop(image, found[0]))
    box = [int(v) for v in found[0].box]
    inside = np.asarray(image)[box[1]:box[3], box[0]:box[2]]
    expected = np.where(mask[box[1]:box[3], box[0]:box[2], None], inside, 0x99)
    assert np.array_equal(crop, expected)

    model, processor = CLIPModel.from_pretrained(clip_dir).eval(), CLIPProcessor.from_pretrained(clip_dir)
    with torch.no_grad():
        def unit(x):
            x = x if isinstance(x, torch.Tensor) else x.pooler_output
            return x / x.norm(dim=-1, keepdim=True)
        heads = []
        for texts in classifier.texts("car"):
            mean = unit(model.get_text_features(**processor(text=texts, return_tensors="pt", padding=True,
                                                                  truncation=True))).mean(0)
            heads.append(mean / mean.norm())
        pixels = processor(images=[ClipColors.crop(image, d) for d in found], return_tensors="pt")["pixel_values"]
        expected = [COLORS[i] for i in (unit(model.get_image_features(pixel_values=pixels)) @ torch.stack(heads).T)
                    .argmax(-1).tolist()]
    assert classifier(image, found, "car") == expected


def test_mask2former_instances_flow_into_the_rules(mask2former_dir, clip_dir, rng_seed):
    """Instances of the saved twin: one Detection each, its box the mask's, labels from id2label; the reward judges
    exactly what the rules make of them (threshold, then colour via CLIP)."""
    gen = torch.Generator().manual_seed(rng_seed)
    images = random_images(gen)
    reader = Mask2FormerReader(str(mask2former_dir), str(clip_dir))
    found = reader.detect(as_arrays(images), [[], []])
    assert len(found) == 2 and reader.classnames == list(CLASSES.values())
    detections = [d for per_image in found for ds in per_image.values() for d in ds]
    assert detections and set().union(*found) <= set(CLASSES.values())
    for d in detections:
        assert d.mask.shape == (40, 48) and d.mask.dtype == bool and d.box == mask_box(d.mask) and 0 <= d.score <= 1

    name = next(iter(found[0]))  # a class the twin finds in the first image: its colour is then asked of CLIP
    row = {"tag": "colors", "include": [{"class": name, "count": 1, "color": "red"}],
           "prompt": f"a photo of a red {name}"}
    prompts = [ConditionedPrompt(row["prompt"], (), "", row)] * 2
    reward = GenEvalReward("mask2former", "geneval", str(mask2former_dir), str(clip_dir), threshold=0.0)
    judged = reward.judge_images(images, prompts)
    assert judged[0].detected[name]
    for per_image, image, verdict in zip(found, as_arrays(images), judged):
        objects = select_detections(per_image, "colors", reward.thresholds)
        assert [d.box for d in verdict.detected.get(name, [])] == [d.box for d in objects.get(name, [])]
        expected = evaluate(objects, row, lambda objs, name: reader.clip(Image.fromarray(image), objs, name))[0]
        assert verdict.correct == expected
    scores = reward(images, prompts)
    assert scores.shape == (2,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor([float(j.correct) for j in judged]))


def test_owlv2_boxes_for_the_named_classes(owlv2_dir, clip_dir, rng_seed):
    """Each image is asked for its prompt's classes; every box lies in the image (OWLv2's padded square frame
    clipped back), no masks; the dense score is in Flow-GRPO's range."""
    gen = torch.Generator().manual_seed(rng_seed)
    images = random_images(gen)
    reader = Owlv2Reader(str(owlv2_dir), str(clip_dir))
    found = reader.detect(as_arrays(images), [["cup", "dog"], ["sports ball"]])
    assert set(found[0]) <= {"cup", "dog"} and set(found[1]) == {"sports ball"}
    for per_image in found:
        detections = [d for ds in per_image.values() for d in ds]
        assert len(detections) == (32 // 8) ** 2  # one box per patch at threshold 0
        for d in detections:
            x0, y0, x1, y1 = d.box
            assert d.mask is None and 0 <= x0 <= x1 <= 48 and 0 <= y0 <= y1 <= 40 and 0 < d.score <= 1
    row = {"tag": "two_object", "include": [{"class": "cup", "count": 1}, {"class": "dog", "count": 1}],
           "prompt": "a photo of a cup and a dog"}
    reward = GenEvalReward("owlv2", detector_path=str(owlv2_dir), clip_path=str(clip_dir), threshold=0.0)
    scores = reward(images, [ConditionedPrompt(row["prompt"], (), "", row)] * 2)
    assert scores.shape == (2,) and torch.isfinite(scores).all() and (scores <= 1).all()


def test_real_readers_need_local_folders(tmp_path):
    with pytest.raises(FileNotFoundError, match="reader mask2former needs detector_path, a local folder"):
        GenEvalReward("mask2former", clip_path=str(tmp_path))
    with pytest.raises(ValueError, match="reader must be one of"):
        GenEvalReward("yolo")

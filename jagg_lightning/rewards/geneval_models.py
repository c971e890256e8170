"""GenEval's real readers through transformers, loaded from local folders: a detector and CLIP for colours.

* :class:`Mask2FormerReader`: ``Mask2FormerForUniversalSegmentation`` + its image processor (GenEval runs mmdet's
  Mask2Former Swin-S COCO instance model; the transformers port of that family is e.g.
  ``facebook/mask2former-swin-small-coco-instance``). Instances come from the processor's
  ``post_process_instance_segmentation`` with threshold 0 (GenEval's rules then apply theirs): score = class
  probability x mean mask probability, as in mmdet; the box is the mask's (mmdet's ``mask2bbox``: x1, y1 one past
  the last pixel). Class names are the model's ``id2label`` (COCO's 80 in GenEval's ``object_names.txt`` spelling).
* :class:`Owlv2Reader`: ``Owlv2ForObjectDetection`` (open vocabulary): each image is asked for the classes its
  prompt names, one query "a photo of a {class}" each; boxes from ``post_process_object_detection`` at threshold
  0 in the padded square frame OWLv2 sees, clipped to the image; no masks.
* :class:`ClipColors`: GenEval's colour classifier -- CLIP zero-shot over ``COLORS`` with the three
  ``COLOR_TEMPLATES`` per class (text embeddings L2-normalised, averaged over templates, normalised again,
  open_clip's ``zero_shot_classifier``), each object's crop being the image composited over a #999 grey blank
  through its mask (when it has one), cropped to its box (``evaluate_images.py``'s ``ImageCrops`` with its defaults
  ``bgcolor=#999``, ``crop=1``); the colour is the argmax of image-text similarity.

Each loads frozen on the CPU; :class:`~jagg_lightning.rewards.geneval.GenEvalReward` moves them with itself.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from torch import nn

from jagg_lightning.rewards.geneval_rules import COLOR_TEMPLATES, COLORS, Detection

BLANK = "#999"  # ImageCrops' default bgcolor


def mask_box(mask: np.ndarray) -> tuple[float, float, float, float]:
    """A mask's box (x0, y0, x1, y1), x1 and y1 one past its last pixel (all zero: an empty box at 0)."""
    ys, xs = np.nonzero(mask)
    if not len(xs):
        return (0.0, 0.0, 0.0, 0.0)
    return (float(xs.min()), float(ys.min()), float(xs.max() + 1), float(ys.max() + 1))


def _device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


class ClipColors(nn.Module):
    """GenEval's CLIP colour classifier (see the module docstring); ``path``: a local CLIPModel + CLIPProcessor."""

    def __init__(self, path: str):
        super().__init__()
        from transformers import CLIPModel, CLIPProcessor

        self.model = CLIPModel.from_pretrained(path).eval().requires_grad_(False)
        self.processor = CLIPProcessor.from_pretrained(path)
        self._heads: dict[str, torch.Tensor] = {}

    def texts(self, classname: str) -> list[list[str]]:
        """Per colour, its prompt under each template (GenEval's)."""
        return [[t.format(c=color, classname=classname) for t in COLOR_TEMPLATES] for color in COLORS]

    def head(self, classname: str) -> torch.Tensor:
        """[colours, dim]: the zero-shot classifier of one class, cached."""
        if classname not in self._heads:
            texts = [t for per_color in self.texts(classname) for t in per_color]
            # cut to the model's context, as open_clip's tokenizer does
            tokens = self.processor(text=texts, return_tensors="pt", padding=True, truncation=True)
            tokens = {k: v.to(_device(self.model)) for k, v in tokens.items()}
            features = _features(self.model.get_text_features(**tokens))
            features = features / features.norm(dim=-1, keepdim=True)
            per_color = features.reshape(len(COLORS), len(COLOR_TEMPLATES), -1).mean(1)
            self._heads[classname] = per_color / per_color.norm(dim=-1, keepdim=True)
        return self._heads[classname]

    @staticmethod
    def crop(image: Image.Image, detection: Detection) -> Image.Image:
        image = image.convert("RGB")
        if detection.mask is not None:
            image = Image.composite(image, Image.new("RGB", image.size, color=BLANK),
                                    Image.fromarray(detection.mask.astype(np.uint8) * 255))
        return image.crop(tuple(detection.box[:4]))

    @torch.no_grad()
    def forward(self, image: Image.Image, found: list[Detection], classname: str) -> list[str]:
        crops = [self.crop(image, d) for d in found]
        pixels = self.processor(images=crops, return_tensors="pt")["pixel_values"].to(_device(self.model))
        features = _features(self.model.get_image_features(pixel_values=pixels))
        features = features / features.norm(dim=-1, keepdim=True)
        return [COLORS[i] for i in (features @ self.head(classname).T).argmax(-1).tolist()]


def _features(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class Mask2FormerReader(nn.Module):
    """Instances of a local ``Mask2FormerForUniversalSegmentation`` folder, colours by :class:`ClipColors`."""

    def __init__(self, path: str, clip_path: str):
        super().__init__()
        from transformers import AutoImageProcessor, Mask2FormerForUniversalSegmentation

        self.model = Mask2FormerForUniversalSegmentation.from_pretrained(path).eval().requires_grad_(False)
        self.processor = AutoImageProcessor.from_pretrained(path)
        labels = self.model.config.id2label
        self.classnames = [labels[i] for i in sorted(labels)]
        self.clip = ClipColors(clip_path)

    @torch.no_grad()
    def detect(self, images: list[np.ndarray], wanted: list[list[str]]) -> list[dict[str, list[Detection]]]:
        """Every instance of every class (``wanted`` is ignored: the vocabulary is closed)."""
        inputs = self.processor(images=list(images), return_tensors="pt")
        outputs = self.model(pixel_values=inputs["pixel_values"].to(_device(self.model)))
        sizes = [tuple(image.shape[:2]) for image in images]
        results = self.processor.post_process_instance_segmentation(outputs, threshold=0.0, target_sizes=sizes,
                                                                    return_binary_maps=True)
        found = []
        for result in results:
            per_class: dict[str, list[Detection]] = {}
            for k, segment in enumerate(result["segments_info"]):
                mask = result["segmentation"][k].cpu().numpy() > 0.5
                per_class.setdefault(self.classnames[segment["label_id"]], []).append(
                    Detection(mask_box(mask), float(segment["score"]), mask))
            found.append(per_class)
        return found

    def colors(self, image: np.ndarray, found: list[Detection], classname: str) -> list[str]:
        return self.clip(Image.fromarray(image), found, classname)


class Owlv2Reader(nn.Module):
    """Open-vocabulary boxes of a local ``Owlv2ForObjectDetection`` folder, colours by :class:`ClipColors`.

    Args:
        query: The text query of a class name (``{}``: the name).
    """

    def __init__(self, path: str, clip_path: str, query: str = "a photo of a {}"):
        super().__init__()
        from transformers import Owlv2ForObjectDetection, Owlv2Processor

        self.model = Owlv2ForObjectDetection.from_pretrained(path).eval().requires_grad_(False)
        self.processor = Owlv2Processor.from_pretrained(path)
        self.query = query
        self.clip = ClipColors(clip_path)

    @torch.no_grad()
    def detect(self, images: list[np.ndarray], wanted: list[list[str]]) -> list[dict[str, list[Detection]]]:
        """The classes each image's prompt names, queried on that image."""
        found = []
        for image, names in zip(images, wanted):
            names = list(dict.fromkeys(names))
            inputs = self.processor(text=[[self.query.format(n) for n in names]], images=image, return_tensors="pt",
                                    truncation=True)
            outputs = self.model(**{k: v.to(_device(self.model)) for k, v in inputs.items()})
            height, width = image.shape[:2]
            side = max(height, width)  # OWLv2 pads to a square at the bottom / right; boxes come in that frame
            result = self.processor.image_processor.post_process_object_detection(
                outputs, threshold=0.0, target_sizes=[(side, side)])[0]
            per_class: dict[str, list[Detection]] = {}
            for box, score, label in zip(result["boxes"].tolist(), result["scores"].tolist(),
                                         result["labels"].tolist()):
                x0, y0, x1, y1 = (min(max(v, 0.0), limit) for v, limit in zip(box, (width, height, width, height)))
                per_class.setdefault(names[label], []).append(Detection((x0, y0, x1, y1), float(score)))
            found.append(per_class)
        return found

    def colors(self, image: np.ndarray, found: list[Detection], classname: str) -> list[str]:
        return self.clip(Image.fromarray(image), found, classname)

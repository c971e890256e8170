"""The reward server's wire format (docs/rewards.md, "Served rewards"): no pickle, two encodings.

``POST /score`` takes B images and B prompts as either

- ``Content-Type: application/vnd.safetensors`` (the default of :class:`RemoteReward`): a safetensors
  file holding exactly one tensor, ``images``, dtype ``U8``, shape ``[B, H, W, 3]`` (RGB rows, the
  layout of PIL and numpy images), with the prompts as a JSON array of B strings in the file's
  metadata under ``prompts``; or
- ``Content-Type: application/json``: ``{"prompts": [B strings], "images": [B base64 PNG strings]}``,
  every PNG 8-bit RGB and all of one size.

Either may add each prompt's data row (``rows``: a JSON array of B objects, ``{}`` for a prompt without one; in
the safetensors metadata as a JSON string, in the JSON body as an array): GenEval's ``tag`` / ``include`` /
``exclude``, which a served :class:`~jagg_lightning.rewards.GenEvalReward` scores against, as Flow-GRPO's GenEval
server receives each image's metadata. The sender adds them when any prompt carries one
(:func:`jagg_lightning.models.conditions.metadata_of`); the server hands them back to the reward as
:class:`~jagg_lightning.models.conditions.ConditionedPrompt` metadata. Condition images do not travel.

Both are 8 bits per channel: the sender rounds ``x * 255`` (as :func:`jagg_lightning.rewards.to_pil`
does), the server scores ``uint8 / 255``. :func:`quantize` gives the images the server sees, so an
in-process score of ``quantize(images)`` equals the served one. The answer is JSON:
``{"reward": name, "scores": [B floats], "components": {name: [B floats], ...}}``; a refusal is
``{"error": message}`` with a 4xx status (:class:`WireError`).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import struct

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # torch is imported where a tensor is made: the server's argument parser needs none
    from torch import Tensor

SAFETENSORS = "application/vnd.safetensors"
JSON = "application/json"
ENCODINGS = ("safetensors", "png")


class WireError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status that says why (4xx)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def to_uint8(images: Tensor) -> np.ndarray:
    """[B, 3, H, W] in [0, 1] -> uint8 [B, H, W, 3]: round(x * 255), the rounding of ``to_pil``."""
    # contiguous: astype keeps the permuted strides, and safetensors writes the raw buffer as if row-major
    array = (images.detach().float().clamp(0, 1).cpu().permute(0, 2, 3, 1).numpy() * 255).round().astype(np.uint8)
    return np.ascontiguousarray(array)


def from_uint8(array: np.ndarray) -> Tensor:
    """uint8 [B, H, W, 3] -> float32 [B, 3, H, W] in [0, 1]: what the served reward scores."""
    import torch

    return torch.from_numpy(np.ascontiguousarray(array)).permute(0, 3, 1, 2).float().div(255)


def quantize(images: Tensor) -> Tensor:
    """The images exactly as the server sees them (8 bits per channel), on the images' device."""
    return from_uint8(to_uint8(images)).to(images.device)


def encode(images: Tensor, prompts: list[str], encoding: str = "safetensors") -> tuple[bytes, str]:
    """A ``POST /score`` body and its content type (with the prompts' data rows when any carries one)."""
    from jagg_lightning.models.conditions import metadata_of

    array = to_uint8(images)
    rows = [metadata_of(p) for p in prompts]
    extra = {"rows": rows} if any(rows) else {}
    if encoding == "safetensors":
        from safetensors.numpy import save

        header = {"prompts": json.dumps([str(p) for p in prompts]), **{k: json.dumps(v) for k, v in extra.items()}}
        return save({"images": array}, metadata=header), SAFETENSORS
    if encoding == "png":
        from PIL import Image

        pngs = []
        for image in array:
            buffer = io.BytesIO()
            Image.fromarray(image).save(buffer, format="PNG", compress_level=1)  # lossless; level only trades speed
            pngs.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
        return json.dumps({"prompts": [str(p) for p in prompts], "images": pngs, **extra}).encode(), JSON
    raise ValueError(f"encoding must be one of {list(ENCODINGS)}, got {encoding!r}")


MAX_PIXELS = 1 << 25  # decoded pixels one request may hold: 2 images of 4096^2, 32 of 1024^2 (~100 MB as uint8)


def decode(body: bytes, content_type: str, max_batch: int, max_side: int,
           max_pixels: int = MAX_PIXELS) -> tuple[np.ndarray, list[str]]:
    """A request body -> (uint8 [B, H, W, 3], B prompts: a prompt sent with a data row is a
    :class:`~jagg_lightning.models.conditions.ConditionedPrompt` carrying it), or a :class:`WireError` naming what is
    wrong. What the
    pixels will cost is checked from the headers before any is decoded: ``max_pixels`` over the whole batch (a
    131 kB request of two 4096^2 PNGs would otherwise decode to gigabytes)."""
    kind = content_type.split(";")[0].strip().lower()
    if kind in (SAFETENSORS, "application/octet-stream"):
        array, prompts, rows = _decode_safetensors(body, max_batch, max_side, max_pixels)
    elif kind == JSON:
        array, prompts, rows = _decode_json(body, max_batch, max_side, max_pixels)
    else:
        raise WireError(415, f"Content-Type must be {SAFETENSORS} or {JSON}, got {content_type!r}")
    if array.shape[0] != len(prompts):
        raise WireError(422, f"got {array.shape[0]} images but {len(prompts)} prompts; send one prompt per image")
    return array, _with_rows(prompts, rows)


def _with_rows(prompts: list[str], rows) -> list[str]:
    """The prompts with their data rows (``rows`` absent: as sent), or a 422 naming what is wrong."""
    if rows is None:
        return prompts
    if not isinstance(rows, list) or len(rows) != len(prompts) or not all(isinstance(r, dict) for r in rows):
        raise WireError(422, f"rows must be a JSON array of {len(prompts)} objects, one per prompt ({{}} for none)")
    from jagg_lightning.models.conditions import ConditionedPrompt

    return [ConditionedPrompt(p, origin=f"request prompt {i} ({p!r:.60})", metadata=r) if r else p
            for i, (p, r) in enumerate(zip(prompts, rows))]


def _loads(data, what: str):
    """JSON of a request part, or a 400 naming it: malformed, not UTF-8, or nested too deeply for the parser (a
    RecursionError would otherwise be a 500, which a client retries)."""
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WireError(400, f"{what} is not JSON: {err}") from None
    except RecursionError:
        raise WireError(400, f"{what} is JSON nested too deeply") from None


def _check_pixels(count: int, max_pixels: int) -> None:
    if count > max_pixels:
        raise WireError(413, f"the images hold {count} pixels in all, over the server's limit of {max_pixels} "
                             f"(--max_pixels); send smaller batches")


def _check_prompts(prompts, max_batch: int) -> list[str]:
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise WireError(422, "prompts must be a JSON array of strings")
    if not 1 <= len(prompts) <= max_batch:
        raise WireError(422, f"the batch must hold 1 to {max_batch} images (the server's --max_batch), "
                             f"got {len(prompts)}")
    return prompts


def _check_shape(shape, max_side: int) -> None:
    if not isinstance(shape, (list, tuple)) or len(shape) != 4 or shape[3] != 3 or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in shape):
        shown = list(shape) if isinstance(shape, (list, tuple)) else shape
        raise WireError(422, f"images must have shape [B, H, W, 3] (RGB, channels last), got {shown!r:.200}")
    if not (1 <= shape[1] <= max_side and 1 <= shape[2] <= max_side):
        raise WireError(422, f"image height and width must be in [1, {max_side}] (the server's --max_side), "
                             f"got {shape[1]}x{shape[2]}")


def _decode_safetensors(body: bytes, max_batch: int, max_side: int, max_pixels: int):
    # read the header first, so a wrong dtype or shape is named before any tensor is built
    if len(body) < 8:
        raise WireError(400, "body is not a safetensors file (shorter than its 8-byte header length)")
    (size,) = struct.unpack("<Q", body[:8])
    if size > len(body) - 8:
        raise WireError(400, f"body is not a safetensors file (header length {size} exceeds the body)")
    header = _loads(body[8:8 + size], "the safetensors header (body is not a safetensors file)")
    if not isinstance(header, dict):
        raise WireError(400, "body is not a safetensors file (header is not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    if set(header) != {"images"}:
        raise WireError(422, f"the safetensors file must hold exactly one tensor named 'images', got {sorted(header)}")
    info = header["images"]
    if not isinstance(info, dict) or info.get("dtype") != "U8":
        dtype = info.get("dtype") if isinstance(info, dict) else info
        raise WireError(422, f"images must have dtype U8 (uint8, 0-255), got {dtype!r}")
    shape = info.get("shape", [])
    _check_shape(shape, max_side)
    if not isinstance(metadata, dict) or not isinstance(metadata.get("prompts", "null"), str):
        raise WireError(422, "metadata 'prompts' must be a JSON array of strings")
    prompts = _loads(metadata.get("prompts", "null"), "metadata 'prompts'")
    if not isinstance(metadata.get("rows", ""), str):
        raise WireError(422, "metadata 'rows' must be a JSON array of objects, as a string")
    rows = _loads(metadata["rows"], "metadata 'rows'") if "rows" in metadata else None
    _check_prompts(prompts, max_batch)
    _check_pixels(int(shape[0]) * int(shape[1]) * int(shape[2]), max_pixels)
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        array = load(body)["images"]
    except SafetensorError as err:
        raise WireError(400, f"body is not a valid safetensors file: {err}") from None
    return array, prompts, rows


def _decode_json(body: bytes, max_batch: int, max_side: int, max_pixels: int):
    from PIL import Image, UnidentifiedImageError

    request = _loads(body, "body")
    if not isinstance(request, dict) or not {"prompts", "images"} <= set(request) <= {"prompts", "images", "rows"}:
        raise WireError(422, 'the JSON body must be {"prompts": [...], "images": [base64 PNG, ...]} (and optionally '
                             '"rows": [...])')
    prompts = _check_prompts(request["prompts"], max_batch)
    pngs = request["images"]
    if not isinstance(pngs, list) or not all(isinstance(p, str) for p in pngs):
        raise WireError(422, "images must be a JSON array of base64-encoded PNG strings")
    if len(pngs) != len(prompts):
        raise WireError(422, f"got {len(pngs)} images but {len(prompts)} prompts; send one prompt per image")
    opened, pixels = [], 0
    for i, text in enumerate(pngs):  # every header first: nothing is decompressed before the whole batch is checked
        try:
            image = Image.open(io.BytesIO(base64.b64decode(text, validate=True)), formats=["PNG"])
        except (binascii.Error, UnidentifiedImageError) as err:
            raise WireError(400, f"images[{i}] is not a base64-encoded PNG ({err})") from None
        except Image.DecompressionBombError as err:  # PIL's own guard, from the header: far past any limit here
            raise WireError(413, f"images[{i}] is a decompression bomb ({err})") from None
        width, height = image.size  # from the header, before the pixels are decompressed
        _check_shape((len(pngs), height, width, 3), max_side)
        pixels += width * height
        _check_pixels(pixels, max_pixels)
        if image.mode != "RGB":
            raise WireError(422, f"images[{i}] must be 8-bit RGB, got PNG mode {image.mode!r}")
        if opened and image.size != opened[0].size:
            raise WireError(422, f"images[{i}] is {height}x{width} but images[0] is "
                                 f"{opened[0].size[1]}x{opened[0].size[0]}; a batch has one size")
        opened.append(image)
    arrays = []
    for i, image in enumerate(opened):
        try:
            arrays.append(np.asarray(image, dtype=np.uint8))
        except OSError as err:  # a truncated or corrupt PNG fails only when its pixels are read
            raise WireError(400, f"images[{i}] is not a readable PNG ({err})") from None
    return np.stack(arrays), prompts, request.get("rows")

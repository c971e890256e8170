"""A client of Flow-GRPO's reward servers (GenEval, DeQA, UnifiedReward): pickled bodies, read safely.

The protocol (yifan123/reward-server ``app_geneval.py`` / ``app_deqa.py``, the clients ``geneval_score`` /
``deqa_score_remote`` / ``unifiedreward_score_remote`` of yifan123/flow_grpo ``flow_grpo/rewards.py``;
verl-omni and Flash-GRPO post the same bodies), one request per chunk of at most ``batch_size`` images:

    POST <url>        body = pickle.dumps(request dict), no particular Content-Type
      deqa:           {"images": [JPEG bytes, ...]}
      unifiedreward:  {"images": [JPEG bytes, ...], "prompts": [str, ...]}
      geneval:        {"images": [JPEG bytes, ...], "meta_datas": [GenEval metadata dict, ...], "only_strict": bool}
    200               body = pickle.dumps(answer dict)
      deqa, unifiedreward: {"outputs": [B floats]}
      geneval:        {"scores": [B], "rewards": [B], "strict_rewards": [B], "group_rewards": {tag: [B]},
                       "group_strict_rewards": {tag: [B]}}
    500               body = the server's traceback as text (Flow-GRPO's client retries 500s)

The images are ``round(x * 255)`` uint8 RGB saved by PIL as JPEG (quality 75, PIL's default, which
Flow-GRPO's clients use). The answer is read by :func:`~jagg_lightning.rewards.safe_pickle.loads_plain`, never
``pickle.loads``: a server that answers anything but plain data (a pickle naming ``os.system``, an object array)
is refused with one line naming what it tried to load, and nothing of it runs. Nor can an answer make the client
allocate without bound: its body stops being read past ``max_answer_bytes``, and what the pickle builds is held to
``max_answer_bytes`` per buffer and ``max_answer_items`` elements (:class:`~jagg_lightning.rewards.safe_pickle.PickleLimits`),
each checked before the allocation; the scores' count is checked before they are converted.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import reprlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from jagg_lightning.models.conditions import metadata_of
from jagg_lightning.rewards.base import RewardError, check_images
from jagg_lightning.rewards.monitor import MONITOR_PREFIX
from jagg_lightning.rewards.remote import MAX_ANSWER_BYTES, RemoteReward, _one_line
from jagg_lightning.rewards.safe_pickle import MAX_ANSWER_ITEMS, PickleLimits, UnsafePickleError, loads_plain
from jagg_lightning.rewards.wire import to_uint8

# server -> (the score's key in the answer, what the request carries besides the images, {monitor: answer key})
SERVERS = {
    "deqa": ("outputs", (), {}),
    "unifiedreward": ("outputs", ("prompts",), {}),
    "geneval": ("scores", ("meta_datas", "only_strict"), {"strict_accuracy": "strict_rewards",
                                                          "accuracy": "rewards"}),
}
PICKLE_PROTOCOL = 4  # readable by every Python >= 3.4 a reward server may run


class FlowGRPOServerReward(RemoteReward):
    """Scores from a Flow-GRPO reward server (module docstring), with :class:`RemoteReward`'s timeout, retries,
    backoff and token (a bearer token for a proxy in front of the server; Flow-GRPO's servers check none).

    Args:
        url: where Flow-GRPO's client posts, ``http://host:port`` (the server's route is ``/``).
        server: ``deqa`` | ``unifiedreward`` | ``geneval`` -- what the request carries and which answer key is
            the score (``outputs``; GenEval's ``scores``, its partial-credit reward). GenEval's
            ``strict_rewards`` and ``rewards`` are reported as components ``monitor/<name>_strict_accuracy`` /
            ``monitor/<name>_accuracy`` (logged, never in the advantages).
        metadata: GenEval only: a JSONL file of GenEval metadata records (Flow-GRPO's
            ``dataset/geneval/*_metadata.jsonl``), each with its ``prompt``; a prompt's record is sent as its
            ``meta_datas`` entry. Prompts read from such a file as the data file carry their own record
            (:func:`jagg_lightning.models.conditions.metadata_of`), which is sent first; null = only those. A prompt with
            no record is refused by name.
        only_strict: GenEval's flag (the server then skips the non-strict accuracy; Flow-GRPO trains with True).
        batch_size: images per request, >= 1 (Flow-GRPO: 64).
        jpeg_quality: the JPEG quality the images are sent at, 1..95.
        score_key: the answer's key holding the scores, to override the server's (another server's protocol).
        extra_fields: further plain fields every request carries (a server that wants more than the three above).
        timeout: as :class:`RemoteReward`.
        retries: as :class:`RemoteReward`.
        token: as :class:`RemoteReward`.
        name: as :class:`RemoteReward`; None: ``server``.
        backoff: as :class:`RemoteReward`.
        max_answer_bytes: the largest answer read (:class:`RemoteReward`), and the largest buffer its pickle may
            build (a bytearray, a numpy array), >= 1 (default 64 MiB).
        max_answer_items: the most opcodes the answer's pickle may hold, and the most elements of a numpy array in
            it, >= 1 (default 1,000,000; an answer for 64 images holds a few hundred).
    """

    def __init__(self, url: str, server: str = "deqa", metadata: str | None = None, only_strict: bool = True,
                 batch_size: int = 64, jpeg_quality: int = 75, score_key: str | None = None,
                 extra_fields: dict | None = None, timeout: float = 120.0, retries: int = 3,
                 token: str | None = None, name: str | None = None, backoff: float = 1.0,
                 max_answer_bytes: int = MAX_ANSWER_BYTES, max_answer_items: int = MAX_ANSWER_ITEMS):
        if server not in SERVERS:
            raise ValueError(f"reward {name or 'flow_grpo_server'}: server must be one of {list(SERVERS)}, "
                             f"got {server!r}")
        super().__init__(url, timeout=timeout, retries=retries, token=token, name=name or server, backoff=backoff,
                         max_answer_bytes=max_answer_bytes)
        try:
            self.limits = PickleLimits(self.max_answer_bytes, max_answer_items)
        except ValueError as err:
            raise ValueError(f"reward {self.name}: {err}") from None
        if int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"reward {self.name}: batch_size must be an integer >= 1, got {batch_size}")
        if int(jpeg_quality) != jpeg_quality or not 1 <= jpeg_quality <= 95:
            raise ValueError(f"reward {self.name}: jpeg_quality must be an integer in [1, 95], got {jpeg_quality}")
        if extra_fields is not None and not isinstance(extra_fields, dict):
            raise ValueError(f"reward {self.name}: extra_fields must be a mapping, got {type(extra_fields).__name__}")
        default_key, self.fields, self.monitors = SERVERS[server]
        self.server, self.score_key = server, score_key or default_key
        self.only_strict, self.batch_size, self.jpeg_quality = bool(only_strict), int(batch_size), int(jpeg_quality)
        self.extra_fields = dict(extra_fields or {})
        self.metadata = self._read_metadata(metadata) if server == "geneval" and metadata is not None else None
        if server != "geneval" and metadata is not None:
            raise ValueError(f"reward {self.name}: metadata is GenEval's; server {server!r} takes none")

    def _read_metadata(self, path: str) -> dict[str, dict]:
        if not Path(path).is_file():
            raise FileNotFoundError(f"reward {self.name}: metadata {path!r} does not exist")
        records = {}
        for number, line in enumerate(Path(path).read_text().splitlines(), 1):
            if line.strip():
                record = json.loads(line)
                if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                    raise ValueError(f"reward {self.name}: metadata {path}:{number} is not a record with a 'prompt'")
                records[record["prompt"]] = record
        return records

    def _headers(self, content_type: str | None = None) -> dict:
        headers = super()._headers(content_type)
        headers["Accept"] = "*/*"  # the answer is a pickle, not JSON
        return headers

    def _body(self, images: Tensor, prompts: list[str]) -> bytes:
        from PIL import Image

        jpegs = []
        for array in to_uint8(images):
            buffer = io.BytesIO()
            Image.fromarray(array).save(buffer, format="JPEG", quality=self.jpeg_quality)
            jpegs.append(buffer.getvalue())
        request = {"images": jpegs, **self.extra_fields}
        if "prompts" in self.fields:
            request["prompts"] = list(prompts)
        if "meta_datas" in self.fields:
            records = [metadata_of(p) or (self.metadata or {}).get(p) for p in prompts]
            missing = [p for p, record in zip(prompts, records) if not record]
            if missing:
                raise RewardError(f"reward {self.name}: no GenEval metadata record for prompt {str(missing[0])!r} "
                                  "(give metadata: a JSONL file of records, or such a file as the data file)")
            request["meta_datas"] = records
        if "only_strict" in self.fields:
            request["only_strict"] = self.only_strict
        return pickle.dumps(request, protocol=PICKLE_PROTOCOL)

    def _answer(self, raw: bytes) -> dict:
        where = f"reward {self.name}: {self.url}"
        try:
            answer = loads_plain(raw, self.limits)
        except UnsafePickleError as err:
            raise RewardError(_one_line(f"{where} answered a pickle that is not plain data: {err}")) from None
        except Exception:  # noqa: BLE001 -- whatever pickle raises on bytes that are no pickle
            raise RewardError(_one_line(f"{where} answered something that is not a pickle: {raw[:120]!r}")) from None
        if not isinstance(answer, dict):
            raise RewardError(f"{where} answered a {type(answer).__name__}, not a dict")
        return answer

    def _scores(self, answer: dict, key: str, count: int) -> Tensor:
        """``count`` finite numbers under ``key``, or one line saying what is wrong."""
        where = f"reward {self.name}: {self.url}"
        if key not in answer:
            raise RewardError(_one_line(f"{where} answered no {key!r} (keys: {sorted(map(str, answer))})"))
        values = answer[key]
        if not isinstance(values, (list, tuple)) and not (isinstance(values, np.ndarray) and values.ndim == 1):
            raise RewardError(_one_line(f"{where}: {key!r} must be a list of numbers, got {reprlib.repr(values)}"))
        if len(values) != count:  # before any conversion: a long answer costs nothing
            raise RewardError(f"{where} returned {len(values)} {key} for {count} images; refusing it")
        values = values.tolist() if isinstance(values, np.ndarray) else values
        if not all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_))
                   for v in values):
            raise RewardError(_one_line(f"{where}: {key!r} must be a list of numbers, got {reprlib.repr(values)}"))
        values = [float(v) for v in values]
        if not all(math.isfinite(v) for v in values):
            raise RewardError(_one_line(f"{where} returned a non-finite value in {key}: {values}; "
                                        f"refusing to train on it"))
        return torch.tensor(values, dtype=torch.float32)

    def _request(self, images: Tensor, prompts: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
        totals, watched = [], {m: [] for m in self.monitors}
        for start in range(0, len(prompts), self.batch_size):
            chunk = slice(start, start + self.batch_size)
            count = len(prompts[chunk])
            answer = self._answer(self._call("", self._body(images[chunk], prompts[chunk]), "application/octet-stream"))
            totals.append(self._scores(answer, self.score_key, count))
            for monitor, key in self.monitors.items():
                if not (key == "rewards" and self.only_strict):  # only_strict: the server leaves it all 0
                    watched[monitor].append(self._scores(answer, key, count))
        device = images.device
        components = {self.name: torch.cat(totals).to(device)}
        for monitor, parts in watched.items():
            if parts:
                components[f"{MONITOR_PREFIX}{self.name}_{monitor}"] = torch.cat(parts).to(device)
        return components[self.name], components

    @torch.no_grad()
    def score_with_components(self, images: Tensor, prompts: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
        """The score and, for GenEval, its accuracies as monitors (one request per ``batch_size`` images)."""
        check_images(images, prompts, self.name)
        return self._request(images, prompts)

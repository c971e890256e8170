"""A reward scored by a ``jagg serve-reward`` server (or anything speaking its wire format).

The client needs nothing beyond the standard library (``urllib``): the training process does not
install the server's web stack.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import socket
import threading
import time
import urllib.parse

import torch
from torch import Tensor

from jagg_lightning.rewards.base import Reward, RewardError, check_images
from jagg_lightning.rewards.wire import ENCODINGS, encode

RETRIED_STATUSES = (429, 500, 502, 503, 504)  # the server is busy or broken: another try may succeed
MAX_BACKOFF_S = 30.0
MAX_ANSWER_BYTES = 64 << 20  # an answer for a micro-batch is a few kB; a server sending more is broken or hostile
READ_CHUNK = 1 << 16


class RemoteReward(Reward):
    """Scores from ``POST {url}/score``; usable wherever a reward is (inside ``WeightedReward`` too).

    Args:
        url: the server's base address, ``http://host:port`` (``https://`` too); ``/score`` is appended.
        timeout: seconds one attempt may take in all -- connect, send, score, the whole answer --, > 0: a watchdog
            cuts the connection at the deadline, so an answer trickled a byte at a time cannot stretch it.
        retries: further attempts after a timeout, a refused connection or a 429/5xx status, >= 0; attempt
            i > 0 waits ``backoff * 2**(i - 1)`` seconds, or the ``Retry-After`` the server sent if longer (at
            most 30). 4xx answers are not retried: the same request would be refused again.
        token: the bearer token, literally or as ``env:VAR`` (read from the environment now; only the
            ``env:`` form is recorded in the hyper-parameters, so a checkpoint never holds the secret).
        name: the reward's name (its key among a ``WeightedReward``'s components).
        encoding: ``safetensors`` (raw uint8) or ``png`` (JSON with base64 PNGs); both are 8-bit.
        backoff: seconds before the first retry, >= 0.
        max_answer_bytes: the largest answer body read, >= 1: a larger ``Content-Length`` is refused before the
            body is read, and a body without one stops being read past the cap; either is one line naming the cap
            (not retried: the same request would get the same answer).

    When every attempt fails, one :class:`RewardError` names the URL, the attempts and the last status,
    on one line. An answer with the wrong number of scores or a non-finite score is refused. Requests go
    straight to ``url`` (no HTTP proxy from the environment). Images travel as 8 bits per channel:
    the served reward scores ``wire.quantize(images)``.
    """

    name = "remote"

    def __init__(self, url: str, timeout: float = 60.0, retries: int = 3, token: str | None = None,
                 name: str = "remote", encoding: str = "safetensors", backoff: float = 1.0,
                 max_answer_bytes: int = MAX_ANSWER_BYTES):
        super().__init__()
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"reward remote: url must start with http:// or https://, got {url!r}")
        if not timeout > 0:
            raise ValueError(f"reward remote: timeout must be > 0 seconds, got {timeout}")
        if int(retries) != retries or retries < 0:
            raise ValueError(f"reward remote: retries must be an integer >= 0, got {retries}")
        if not backoff >= 0:
            raise ValueError(f"reward remote: backoff must be >= 0 seconds, got {backoff}")
        if encoding not in ENCODINGS:
            raise ValueError(f"reward remote: encoding must be one of {list(ENCODINGS)}, got {encoding!r}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"reward remote: name must be a non-empty string, got {name!r}")
        if isinstance(max_answer_bytes, bool) or int(max_answer_bytes) != max_answer_bytes or max_answer_bytes < 1:
            raise ValueError(f"reward {name}: max_answer_bytes must be an integer >= 1, got {max_answer_bytes}")
        self.max_answer_bytes = int(max_answer_bytes)
        self.url = url.rstrip("/")
        self.timeout, self.retries, self.backoff = float(timeout), int(retries), float(backoff)
        self.encoding, self.name = encoding, name
        self._token = self._resolve_token(token)
        self.freeze()

    def _resolve_token(self, token: str | None) -> str | None:
        if token is None or not token.startswith("env:"):
            return token
        value = os.environ.get(token[4:], "")
        if not value:
            raise ValueError(f"reward {self.name}: token {token!r}: environment variable {token[4:]} is unset or empty")
        return value

    def describe(self) -> dict:
        described = super().describe()
        token = described.get("init_args", {}).get("token")
        if token is not None and not token.startswith("env:"):
            return {"class_path": described["class_path"],
                    "not_rebuildable": "its token was given literally and is not recorded; give token: env:VAR"}
        return described

    def _headers(self, content_type: str | None = None) -> dict:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _attempt(self, path: str, body: bytes | None, content_type: str | None,
                 timeout: float) -> tuple[int, dict, bytes]:
        """One request, (status, headers, body), within ``timeout`` seconds in all: a timer shuts the socket at
        the deadline (each blocking read then ends), and a request past it raises ``TimeoutError``."""
        parts = urllib.parse.urlsplit(self.url + path)
        connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        connection = connection_class(parts.hostname, parts.port, timeout=timeout)  # straight there: no proxy
        expired, opened = threading.Event(), []

        def cut() -> None:
            expired.set()
            for sock in opened:  # kept here: the connection drops its own reference once the answer owns it
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        watchdog = threading.Timer(timeout, cut)
        watchdog.daemon = True
        watchdog.start()
        try:
            connection.connect()
            opened.append(connection.sock)
            if expired.is_set():  # the deadline passed while connecting
                cut()
            target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            connection.request("GET" if body is None else "POST", target, body=body, headers=self._headers(content_type))
            answer = connection.getresponse()
            data = self._read_capped(answer, path)
            if expired.is_set():
                raise TimeoutError(f"no whole answer within {timeout:g} s")
            return answer.status, dict(answer.getheaders()), data
        except (OSError, http.client.HTTPException):
            if expired.is_set():
                raise TimeoutError(f"no whole answer within {timeout:g} s") from None
            raise
        finally:
            watchdog.cancel()
            connection.close()

    def _read_capped(self, answer: http.client.HTTPResponse, path: str) -> bytes:
        """The answer's body, read in chunks and never past ``max_answer_bytes`` (a RewardError naming the cap)."""
        limit, declared = self.max_answer_bytes, answer.getheader("Content-Length")
        refusal = (f"reward {self.name}: {self.url}{path} answered more than max_answer_bytes={limit} bytes "
                   f"(Content-Length {declared}); refusing it" if declared else
                   f"reward {self.name}: {self.url}{path} answered more than max_answer_bytes={limit} bytes; "
                   f"stopped reading and refused it")
        chunks, size = [], 0
        if not (declared and declared.strip().isdigit() and int(declared) > limit):
            while size <= limit and (chunk := answer.read(min(READ_CHUNK, limit + 1 - size))):
                chunks.append(chunk)
                size += len(chunk)
            if size <= limit:
                return b"".join(chunks)
        answer.close()  # hang up on the rest: the socket closes with the answer's file, not with the connection
        raise RewardError(refusal)

    def _call(self, path: str, body: bytes | None = None, content_type: str | None = None,
              abort: threading.Event | None = None) -> bytes:
        """One request with retries; the answer's body, or one RewardError naming the URL and the last status.
        ``abort`` (set when a concurrent request of the same call failed): no further attempt starts, and a
        backoff wait ends at once, with :class:`RequestCancelled`."""
        url, last, wait = self.url + path, "no attempt", 0.0
        for attempt in range(self.retries + 1):
            pause = min(max(self.backoff * 2 ** (attempt - 1), wait), MAX_BACKOFF_S) if attempt else 0.0
            if abort is not None and abort.wait(pause):
                raise RequestCancelled(f"reward {self.name}: {url}: cancelled after another request failed")
            if abort is None and pause:
                time.sleep(pause)
            wait = 0.0
            try:
                status, headers, data = self._attempt(path, body, content_type, self.timeout)
            except (OSError, http.client.HTTPException) as err:  # no (complete) answer
                last = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                if body is not None and isinstance(err, (ConnectionResetError, BrokenPipeError)):
                    self._refuse_if_too_large(len(body))
                continue
            if 200 <= status < 300:
                return data
            last = f"HTTP {status}: {_error_text(data)}"
            if status not in RETRIED_STATUSES:
                raise RewardError(_one_line(f"reward {self.name}: {url} refused the request: {last}"))
            wait = _retry_after(headers)
        raise RewardError(_one_line(f"reward {self.name}: {url} failed {self.retries + 1} attempt(s) "
                                    f"(timeout {self.timeout:g}s each); last status: {last}"))

    def _refuse_if_too_large(self, size: int) -> None:
        """A server refuses an oversize body with 413 before reading it and closes the connection; a large
        body is then cut off mid-send and the 413 never arrives. Ask /health for the limit (one try) and
        say so, rather than retrying what cannot succeed."""
        try:
            status, _, data = self._attempt("/health", None, None, min(self.timeout, 10.0))
            limit = json.loads(data)["limits"]["max_body_bytes"] if status == 200 else None
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError):
            # no answer, or a server without jagg's /health: keep retrying as for any dropped connection
            return
        if isinstance(limit, int) and size > limit:
            raise RewardError(f"reward {self.name}: {self.url}/score refused the request: body of {size} bytes "
                              f"exceeds the server's limit of {limit} bytes (its --max_body_mb); score smaller "
                              f"micro-batches or raise the limit")

    def health(self) -> dict:
        """The server's ``GET /health`` answer (reward name, class, versions, limits)."""
        return json.loads(self._call("/health"))

    def _request(self, images: Tensor, prompts: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
        body, content_type = encode(images, prompts, self.encoding)
        raw = self._call("/score", body, content_type)
        try:
            answer = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise RewardError(_one_line(f"reward {self.name}: {self.url}/score answered something that is not "
                                        f"JSON: {raw[:200]!r}")) from None
        if not isinstance(answer, dict):
            raise RewardError(f"reward {self.name}: {self.url}/score answered {type(answer).__name__}, not an object")
        total = self._column(answer.get("scores"), "scores", len(prompts))
        components = answer.get("components") or {}
        if not isinstance(components, dict):
            raise RewardError(f"reward {self.name}: {self.url}/score: components must be an object")
        parts = {str(k): self._column(v, f"components[{k!r}]", len(prompts)) for k, v in components.items()}
        device = images.device
        return total.to(device), {k: v.to(device) for k, v in parts.items()}

    def _column(self, values, field: str, count: int) -> Tensor:
        """B finite numbers, or a refusal naming the field: a short or NaN answer must not reach the advantages."""
        if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                   for v in values):
            raise RewardError(f"reward {self.name}: {self.url}/score: {field} must be a list of numbers")
        if len(values) != count:
            raise RewardError(f"reward {self.name}: {self.url}/score returned {len(values)} {field} for "
                              f"{count} images; refusing it")
        if not all(math.isfinite(v) for v in values):
            raise RewardError(_one_line(f"reward {self.name}: {self.url}/score returned a non-finite value in "
                                        f"{field}: {values}; refusing to train on it"))
        return torch.tensor(values, dtype=torch.float32)

    def score(self, images: Tensor, prompts: list[str]) -> Tensor:
        return self._request(images, prompts)[0]

    @torch.no_grad()
    def score_with_components(self, images: Tensor, prompts: list[str]) -> tuple[Tensor, dict[str, Tensor]]:
        """The served total and the served reward's own components (one request); a single served reward
        is reported under this reward's ``name``."""
        check_images(images, prompts, self.name, self.accepts_video)
        total, components = self._request(images, prompts)
        return total, (components if len(components) > 1 else {self.name: total})


class RequestCancelled(RewardError):
    """A request not (or no longer) attempted because another request of the same call failed first."""


def _error_text(raw: bytes) -> str:
    """The server's ``{"error": ...}`` message, else the start of whatever it answered."""
    try:
        return str(json.loads(raw)["error"])
    except (ValueError, KeyError, TypeError):
        text = raw.decode("utf-8", "replace")
        if text.startswith("Traceback"):  # a Python server's traceback (Flow-GRPO's): its last line says what failed
            return text.strip().splitlines()[-1][:200]
        return text[:200]


def _retry_after(headers: dict) -> float:
    """Seconds a ``Retry-After`` header asks for (its delta-seconds form; 0 without one or for a date)."""
    value = next((v for k, v in headers.items() if k.lower() == "retry-after"), "")
    try:
        return max(0.0, float(value))
    except ValueError:
        return 0.0


def _one_line(text: str) -> str:
    return " ".join(text.split())

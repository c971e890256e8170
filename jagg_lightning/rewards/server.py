"""``jagg serve-reward``: any :class:`Reward` behind HTTP, so a heavy or foreign scorer runs outside training.

Starlette (ASGI app) on uvicorn (server): ``pip install 'jagg_lightning[serve]'``. The wire format is
:mod:`jagg_lightning.rewards.wire` (safetensors or PNG+JSON in, JSON out; no pickle).

Endpoints:

- ``GET /health`` -> ``{"status": "ok", "reward", "class_path", "version", "reward_version", "limits"}``
  (``version`` is jagg_lightning's, ``reward_version`` the reward's own ``version`` attribute or null);
- ``POST /score`` -> ``{"reward", "scores", "components"}``.

Safe by default: binds 127.0.0.1; with ``--token_env VAR`` every request must carry
``Authorization: Bearer <$VAR>`` (the token never appears on the command line). A host beyond this machine (any
address that is not loopback, ``0.0.0.0`` included) refuses to start without a token unless ``--no_token`` says
that anyone who can reach the port may score (Jupyter's and TensorBoard's rule); bodies over
``--max_body_mb`` are refused before they are read. Statuses: 400 unreadable body, 401 missing or wrong
token, 413 body too large, 415 unknown Content-Type, 422 wrong shape / dtype / count / prompts (the
message names the problem; a reward's own ``ValueError`` about a prompt is a 422 too), 500 the reward
failed, 503 with ``Retry-After`` when ``--max_concurrency`` score requests are already in flight (decoded or
waiting to be scored: what bounds the server's memory). 5xx are worth retrying, 4xx are not:
:class:`~jagg_lightning.rewards.remote.RemoteReward` does exactly that (and waits the ``Retry-After`` it is given).

Hostile input stays a 4xx: JSON nested past the parser's depth (in the body, the prompts, the safetensors header
or its metadata) is a 400, a PNG decompression bomb a 413, and the decoded pixels of one request are budgeted from
the headers before any is decoded (``--max_pixels``, default 2^25: two 4096^2 images). After a large request the
freed memory goes back to the system (``gc`` and glibc's ``malloc_trim``), so a burst does not leave the server
hundreds of MB larger.

Requests are decoded concurrently but scored one at a time (a lock): reward models are rarely thread-safe
and a GPU gains nothing from interleaving; each request gets its own answer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import hmac
import importlib
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading

from jagg_lightning.rewards.wire import MAX_PIXELS, WireError, decode, from_uint8  # numpy; torch when decoding

# the reward registry (torch) is imported when a reward is built: ``jagg serve-reward --help`` imports no torch
from jagg_lightning.utils.strict_args import StrictParser

log = logging.getLogger("jagg.serve_reward")
LARGE_REQUEST = 16 << 20  # bytes of body or decoded pixels after which the freed memory is handed back
RETRY_AFTER_S = 1


def release_memory() -> None:
    """Hand freed memory back to the system: collect cycles, then glibc's ``malloc_trim`` (the arenas of a large
    decode otherwise stay mapped; a no-op where there is no glibc)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def build_app(reward, token: str | None = None, max_body_bytes: int = 256 << 20, max_batch: int = 1024,
              max_side: int = 4096, device: str = "cpu", max_pixels: int = MAX_PIXELS, max_concurrency: int = 64):
    """The Starlette app serving ``reward`` (a built :class:`Reward`), limits as in the module docstring."""
    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from jagg_lightning import __version__

    lock = threading.Lock()
    described = reward.describe()
    health = {"status": "ok", "reward": reward.name, "class_path": described["class_path"], "version": __version__,
              "reward_version": getattr(reward, "version", None),
              "limits": {"max_body_bytes": max_body_bytes, "max_batch": max_batch, "max_side": max_side,
                         "max_pixels": max_pixels, "max_concurrency": max_concurrency}}
    in_flight = [0]  # score requests being read, decoded or scored (the event loop's thread alone changes it)

    def refuse(status: int, message: str) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        if status == 503:
            headers = {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse({"error": message}, status_code=status, headers=headers)

    def authorised(request) -> bool:
        if token is None:
            return True
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        # constant-time comparison: the answer time must not tell how much of a guess was right
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())

    async def read_body(request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise WireError(400, f"Content-Length must be a byte count, got {declared!r}")
            if int(declared) > max_body_bytes:  # refused before a byte of it is read
                raise WireError(413, f"body of {int(declared)} bytes exceeds the server's limit of {max_body_bytes} "
                                     f"bytes (--max_body_mb); send smaller batches")
        chunks, size = [], 0
        async for chunk in request.stream():  # also bounds a chunked body that declares no length
            size += len(chunk)
            if size > max_body_bytes:
                raise WireError(413, f"body exceeds the server's limit of {max_body_bytes} bytes (--max_body_mb); "
                                     f"send smaller batches")
            chunks.append(chunk)
        return b"".join(chunks)

    def score(array, prompts) -> dict:
        images = from_uint8(array).to(device)
        with lock:
            total, components = reward.score_with_components(images, prompts)
        return {"reward": reward.name, "scores": total.float().cpu().tolist(),
                "components": {name: c.float().cpu().tolist() for name, c in components.items()}}

    async def health_endpoint(request):
        if not authorised(request):
            return refuse(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        return JSONResponse(health)

    async def score_endpoint(request):
        if not authorised(request):
            return refuse(401, "missing or wrong bearer token (Authorization: Bearer <token>)")
        if in_flight[0] >= max_concurrency:
            return refuse(503, f"{max_concurrency} score requests already in flight (--max_concurrency); retry "
                               f"after {RETRY_AFTER_S} s")
        in_flight[0] += 1
        try:
            return await answer(request)
        finally:
            in_flight[0] -= 1

    async def answer(request):
        size, body, array = 0, None, None
        try:
            try:
                body = await read_body(request)
                size = len(body)
                array, prompts = await run_in_threadpool(decode, body, request.headers.get("content-type", ""),
                                                         max_batch, max_side, max_pixels)
                size = max(size, array.nbytes * 4)  # the float32 copy the reward scores
            except WireError as err:
                return refuse(err.status, str(err))
            try:
                scored = await run_in_threadpool(score, array, prompts)
            except Exception as err:  # the reward's own failure
                # a ValueError (raised directly or wrapped in RewardError) is about the input, e.g. a prompt the
                # reward cannot score: the client must not retry it, so it is a 4xx
                if isinstance(err, ValueError) or isinstance(err.__cause__, ValueError):
                    return refuse(422, str(err))
                log.exception("reward %s failed", reward.name)
                return refuse(500, f"reward {reward.name} failed: {type(err).__name__}: {err}")
            return JSONResponse(scored)
        finally:
            body = array = None  # noqa: F841 -- dropped before the memory is handed back
            if size > LARGE_REQUEST:
                await run_in_threadpool(release_memory)

    return Starlette(routes=[Route("/health", health_endpoint, methods=["GET"]),
                             Route("/score", score_endpoint, methods=["POST"])])


def build_served_reward(reward: str, init_args: dict):
    """A registered name, or a class_path the operator named (so its module is imported: they chose it)."""
    from jagg_lightning.rewards.registry import REWARD_CLASSES, build_reward, reward_class

    if reward in REWARD_CLASSES:
        return reward_class(reward)(**init_args)
    module_name, _, _ = reward.rpartition(".")
    if not module_name:
        raise ValueError(f"--reward must be one of {sorted(REWARD_CLASSES)} or a Reward class_path, got {reward!r}")
    try:
        importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"--reward {reward!r}: cannot import {module_name} ({err})") from err
    return build_reward({"class_path": reward, "init_args": init_args})


def parser() -> argparse.ArgumentParser:
    p = StrictParser(prog="jagg serve-reward", description="Serve a reward over HTTP (docs/rewards.md).")
    p.add_argument("--reward", required=True, help="a registered name (e.g. ocr) or a Reward class_path")
    p.add_argument("--init_args", default="{}", help="the reward's constructor arguments as a JSON object")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=8000, help="port, 0 for a free one (printed at start)")
    p.add_argument("--token_env", default=None,
                   help="name of an environment variable holding the bearer token every request must carry")
    p.add_argument("--no_token", "--no-token", action="store_true", dest="no_token",
                   help="serve a host beyond loopback without a token: anyone who can reach the port may score")
    p.add_argument("--max_body_mb", type=float, default=256.0, help="largest request body, MiB (default 256)")
    p.add_argument("--max_batch", type=int, default=1024, help="most images per request (default 1024)")
    p.add_argument("--max_side", type=int, default=4096, help="largest image height or width (default 4096)")
    p.add_argument("--max_pixels", type=int, default=MAX_PIXELS,
                   help=f"most decoded pixels (B x H x W) in one request (default {MAX_PIXELS}: two 4096^2 images)")
    p.add_argument("--max_concurrency", type=int, default=64,
                   help="score requests in flight beyond this get 503 with Retry-After (default 64)")
    p.add_argument("--device", default="cpu", help="torch device the reward runs on (default cpu)")
    return p


def _check(args) -> tuple[dict, str | None]:
    """Every argument checked before the reward is built; returns (init_args, token)."""
    try:
        init_args = json.loads(args.init_args)
    except json.JSONDecodeError as err:
        raise ValueError(f"--init_args must be a JSON object, got {args.init_args!r} ({err})") from None
    if not isinstance(init_args, dict):
        raise ValueError(f"--init_args must be a JSON object, got {args.init_args!r}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if not args.max_body_mb > 0:
        raise ValueError(f"--max_body_mb must be > 0, got {args.max_body_mb}")
    for field in ("max_batch", "max_side", "max_pixels", "max_concurrency"):
        if getattr(args, field) < 1:
            raise ValueError(f"--{field} must be >= 1, got {getattr(args, field)}")
    token = None
    if args.token_env is not None:
        token = os.environ.get(args.token_env, "")
        if not token:
            raise ValueError(f"--token_env {args.token_env}: that environment variable is unset or empty")
        if args.no_token:
            raise ValueError("--no_token and --token_env contradict each other: give one")
    if token is None and not args.no_token and not is_loopback(args.host):
        raise ValueError(f"--host {args.host} is reachable beyond this machine: give --token_env VAR (every request "
                         f"then carries Authorization: Bearer $VAR), or --no_token to serve anyone who can reach "
                         f"the port")
    return init_args, token


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback one (127.0.0.0/8, ::1; a name is resolved; an unresolved
    name is not)."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(found) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in found)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # a restarted server can take its port back at once (the old one's connections may linger in TIME_WAIT)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


def serve_main(argv: list[str], prepare=None) -> int:
    """Entry point of ``jagg serve-reward``; returns the exit status. ``prepare`` (the console's quiet defaults and
    CPU threads) is called once the arguments are parsed, before the reward is built. SIGINT (Ctrl-C) or SIGTERM: a
    graceful shutdown (requests still open after 5 s are cancelled), one line, exit status 128 + the signal."""
    args = parser().parse_args(argv)
    try:
        init_args, token = _check(args)
        # fail on a missing extra before the reward is built
        import starlette  # noqa: F401
        import uvicorn
    except ImportError as err:
        print(f"jagg serve-reward: error: {err}; pip install 'jagg_lightning[serve]'", file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"jagg serve-reward: error: {err}", file=sys.stderr)
        return 2
    if prepare is not None:
        prepare()
    try:
        reward = build_served_reward(args.reward, init_args).to(args.device)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as err:
        print(f"jagg serve-reward: error: cannot build reward {args.reward!r}: {err}", file=sys.stderr)
        return 2
    app = build_app(reward, token, int(args.max_body_mb * (1 << 20)), args.max_batch, args.max_side, args.device,
                    args.max_pixels, args.max_concurrency)
    try:
        sock = _bind(args.host, args.port)
    except OSError as err:
        print(f"jagg serve-reward: error: cannot bind {args.host}:{args.port}: {err}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    if not is_loopback(host) and token is None:  # --no_token: said explicitly, still said once
        print(f"jagg serve-reward: warning: listening on {host}, beyond this machine, without a token "
              f"(--no_token)", file=sys.stderr)
    # the one line a supervisor (or a test) waits for: the reward is built and the port is bound
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    print(f"jagg serve-reward: {reward.name} on {url}", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            limit_concurrency=args.max_concurrency + 16, timeout_graceful_shutdown=5)
    server = _server_class(uvicorn)(config)
    shutdown_log = _ShutdownLog()
    logging.getLogger("uvicorn.error").addFilter(shutdown_log)
    try:
        server.run(sockets=[sock])
    finally:
        logging.getLogger("uvicorn.error").removeFilter(shutdown_log)
    if server.stopped_by is None:
        return 0
    cancelled = f", {shutdown_log.cancelled} request(s) still open cancelled" if shutdown_log.cancelled else ""
    name = "SIGINT (Ctrl-C)" if server.stopped_by == signal.SIGINT else signal.Signals(server.stopped_by).name
    print(f"jagg serve-reward: stopped by {name}{cancelled}, exit status {128 + server.stopped_by}", file=sys.stderr,
          flush=True)
    return 128 + server.stopped_by


class _ShutdownLog(logging.Filter):
    """uvicorn's shutdown records, counted instead of printed: the requests still open when the graceful shutdown
    ran out (5 s) are cancelled, and each would print a ``CancelledError`` traceback."""

    def __init__(self):
        super().__init__()
        self.cancelled = 0

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, asyncio.CancelledError):
            self.cancelled += 1
            return False
        return not str(record.msg).startswith("Cancel %s running task(s)")


def _server_class(uvicorn):
    """uvicorn's Server, stopping on SIGINT / SIGTERM as it does (a graceful shutdown; a second Ctrl-C forces it),
    without re-raising the signal inside its event loop afterwards: that cancels the requests still open, each with a
    traceback, and ends in a ``KeyboardInterrupt`` one. The signal is kept in ``stopped_by`` for :func:`serve_main`."""

    class Server(uvicorn.Server):
        stopped_by: int | None = None

        def handle_exit(self, sig, frame) -> None:
            self.stopped_by = self.stopped_by or int(sig)
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server

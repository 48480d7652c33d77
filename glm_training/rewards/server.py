"""Reward server: hosts any registered reward over HTTP for the `remote` reward (JSON wire format, version 1).

    python -m glm_training.rewards.server reward=<name> port=<int> [host=127.0.0.1] [max_request_mb=256] \\
        [options.<key>=<value> ...]

`options.<key>=<value>` are the reward's constructor keywords (what `reward.options.<name>.<key>` would be
in a training config); values are parsed as YAML, so `options.quality=90` is an int and
`options.device=cuda:1` a string. The server is stdlib `http.server.ThreadingHTTPServer`: requests are
read and their PNGs decoded in parallel threads, and the reward itself is called under one lock, because
reward models are not thread-safe. There is no authentication and no TLS: bind to 127.0.0.1 (the
default) and tunnel, or bind 0.0.0.0 only on a trusted cluster network. The wire format is described in
`glm_training/rewards/remote.py` and docs/reward_server.md.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch
import yaml

import glm_training.rewards  # noqa: F401  (importing the package registers every reward)
from glm_training.rewards.registry import Reward, build_reward
from glm_training.rewards.remote import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_REQUEST_BYTES,
    WIRE_VERSION,
    WireFormatError,
    encode_scores,
    parse_request,
)

logger = logging.getLogger(__name__)

USAGE = (
    "usage: python -m glm_training.rewards.server reward=<name> port=<int> [host=127.0.0.1] "
    "[max_request_mb=256] [options.<key>=<value> ...]"
)


CLOSE_WAIT_S = 10.0  # how long `RewardServer.server_close` waits for requests in flight


class RewardServer(ThreadingHTTPServer):
    """HTTP server: `POST /score` scores a batch with `reward` (one call at a time), `GET /health` names it.

    Args:
        reward: the reward to host; its name is reported by /health.
        host, port: where to listen; port 0 picks a free port (see `url`).
        max_request_bytes: larger request bodies are refused with 413 before they are read.
        max_image_pixels: larger images are refused with 400 before they are decoded.
        request_timeout_s: socket timeout while reading a request, so a stalled client frees its thread.
    """

    daemon_threads = True  # a stalled client must not keep the process alive at exit

    def __init__(
        self,
        reward: Reward,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
        request_timeout_s: float = 120.0,
    ) -> None:
        if ":" in host:
            self.address_family = socket.AF_INET6
        self.reward = reward
        self.reward_name = getattr(reward, "name", type(reward).__name__)
        self.max_request_bytes = max_request_bytes
        self.max_image_pixels = max_image_pixels
        self.request_timeout_s = request_timeout_s
        self.reward_lock = threading.Lock()
        self.handler_threads: list[threading.Thread] = []
        super().__init__((host, port), _RewardHandler)

    def process_request(self, request, client_address) -> None:
        """Each request in a daemon thread, as ThreadingMixIn does, remembered so that `server_close` can wait
        for the ones still answering."""
        thread = threading.Thread(
            target=self.process_request_thread, args=(request, client_address), daemon=True
        )
        self.handler_threads = [t for t in self.handler_threads if t.is_alive()] + [thread]
        thread.start()

    def server_close(self) -> None:
        """Stop listening, then wait up to `CLOSE_WAIT_S` for the requests still being answered: a process
        that exits while a handler thread runs can abort in a library's teardown ("terminate called without
        an active exception"), and a stalled client must not keep it alive either."""
        super().server_close()
        deadline = time.monotonic() + CLOSE_WAIT_S
        for thread in self.handler_threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    @property
    def url(self) -> str:
        """The base URL clients use, with the port actually bound (useful with port 0)."""
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}"

    def score(self, images: list, prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        """The reward's float32 scores [N], checked; RuntimeError if the reward answers something else."""
        if not images:
            return torch.zeros(0, dtype=torch.float32)
        with self.reward_lock:
            scores = self.reward(images, prompts, metadata)
        if not isinstance(scores, torch.Tensor):
            raise RuntimeError(f"reward {self.reward_name!r} returned {type(scores).__name__}, not a tensor")
        scores_n = scores.detach().to(device="cpu", dtype=torch.float32)
        if tuple(scores_n.shape) != (len(images),):
            raise RuntimeError(
                f"reward {self.reward_name!r} returned shape {tuple(scores_n.shape)} for {len(images)} images"
            )
        bad = (~torch.isfinite(scores_n)).nonzero().flatten().tolist()
        if bad:
            raise RuntimeError(
                f"reward {self.reward_name!r} returned non-finite scores at indices {bad[:10]}"
            )
        return scores_n


class _RewardHandler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = f"glm-training-reward-server/{WIRE_VERSION}"

    def setup(self) -> None:
        self.timeout = self.server.request_timeout_s
        super().setup()
        self._started = time.perf_counter()
        self._detail = ""

    def do_GET(self) -> None:  # noqa: N802  (BaseHTTPRequestHandler's naming)
        path = urllib.parse.urlsplit(self.path).path
        if path == "/health":
            self._send_json(
                200,
                {
                    "status": "ok",
                    "version": WIRE_VERSION,
                    "reward": self.server.reward_name,
                    "max_request_bytes": self.server.max_request_bytes,
                },
            )
        elif path == "/score":
            self._send_error_json(405, "use POST /score", headers={"Allow": "POST"})
        else:
            self._send_error_json(404, f"no endpoint {path!r}; use GET /health or POST /score")

    def do_POST(self) -> None:  # noqa: N802
        path = urllib.parse.urlsplit(self.path).path
        if path != "/score":
            if path == "/health":
                self._send_error_json(405, "use GET /health", headers={"Allow": "GET"})
            else:
                self._send_error_json(404, f"no endpoint {path!r}; use GET /health or POST /score")
            return
        body = self._read_body()
        if body is None:
            return
        try:
            images, prompts, metadata = parse_request(body, self.server.max_image_pixels)
        except WireFormatError as error:
            self._send_error_json(400, f"malformed request: {error}")
            return
        self._detail = f"n={len(images)}"
        try:
            scores_n = self.server.score(images, prompts, metadata)
        except ValueError as error:
            # The Reward contract: ValueError means this input is unusable (e.g. an OCR prompt without
            # text), so the client must not retry it.
            self._send_error_json(422, f"reward {self.server.reward_name!r} rejected the batch: {error}")
            return
        except Exception as error:  # noqa: BLE001  (the server keeps serving; the client sees a 500)
            logger.exception("reward %r failed on a batch of %d", self.server.reward_name, len(images))
            self._send_error_json(
                500, f"reward {self.server.reward_name!r} failed: {type(error).__name__}: {error}"
            )
            return
        self._send_body(200, encode_scores(scores_n))

    def _read_body(self) -> bytes | None:
        """The request body, or None after answering 411/400/413 for a missing, bad or too large length."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self._send_error_json(411, "chunked requests are not supported; send a Content-Length")
            return None
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            self._send_error_json(411, "a Content-Length header is required")
            return None
        try:
            length = int(length_header)
        except ValueError:
            length = -1
        if length < 0:
            self._send_error_json(400, f"invalid Content-Length {length_header[:50]!r}")
            return None
        if length > self.server.max_request_bytes:
            self._send_error_json(
                413,
                f"request of {length} bytes exceeds the server's limit of {self.server.max_request_bytes}; "
                "send fewer images per request (the remote reward's batch_size) or raise max_request_mb",
            )
            return None
        body = self.rfile.read(length)
        if len(body) != length:
            self._send_error_json(400, f"the body ended after {len(body)} of {length} bytes")
            return None
        return body

    def _send_error_json(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        self._detail = (self._detail + " " if self._detail else "") + f"error={message[:200]!r}"
        self._send_body(status, json.dumps({"error": message}).encode("utf-8"), headers)

    def _send_json(self, status: int, payload: dict[str, Any]) -> None:
        self._send_body(status, json.dumps(payload).encode("utf-8"))

    def _send_body(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            # The client gave up (its timeout_s) while the reward was scoring: nothing left to answer.
            logger.warning("%s: the client closed the connection before the answer", self.address_string())
        self.close_connection = True  # one request per connection: the body may not have been read
        elapsed = time.perf_counter() - self._started
        logger.info(
            "%s %s %s %d %.3fs %s",
            self.address_string(), self.command, getattr(self, "path", "")[:100], status, elapsed,
            self._detail,
        )  # fmt: skip

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        # Replaces http.server's HTML error page (malformed request lines, unsupported methods) with JSON.
        text = message or self.responses.get(code, ("error",))[0]
        self._send_error_json(code, text + (f": {explain}" if explain else ""))

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass  # `_send_body` logs one line per request, with the batch size and the time taken

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (http.server's signature)
        logger.warning("%s %s", self.address_string(), format % args)


@contextlib.contextmanager
def serve_in_thread(
    reward: Reward, host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> Iterator[RewardServer]:
    """A `RewardServer` serving from a daemon thread for the duration of the `with` block (tests)."""
    server = RewardServer(reward, host, port, **kwargs)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


# --------------------------------------------------------------------------- command line


class CliError(ValueError):
    """A command-line argument the server cannot use; the message names it and the fix."""


@dataclass
class ServerArgs:
    reward: str
    port: int
    host: str = "127.0.0.1"
    max_request_mb: float = DEFAULT_MAX_REQUEST_BYTES / 2**20
    options: dict[str, Any] = field(default_factory=dict)


def parse_args(argv: list[str]) -> ServerArgs:
    """`key=value` arguments (values parsed as YAML, like Hydra overrides) -> ServerArgs; CliError if bad."""
    known = ("reward", "port", "host", "max_request_mb")
    values: dict[str, Any] = {}
    options: dict[str, Any] = {}
    for arg in argv:
        key, sep, raw = arg.partition("=")
        if not sep or not key:
            raise CliError(f"argument {arg!r} is not key=value")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError as error:
            raise CliError(f"the value of {key} is not valid YAML: {error}") from None
        if key.startswith("options."):
            name = key.removeprefix("options.")
            if not name or "." in name:
                raise CliError(f"{key!r}: give reward options as options.<key>=<value> (one level)")
            target, name = options, name
        elif key in known:
            target, name = values, key
        else:
            raise CliError(f"unknown argument {key!r}; accepted: {', '.join(known)}, options.<key>")
        if name in target:
            raise CliError(f"{key} is given twice")
        target[name] = value
    for required in ("reward", "port"):
        if required not in values:
            raise CliError(f"{required}=... is required")
    reward, port, host = values["reward"], values["port"], values.get("host", "127.0.0.1")
    if not isinstance(reward, str) or not reward:
        raise CliError(f"reward must be a registered reward name, got {reward!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise CliError(f"port must be an integer in [0, 65535] (0 = any free port), got {port!r}")
    if not isinstance(host, str) or not host:
        raise CliError(f"host must be an address such as 127.0.0.1 or 0.0.0.0, got {host!r}")
    max_mb = values.get("max_request_mb", ServerArgs.max_request_mb)
    if isinstance(max_mb, bool) or not isinstance(max_mb, (int, float)) or not 0 < max_mb < math.inf:
        raise CliError(f"max_request_mb must be a positive number, got {max_mb!r}")
    return ServerArgs(reward=reward, port=port, host=host, max_request_mb=float(max_mb), options=options)


def main(argv: list[str] | None = None) -> int:
    """Run the server until interrupted (Ctrl-C or SIGTERM). Returns the exit status (2 for a usage error)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help", "help") for arg in argv):
        print(USAGE + "\n\n" + (__doc__ or ""))
        return 0
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    try:
        args = parse_args(argv)
        # ValueError is the registry's (and the rewards' own) way to reject a name or an option.
        reward = build_reward(args.reward, **args.options)
    except ValueError as error:
        print(f"error: {error}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        server = RewardServer(
            reward, args.host, args.port, max_request_bytes=int(args.max_request_mb * 2**20)
        )
    except OSError as error:
        print(f"error: cannot listen on {args.host}:{args.port}: {error}", file=sys.stderr)
        return 2

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    logger.info(
        "serving reward %r at %s (GET /health, POST /score); stop with Ctrl-C", server.reward_name, server.url
    )
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        logger.info("stopping")
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

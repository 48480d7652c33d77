"""Remote rewards: the `remote` client reward and the JSON wire format it shares with the reward server.

Heavy scorers (VLM judges, GenEval-style detectors, PickScore on another GPU) can run in their own
process or on another machine: `python -m glm_training.rewards.server reward=<name> port=<port>` hosts
any registered reward over HTTP (see `glm_training/rewards/server.py`), and the `remote` reward sends
each batch there. The wire format (version 1, documented in docs/reward_server.md) is JSON only, never
pickle, so neither side executes anything the other sends:

    POST /score  {"version": 1, "images": [<base64 PNG>...], "prompts": [str...], "metadata": [{...}...]}
           200   {"version": 1, "scores": [float...]}      one finite score per image, in order
         4xx/5xx {"error": "<what went wrong and the fix>"}
    GET /health  {"status": "ok", "version": 1, "reward": "<name>", "max_request_bytes": int}

Images travel as PNG (lossless: the server scores exactly the pixels the trainer decoded). Responses carry
no per-part scores: the `Reward` interface returns one tensor, and a client ignores keys it does not know,
so a later server may add some without breaking version-1 clients.

Retries follow the usual rule for idempotent requests: connection errors, timeouts and 5xx answers are
retried with exponential back-off (`backoff_s * 2**k` before retry k+1); 4xx answers (a request the
server will reject again) and malformed 200 answers are not.
"""

from __future__ import annotations

import base64
import binascii
import http.client
import io
import json
import logging
import math
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

import torch
from PIL import Image

from glm_training.errors import UserError
from glm_training.rewards.registry import Reward, register_reward

logger = logging.getLogger(__name__)

WIRE_VERSION = 1
# A batch of 64 1024x1024 RGB PNGs of generated images is ~130 MB once base64-encoded.
DEFAULT_MAX_REQUEST_BYTES = 256 * 1024 * 1024
# Scores of 10^5 images are ~2.5 MB of JSON; anything far larger is not a score answer.
MAX_RESPONSE_BYTES = 16 * 1024 * 1024
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
MAX_REQUEST_PIXELS_FACTOR = 4  # a request may hold this many maximal images' worth of pixels in all
# Pillow modes that PNG stores as they are; any other mode is converted before encoding.
_PNG_MODES = frozenset({"1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"})
SERVER_HINT = (
    "is `python -m glm_training.rewards.server reward=<name> port=<port> host=0.0.0.0` running there, "
    "and is that address reachable from this machine?"
)


class WireFormatError(ValueError):
    """A request or answer that does not follow the wire format; the message names the field."""


class RemoteRewardError(UserError, RuntimeError):
    """The reward server could not be reached or gave an unusable answer; the message says what to check."""


# --------------------------------------------------------------------------- wire format


def encode_image(image: Image.Image) -> str:
    """`image` as base64 PNG (lossless). Modes PNG cannot store become RGB, or RGBA if they have alpha."""
    if image.mode not in _PNG_MODES:
        image = image.convert("RGBA" if "A" in image.mode else "RGB")
    buffer = io.BytesIO()
    # Level 1: the PNG stays lossless, and encoding a 1024x1024 image takes a few ms instead of ~50.
    image.save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def decode_image(data: Any, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """The image of a base64 PNG string; WireFormatError if it is not one or exceeds `max_pixels`."""
    if not isinstance(data, str):
        raise WireFormatError(f"must be a base64 PNG string, got {type(data).__name__}")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as error:
        raise WireFormatError(f"is not valid base64 ({error})") from None
    if not raw.startswith(b"\x89PNG\r\n\x1a\n"):
        raise WireFormatError("is not a PNG (wrong signature); encode images with PNG")
    try:
        image = Image.open(io.BytesIO(raw))
        width, height = image.size
        if width * height > max_pixels:
            raise WireFormatError(
                f"has {width}x{height} pixels, more than the server's limit of {max_pixels}"
            )
        image.load()
    except WireFormatError:
        raise
    except Exception as error:  # noqa: BLE001  (untrusted bytes: any decoder failure is a bad request)
        raise WireFormatError(f"is not a readable PNG ({type(error).__name__}: {error})") from None
    return image


def _json_dumps(payload: Any) -> bytes:
    # allow_nan=False: NaN/Infinity are not JSON, and other languages' parsers reject them.
    return json.dumps(payload, allow_nan=False, separators=(",", ":")).encode("utf-8")


def _reject_constant(name: str) -> float:
    raise WireFormatError(f"contains {name}, which is not JSON (scores must be finite numbers)")


def _json_loads(body: bytes) -> Any:
    return json.loads(body.decode("utf-8"), parse_constant=_reject_constant)


def encode_request(images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> bytes:
    """The JSON body of `POST /score` for one batch; ValueError if the batch cannot be sent as JSON."""
    if not len(images) == len(prompts) == len(metadata):
        raise ValueError(
            f"got {len(images)} images, {len(prompts)} prompts and {len(metadata)} metadata entries; "
            "give one prompt and one metadata dict per image"
        )
    for index, (prompt, meta) in enumerate(zip(prompts, metadata)):
        if not isinstance(prompt, str):
            raise ValueError(f"prompt {index} is a {type(prompt).__name__}, expected a string")
        if not isinstance(meta, dict):
            raise ValueError(f"metadata {index} is a {type(meta).__name__}, expected a dict")
        try:
            _json_dumps(meta)
        except (TypeError, ValueError) as error:
            raise ValueError(
                f"metadata {index} of prompt {prompt!r} cannot be sent to a remote reward as JSON ({error}); "
                "keep prompt-file metadata to strings, finite numbers, booleans, lists and dicts"
            ) from None
    payload = {
        "version": WIRE_VERSION,
        "images": [encode_image(image) for image in images],
        "prompts": list(prompts),
        "metadata": list(metadata),
    }
    return _json_dumps(payload)


def parse_request(
    body: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
) -> tuple[list[Image.Image], list[str], list[dict]]:
    """Validate a `POST /score` body; returns (images, prompts, metadata) or raises WireFormatError."""
    try:
        payload = _json_loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireFormatError(f"the body is not UTF-8 JSON ({error})") from None
    if not isinstance(payload, dict):
        raise WireFormatError(f"the body must be a JSON object, got {type(payload).__name__}")
    expected = {"version", "images", "prompts", "metadata"}
    missing, unknown = sorted(expected - set(payload)), sorted(set(payload) - expected)
    if missing or unknown:
        raise WireFormatError(
            f"the body must have exactly the fields {sorted(expected)}; missing {missing}, unknown {unknown}"
        )
    if payload["version"] != WIRE_VERSION or isinstance(payload["version"], bool):
        raise WireFormatError(
            f"wire format version {payload['version']!r} is not supported; this server speaks {WIRE_VERSION}"
        )
    for field in ("images", "prompts", "metadata"):
        if not isinstance(payload[field], list):
            raise WireFormatError(f"`{field}` must be a list, got {type(payload[field]).__name__}")
    images, prompts, metadata = payload["images"], payload["prompts"], payload["metadata"]
    if not len(images) == len(prompts) == len(metadata):
        raise WireFormatError(
            f"got {len(images)} images, {len(prompts)} prompts and {len(metadata)} metadata entries; "
            "the three lists must have the same length"
        )
    for index, (prompt, meta) in enumerate(zip(prompts, metadata)):
        if not isinstance(prompt, str):
            raise WireFormatError(f"prompts[{index}] must be a string, got {type(prompt).__name__}")
        if not isinstance(meta, dict):
            raise WireFormatError(f"metadata[{index}] must be a JSON object, got {type(meta).__name__}")
    decoded, total_pixels = [], 0
    for index, data in enumerate(images):
        try:
            # Per image, and for the whole request: a small body of well-compressed PNGs could otherwise
            # decode to far more memory than the server has.
            image = decode_image(data, min(max_pixels, MAX_REQUEST_PIXELS_FACTOR * max_pixels - total_pixels))
        except WireFormatError as error:
            limit = MAX_REQUEST_PIXELS_FACTOR * max_pixels
            raise WireFormatError(
                f"images[{index}] {error} (a request may hold {limit} pixels in all: send smaller batches)"
            ) from None
        total_pixels += image.width * image.height
        decoded.append(image)
    return decoded, prompts, metadata


def encode_scores(scores_n: torch.Tensor) -> bytes:
    """The JSON body of a `POST /score` answer for the float scores `scores_n` [N]."""
    assert scores_n.dim() == 1, f"scores must be 1-D, got shape {tuple(scores_n.shape)}"
    return _json_dumps({"version": WIRE_VERSION, "scores": scores_n.tolist()})


def parse_scores(body: bytes, num_images: int) -> list[float]:
    """The scores of a `POST /score` answer for `num_images` images; WireFormatError naming the problem."""
    try:
        payload = _json_loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireFormatError(f"the answer is not UTF-8 JSON ({error})") from None
    if not isinstance(payload, dict):
        raise WireFormatError(f"the answer must be a JSON object, got {type(payload).__name__}")
    if payload.get("version") != WIRE_VERSION:
        raise WireFormatError(
            f"the answer has wire format version {payload.get('version')!r}; "
            f"this client speaks {WIRE_VERSION}"
        )
    if "scores" not in payload:
        raise WireFormatError(f"the answer has no `scores` field (fields: {sorted(payload)})")
    scores = payload["scores"]
    if not isinstance(scores, list):
        raise WireFormatError(f"`scores` must be a list, got {type(scores).__name__}")
    if len(scores) != num_images:
        raise WireFormatError(f"`scores` has {len(scores)} entries for {num_images} images")
    for index, score in enumerate(scores):
        # bool is an int subclass, and true/false are not scores.
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            raise WireFormatError(f"scores[{index}] is {score!r}, not a finite number")
    return [float(score) for score in scores]


def parse_health(body: bytes) -> dict[str, Any]:
    """The validated `GET /health` answer: `status` "ok", a `reward` name, optionally `max_request_bytes`."""
    try:
        payload = _json_loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireFormatError(f"the health answer is not UTF-8 JSON ({error})") from None
    if not isinstance(payload, dict) or payload.get("status") != "ok":
        raise WireFormatError('the health answer must be a JSON object with "status": "ok"')
    if not isinstance(payload.get("reward"), str):
        raise WireFormatError("the health answer has no `reward` name string")
    limit = payload.get("max_request_bytes")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise WireFormatError(f"the health answer's `max_request_bytes` is {limit!r}, not a positive integer")
    return payload


def _excerpt(body: bytes, limit: int = 200) -> str:
    text = body[:limit].decode("utf-8", errors="replace")
    return repr(text) + (" ..." if len(body) > limit else "")


def _server_error(body: bytes) -> str:
    """The `error` message of an error answer, else an excerpt of its body."""
    try:
        payload = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        payload = None
    if isinstance(payload, dict) and isinstance(payload.get("error"), str):
        return payload["error"][:1000]
    return f"body {_excerpt(body)}"


# --------------------------------------------------------------------------- client


def _read_limited(response: Any, limit: int, url: str) -> bytes:
    body = response.read(limit + 1)
    if len(body) > limit:
        raise RemoteRewardError(
            f"the answer of {url} is larger than {limit} bytes; is that URL a reward server? ({SERVER_HINT})"
        )
    return body


def _check_number(
    name: str, value: Any, minimum: float, *, integer: bool = False, strict: bool = False
) -> None:
    kinds = (int,) if integer else (int, float)
    ok = not isinstance(value, bool) and isinstance(value, kinds) and math.isfinite(value)
    ok = ok and (value > minimum if strict else value >= minimum)
    if not ok:
        kind = "an integer" if integer else "a number"
        raise ValueError(
            f"remote reward option {name} must be {kind} {'>' if strict else '>='} {minimum}, got {value!r}"
        )


def _parse_health_or_raise(body: bytes, url: str) -> dict[str, Any]:
    """`parse_health`, with a RemoteRewardError naming `url` and the likely cause."""
    try:
        return parse_health(body)
    except WireFormatError as error:
        raise RemoteRewardError(
            f"{url} answered, but not as a reward server: {error}; body {_excerpt(body)}. {SERVER_HINT}"
        ) from None


@register_reward("remote")
class RemoteReward(Reward):
    """Scores batches with a reward hosted by `python -m glm_training.rewards.server` at `url`.

    Args:
        url: the server's base URL, e.g. "http://gpu-node-3:8000" (http or https; a path prefix is kept
            for servers behind a reverse proxy). Environment HTTP proxies are not used: reward servers sit
            on the cluster network, where a forward proxy would only break or slow the requests.
        timeout_s: socket timeout of each attempt (connecting, and each wait for data).
        max_retries: further attempts after a connection error, timeout or 5xx answer.
        backoff_s: wait before the first retry; doubles before each further one.
        batch_size: images per request; 0 sends each call's batch as one request.
        expected_reward: if set, the start-up health check fails unless the server hosts this reward name.
    """

    retryable = True  # a server restarting mid-run: `reward.max_retries` retries the whole batch

    def __init__(
        self,
        url: str,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        batch_size: int = 0,
        expected_reward: str | None = None,
    ) -> None:
        self.base_url = _check_url(url)
        _check_number("timeout_s", timeout_s, 0, strict=True)
        _check_number("max_retries", max_retries, 0, integer=True)
        _check_number("backoff_s", backoff_s, 0)
        _check_number("batch_size", batch_size, 0, integer=True)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.batch_size = int(batch_size)
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        # Start-up health check: a wrong URL or a server that is not running fails here, before any model
        # is loaded, within the same timeout/retry budget as scoring.
        health = _parse_health_or_raise(self._request("GET", "/health", None), self.base_url + "/health")
        self.remote_reward: str = health["reward"]
        self.max_request_bytes: int | None = health.get("max_request_bytes")
        if expected_reward is not None and expected_reward != self.remote_reward:
            raise RemoteRewardError(
                f"the reward server at {self.base_url} hosts reward {self.remote_reward!r}, but "
                f"expected_reward is {expected_reward!r}; fix the url or expected_reward"
            )
        logger.info("remote reward: %s hosts reward %r", self.base_url, self.remote_reward)

    def check_prompts(self, prompts: list[str], metadata: list[dict]) -> None:
        """At start-up: every prompt's metadata must travel as JSON (else the first batch would fail)."""
        for prompt, meta in zip(prompts, metadata):
            try:
                _json_dumps(meta)
            except (TypeError, ValueError) as error:
                raise ValueError(
                    f"prompt {prompt!r}: its metadata cannot be sent to the remote reward as JSON ({error}); "
                    "keep prompt-file metadata to strings, finite numbers, booleans, lists and dicts"
                ) from None

    def __call__(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> torch.Tensor:
        if not len(images) == len(prompts) == len(metadata):
            raise ValueError(
                f"remote reward got {len(images)} images, {len(prompts)} prompts, {len(metadata)} metadata"
            )
        step = self.batch_size or max(len(images), 1)
        scores: list[float] = []
        for start in range(0, len(images), step):
            stop = start + step
            scores.extend(self._score(images[start:stop], prompts[start:stop], metadata[start:stop]))
        return torch.tensor(scores, dtype=torch.float32).reshape(len(images))

    def _score(self, images: list[Image.Image], prompts: list[str], metadata: list[dict]) -> list[float]:
        body = encode_request(images, prompts, metadata)
        url = self.base_url + "/score"
        if self.max_request_bytes is not None and len(body) > self.max_request_bytes:
            fix = "start the server with a larger max_request_mb"
            if len(images) > 1:
                fix = f"set the remote reward's batch_size (now {self.batch_size}) lower, or {fix}"
            raise RemoteRewardError(
                f"a request of {len(images)} images is {len(body)} bytes, more than the "
                f"{self.max_request_bytes} the server at {url} accepts; {fix}"
            )
        answer = self._request("POST", "/score", body)
        try:
            return parse_scores(answer, len(images))
        except WireFormatError as error:
            raise RemoteRewardError(
                f"malformed answer from {url}: {error}; body {_excerpt(answer)}. Is that URL a reward server "
                "of the same glm-training version?"
            ) from None

    def _request(self, method: str, path: str, body: bytes | None) -> bytes:
        """The body of a 200 answer, retrying transient failures; RemoteRewardError otherwise."""
        url = self.base_url + path
        num_attempts = 1 + self.max_retries
        started = time.monotonic()
        cause, timed_out = "", False
        for attempt in range(1, num_attempts + 1):
            timed_out = False
            try:
                status, answer = self._send_once(method, url, body)
            except TimeoutError:
                timed_out = True
                cause = f"timed out after {self.timeout_s:g} s (timeout_s) waiting for the server"
                if method == "POST":
                    # The server took the batch and may still be scoring it: sending it again would only
                    # queue the same work behind it (the server scores one batch at a time).
                    raise RemoteRewardError(
                        f"remote reward {method} {url}: {cause} (not retried: the server may still be "
                        "scoring the batch). A slow scorer needs a larger timeout_s, or a smaller batch_size."
                    ) from None
            except urllib.error.URLError as error:
                reason = error.reason
                timed_out = isinstance(reason, TimeoutError)
                if timed_out:
                    cause = f"timed out after {self.timeout_s:g} s (timeout_s) connecting"
                else:
                    cause = f"connection failed: {reason}"
            except (OSError, http.client.HTTPException) as error:
                cause = f"connection failed: {type(error).__name__}: {error}"
            else:
                if status == 200:
                    return answer
                if 400 <= status < 500:
                    hint = (
                        "; set the remote reward's batch_size lower or start the server with a larger "
                        "max_request_mb"
                        if status == 413
                        else ""
                    )
                    raise RemoteRewardError(
                        f"the reward server at {url} rejected the request with HTTP {status} "
                        f"(not retried): {_server_error(answer)}{hint}"
                    )
                cause = f"HTTP {status}: {_server_error(answer)}"
            if attempt < num_attempts:
                delay = self.backoff_s * 2 ** (attempt - 1)
                logger.warning(
                    "remote reward %s %s: attempt %d/%d failed (%s); retrying in %.2f s",
                    method, url, attempt, num_attempts, cause, delay,
                )  # fmt: skip
                time.sleep(delay)
        elapsed = time.monotonic() - started
        raise RemoteRewardError(
            f"remote reward {method} {url} failed after {num_attempts} attempt(s) (1 + max_retries="
            f"{self.max_retries}) in {elapsed:.1f} s; last error: {cause}. Check: {SERVER_HINT}"
            + (" A slow scorer needs a larger timeout_s, or a smaller batch_size." if timed_out else "")
        )

    def _send_once(self, method: str, url: str, body: bytes | None) -> tuple[int, bytes]:
        headers = {"Accept": "application/json", "User-Agent": f"glm-training-remote-reward/{WIRE_VERSION}"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        request = urllib.request.Request(url, data=body, method=method, headers=headers)
        try:
            with self._opener.open(request, timeout=self.timeout_s) as response:
                return response.status, _read_limited(response, MAX_RESPONSE_BYTES, url)
        except urllib.error.HTTPError as error:
            with error:
                return error.code, _read_limited(error, MAX_RESPONSE_BYTES, url)


def _check_url(url: Any) -> str:
    if not isinstance(url, str) or not url:
        raise ValueError(
            "the remote reward needs a url option, e.g. +reward.options.remote.url=http://gpu-node-3:8000"
        )
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"remote reward url {url!r} must look like http://host:port (http or https)")
    if parts.query or parts.fragment:
        raise ValueError(
            f"remote reward url {url!r} must not have a query or fragment; give http://host:port"
        )
    base = url.rstrip("/")
    if base.endswith(("/score", "/health")):
        raise ValueError(
            f"remote reward url {url!r} names an endpoint; give the server's base URL "
            f"({base.rsplit('/', 1)[0]}), the client adds /score and /health"
        )
    return base

"""Remote rewards over loopback: client + server equal the local reward, and every failure is a clear error.

Servers run in background threads on port 0 (the real `RewardServer`, or a tiny canned `http.server`
handler for answers the real server never gives); one test starts `python -m glm_training.rewards.server`
as a subprocess. Every network wait has a timeout, so no test can hang.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import queue
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from conftest import PYTHON, REPO
from PIL import Image

from glm_training.rewards import Reward, build_reward
from glm_training.rewards.remote import (
    RemoteReward,
    RemoteRewardError,
    WireFormatError,
    decode_image,
    encode_image,
    encode_request,
)
from glm_training.rewards.server import CliError, RewardServer, main, parse_args, serve_in_thread

FAST = {"timeout_s": 5.0, "max_retries": 0, "backoff_s": 0.0}  # nothing in these tests should take 5 s


def noise_image(seed: int, size: tuple[int, int] = (32, 32), mode: str = "RGB") -> Image.Image:
    channels = {"L": 1, "RGB": 3, "RGBA": 4}[mode]
    shape = (size[1], size[0]) if channels == 1 else (size[1], size[0], channels)
    pixels = np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)
    return Image.fromarray(pixels, mode=mode)


def batch(num: int = 3) -> tuple[list[Image.Image], list[str], list[dict]]:
    images = [noise_image(0, (32, 32)), Image.new("RGB", (48, 16), (200, 30, 90)), noise_image(2, (16, 40))]
    images = (images * num)[:num]
    return images, [f"prompt {i}" for i in range(num)], [{"index": i, "text": "hi"} for i in range(num)]


def free_port() -> int:
    """A port with nothing listening (bound then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post_raw(url: str, body: bytes, timeout: float = 5.0) -> tuple[int, dict]:
    """POST `body` as is; returns (status, parsed JSON answer)."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with opener.open(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        with error:
            return error.code, json.loads(error.read())


class RecordingReward(Reward):
    """Delegates to a registry reward and records the size of each batch it scores."""

    def __init__(self, name: str) -> None:
        self.inner = build_reward(name)
        self.name = name
        self.batch_sizes: list[int] = []

    def __call__(self, images, prompts, metadata):
        self.batch_sizes.append(len(images))
        return self.inner(images, prompts, metadata)


class FailingReward(Reward):
    """Raises `error` on every call and counts the calls."""

    name = "failing"

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.num_calls = 0

    def __call__(self, images, prompts, metadata):
        self.num_calls += 1
        raise self.error


# --------------------------------------------------------------------------- canned server


class CannedServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, answers: list[tuple[int, bytes, float]]) -> None:
        self.answers = answers  # (status, body, seconds to wait first) per POST; the last one repeats
        self.num_posts = 0
        self.posted = threading.Event()  # set once a POST has been counted
        self.release = threading.Event()  # set at teardown so sleeping handlers finish at once
        super().__init__(("127.0.0.1", 0), CannedHandler)


class CannedHandler(BaseHTTPRequestHandler):
    """Answers /health like a reward server and POST /score with the server's canned answers."""

    server: CannedServer

    def do_GET(self) -> None:  # noqa: N802
        self._send(200, json.dumps({"status": "ok", "version": 1, "reward": "canned"}).encode())

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        index = self.server.num_posts
        self.server.num_posts += 1
        self.server.posted.set()
        status, body, delay = self.server.answers[min(index, len(self.server.answers) - 1)]
        if delay:
            self.server.release.wait(delay)
        with contextlib.suppress(OSError):  # the client may have given up already
            self._send(status, body)

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format, *args) -> None:  # noqa: A002
        pass


@contextlib.contextmanager
def canned_server(*answers: tuple[int, bytes, float]) -> Iterator[CannedServer]:
    server = CannedServer(list(answers))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def url_of(server: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{server.server_address[1]}"


# --------------------------------------------------------------------------- wire format


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L"])
def test_png_round_trip_is_lossless(mode):
    image = noise_image(7, (23, 17), mode)
    decoded = decode_image(encode_image(image))
    assert decoded.mode == mode and decoded.size == (23, 17)
    np.testing.assert_array_equal(np.asarray(decoded), np.asarray(image))


def test_decode_image_rejects_bad_input():
    buffer = io.BytesIO()
    noise_image(0).save(buffer, format="JPEG")
    with pytest.raises(WireFormatError, match="not a PNG"):
        decode_image(base64.b64encode(buffer.getvalue()).decode())
    with pytest.raises(WireFormatError, match="not valid base64"):
        decode_image("not base64!")
    with pytest.raises(WireFormatError, match="32x32 pixels, more than .* 1000"):
        decode_image(encode_image(noise_image(0)), max_pixels=1000)
    truncated = base64.b64encode(base64.b64decode(encode_image(noise_image(0)))[:100]).decode()
    with pytest.raises(WireFormatError, match="not a readable PNG"):
        decode_image(truncated)


def test_request_with_unserialisable_metadata_names_the_entry():
    with pytest.raises(ValueError, match="metadata 1 of prompt 'b'.*JSON"):
        encode_request([noise_image(0)] * 2, ["a", "b"], [{}, {"when": object()}])
    with pytest.raises(ValueError, match="metadata 0 of prompt 'a'.*JSON"):
        encode_request([noise_image(0)], ["a"], [{"score": float("nan")}])


def test_a_request_is_capped_in_total_pixels():
    from glm_training.rewards.remote import MAX_REQUEST_PIXELS_FACTOR, encode_request, parse_request

    # Images of 10x10 = 100 pixels with a 100-pixel limit per image: 4 fit in a request, a 5th does not.
    images = [noise_image(i, (10, 10)) for i in range(MAX_REQUEST_PIXELS_FACTOR + 1)]
    fitting = images[:MAX_REQUEST_PIXELS_FACTOR]
    assert len(parse_request(encode_request(fitting, ["p"] * 4, [{}] * 4), max_pixels=100)[0]) == 4
    with pytest.raises(WireFormatError, match=r"images\[4\].*400 pixels in all"):
        parse_request(encode_request(images, ["p"] * 5, [{}] * 5), max_pixels=100)


def test_metadata_that_cannot_travel_fails_at_start_up():
    with serve_in_thread(build_reward("jpeg_compressibility")) as server:
        client = RemoteReward(server.url, timeout_s=5)
        client.check_prompts(["a", "b"], [{}, {"text": "ok", "n": 1}])
        with pytest.raises(ValueError, match="prompt 'b': its metadata cannot be sent"):
            client.check_prompts(["a", "b"], [{}, {"score": float("inf")}])


# --------------------------------------------------------------------------- client + real server


@pytest.mark.parametrize("name", ["jpeg_compressibility", "jpeg_incompressibility"])
def test_remote_scores_equal_local_scores(name):
    images, prompts, metadata = batch(5)
    local_n = build_reward(name)(images, prompts, metadata)
    hosted = RecordingReward(name)
    with serve_in_thread(hosted) as server:
        client = RemoteReward(server.url, **FAST)
        remote_n = client(images, prompts, metadata)
        split_n = RemoteReward(server.url, batch_size=2, **FAST)(images, prompts, metadata)
        empty_n = client([], [], [])
    assert client.remote_reward == name
    assert remote_n.dtype == torch.float32 and remote_n.shape == (5,)
    # float32 -> JSON -> float32 is exact: repr() of a float round-trips, and the float holds a float32.
    torch.testing.assert_close(remote_n, local_n, rtol=0, atol=0)
    torch.testing.assert_close(split_n, local_n, rtol=0, atol=0)
    assert hosted.batch_sizes == [5, 2, 2, 1]  # one request, then batch_size=2: ceil(5 / 2) = 3 requests
    assert empty_n.shape == (0,)


def test_client_options_and_expected_reward_are_checked():
    with pytest.raises(ValueError, match="needs a url option"):
        RemoteReward("")
    with pytest.raises(ValueError, match="must look like http://host:port"):
        RemoteReward("localhost:8000")
    with pytest.raises(ValueError, match=r"names an endpoint.*\(http://h:1\)"):
        RemoteReward("http://h:1/score")
    with pytest.raises(ValueError, match="timeout_s must be a number > 0"):
        RemoteReward("http://h:1", timeout_s=0)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 0"):
        RemoteReward("http://h:1", batch_size=-1)
    with serve_in_thread(build_reward("jpeg_compressibility")) as server:
        with pytest.raises(RemoteRewardError, match="hosts reward 'jpeg_compressibility'.*'ocr'"):
            RemoteReward(server.url, expected_reward="ocr", **FAST)


def test_request_over_the_server_limit_fails_before_sending():
    hosted = RecordingReward("jpeg_compressibility")
    # A 32x32 RGB noise PNG holds 3072 incompressible bytes (~4.3 kB in base64): 1 fits in 6000, 3 do not.
    with serve_in_thread(hosted, max_request_bytes=6000) as server:
        client = RemoteReward(server.url, **FAST)
        images, prompts, metadata = batch(3)
        with pytest.raises(RemoteRewardError, match=r"more than the 6000 .*batch_size \(now 0\) lower"):
            client(images, prompts, metadata)
        scores = RemoteReward(server.url, batch_size=1, **FAST)(images, prompts, metadata)
    assert scores.shape == (3,) and hosted.batch_sizes == [1, 1, 1]


# --------------------------------------------------------------------------- failures


def test_stopped_server_fails_within_the_retry_budget():
    url = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(RemoteRewardError) as info:
        RemoteReward(url, timeout_s=0.5, max_retries=2, backoff_s=0.05)
    elapsed = time.monotonic() - started
    # Back-off 0.05 + 0.1 s between 3 refused connections (each immediate on loopback).
    assert 0.15 <= elapsed < 3.0
    message = str(info.value)
    assert f"{url}/health" in message and "3 attempt(s)" in message and "connection failed" in message
    assert "python -m glm_training.rewards.server" in message


def test_server_stopped_after_start_up_fails_on_score():
    with serve_in_thread(build_reward("jpeg_compressibility")) as server:
        client = RemoteReward(server.url, timeout_s=0.5, max_retries=1, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=r"POST .*/score failed after 2 attempt\(s\)"):
        client(*batch(1))


def test_slow_server_times_out_with_a_clear_error():
    # The server holds its answer until the test ends (the 60 s only bound a broken client): only the
    # client's own 0.3 s timeout can end the call.
    with canned_server((200, b'{"version": 1, "scores": [1.0]}', 60.0)) as server:
        client = RemoteReward(url_of(server), timeout_s=0.3, max_retries=1, backoff_s=0.05)
        with pytest.raises(RemoteRewardError) as info:
            client(*batch(1))
        # The client gave up without an answer, so the handler may not have counted the POST yet.
        assert server.posted.wait(timeout=60)
        num_posts = server.num_posts
    # A scoring request that times out is not sent again: the server may still be working on it.
    assert num_posts == 1
    message = str(info.value)
    assert "timed out after 0.3 s (timeout_s)" in message and "larger timeout_s" in message
    assert "not retried" in message


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"<html>Bad Gateway</html>", r"not UTF-8 JSON.*<html>Bad Gateway"),
        (b'{"version": 1, "scores": [1.0]}', r"`scores` has 1 entries for 2 images"),
        (b'{"version": 1, "scores": [NaN, 1.0]}', r"contains NaN"),
        (b'{"version": 1, "scores": [1e999, 1.0]}', r"scores\[0\] is inf, not a finite number"),
        (b'{"version": 1, "scores": [true, 1.0]}', r"scores\[0\] is True, not a finite number"),
        (b'{"version": 1, "score": [1.0, 2.0]}', r"no `scores` field \(fields: \['score', 'version'\]\)"),
        (b'{"scores": [1.0, 2.0]}', r"wire format version None"),
    ],
)
def test_malformed_answer_is_a_clear_error_and_not_retried(body, match):
    with canned_server((200, body, 0.0)) as server:
        client = RemoteReward(url_of(server), timeout_s=5.0, max_retries=3, backoff_s=0.0)
        with pytest.raises(RemoteRewardError, match=match) as info:
            client(*batch(2))
        num_posts = server.num_posts
    assert f"malformed answer from {url_of(server)}/score" in str(info.value)
    assert num_posts == 1


def test_4xx_is_not_retried_and_5xx_is():
    error = json.dumps({"error": "images[0] is not a PNG"}).encode()
    with canned_server((400, error, 0.0)) as server:
        with pytest.raises(RemoteRewardError, match=r"HTTP 400 \(not retried\): images\[0\] is not a PNG"):
            RemoteReward(url_of(server), timeout_s=5.0, max_retries=3, backoff_s=0.0)(*batch(1))
        assert server.num_posts == 1

    with canned_server((503, b"overloaded", 0.0)) as server:
        with pytest.raises(RemoteRewardError, match=r"4 attempt\(s\).*HTTP 503: body 'overloaded'"):
            RemoteReward(url_of(server), timeout_s=5.0, max_retries=3, backoff_s=0.0)(*batch(1))
        assert server.num_posts == 4  # 1 + max_retries

    recovered = (200, b'{"version": 1, "scores": [0.5]}', 0.0)
    with canned_server((500, b"{}", 0.0), recovered) as server:
        scores = RemoteReward(url_of(server), timeout_s=5.0, max_retries=1, backoff_s=0.0)(*batch(1))
        assert server.num_posts == 2
    assert scores.tolist() == [0.5]


def test_reward_errors_become_422_or_500():
    rejecting = FailingReward(ValueError("prompt 0 has no quoted text"))
    with serve_in_thread(rejecting) as server:
        client = RemoteReward(server.url, timeout_s=5.0, max_retries=2, backoff_s=0.0)
        with pytest.raises(RemoteRewardError, match=r"HTTP 422 \(not retried\).*no quoted text"):
            client(*batch(1))
    assert rejecting.num_calls == 1

    crashing = FailingReward(RuntimeError("CUDA out of memory"))
    with serve_in_thread(crashing) as server:
        client = RemoteReward(server.url, timeout_s=5.0, max_retries=2, backoff_s=0.0)
        with pytest.raises(RemoteRewardError, match=r"3 attempt\(s\).*HTTP 500.*CUDA out of memory"):
            client(*batch(1))
    assert crashing.num_calls == 3


# --------------------------------------------------------------------------- server validation


def _request(**changes) -> bytes:
    payload = json.loads(encode_request(*batch(2)))
    payload.update(changes)
    return json.dumps(payload).encode()


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (b"{not json", "not UTF-8 JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (_request(extra=1), r"unknown \['extra'\]"),
        (_request(version=2), "version 2 is not supported"),
        (_request(images="abc"), "`images` must be a list, got str"),
        (_request(prompts=["only one"]), "2 images, 1 prompts and 2 metadata"),
        (_request(prompts=["a", 3]), r"prompts\[1\] must be a string"),
        (_request(metadata=[{}, "x"]), r"metadata\[1\] must be a JSON object"),
        (_request(images=["aGVsbG8=", "aGVsbG8="]), r"images\[0\] is not a PNG"),
    ],
)
def test_server_rejects_malformed_requests_with_400(body, match):
    hosted = RecordingReward("jpeg_compressibility")
    with serve_in_thread(hosted) as server:
        status, answer = post_raw(server.url + "/score", body)
    assert status == 400 and re.search(match, answer["error"]), answer
    assert hosted.batch_sizes == []


def test_server_limits_and_unknown_endpoints():
    with serve_in_thread(build_reward("jpeg_compressibility"), max_request_bytes=1000) as server:
        # Headers only: the server must answer from Content-Length alone, without reading a body.
        connection = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=5)
        connection.putrequest("POST", "/score")
        connection.putheader("Content-Length", str(10**12))
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 413
        assert "exceeds the server's limit of 1000" in json.loads(response.read())["error"]
        connection.close()

        assert post_raw(server.url + "/nope", b"{}")[0] == 404
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        with pytest.raises(urllib.error.HTTPError) as info:
            opener.open(server.url + "/score", timeout=5)
        assert info.value.code == 405
        info.value.close()
        with opener.open(server.url + "/health", timeout=5) as response:
            health = json.loads(response.read())
    assert health == {
        "status": "ok",
        "version": 1,
        "reward": "jpeg_compressibility",
        "max_request_bytes": 1000,
    }


def test_server_rejects_oversized_images():
    with serve_in_thread(build_reward("jpeg_compressibility"), max_image_pixels=1000) as server:
        status, answer = post_raw(server.url + "/score", encode_request(*batch(1)))
    assert (
        status == 400
        and "images[0] has 32x32 pixels, more than the server's limit of 1000" in answer["error"]
    )


# --------------------------------------------------------------------------- command line


def test_parse_args_values_and_errors():
    args = parse_args(
        ["reward=ocr", "port=0", "options.min_side=64", "options.device=cuda:1", "host=0.0.0.0"]
    )
    assert (args.reward, args.port, args.host) == ("ocr", 0, "0.0.0.0")
    assert args.options == {"min_side": 64, "device": "cuda:1"}
    with pytest.raises(CliError, match="port=... is required"):
        parse_args(["reward=ocr"])
    with pytest.raises(CliError, match="unknown argument 'prot'; accepted: reward, port"):
        parse_args(["reward=ocr", "prot=1"])
    with pytest.raises(CliError, match="port must be an integer"):
        parse_args(["reward=ocr", "port=http"])
    with pytest.raises(CliError, match="is not key=value"):
        parse_args(["reward=ocr", "port=1", "verbose"])


def test_main_reports_unknown_reward_and_options(capsys):
    assert main(["reward=jpeg_compresibility", "port=0"]) == 2
    assert "Did you mean 'jpeg_compressibility'" in capsys.readouterr().err
    assert main(["reward=jpeg_compressibility", "port=0", "options.qualty=9"]) == 2
    assert "unknown option(s) ['qualty']" in capsys.readouterr().err


def test_server_entry_point_as_a_subprocess():
    command = [
        PYTHON, "-m", "glm_training.rewards.server",
        "reward=jpeg_incompressibility", "port=0", "options.quality=80",
    ]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []
    threading.Thread(target=lambda: [lines.put(line) for line in process.stderr], daemon=True).start()

    def wait_for(pattern: str, timeout_s: float) -> re.Match:
        """The first stderr line matching `pattern`; fails if the server exits or `timeout_s` passes first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.1)
            except queue.Empty:
                assert process.poll() is None, f"the server exited with {process.returncode}: {log}"
                continue
            log.append(line)
            if match := re.search(pattern, line):
                return match
        pytest.fail(f"no stderr line matching {pattern!r} within {timeout_s} s: {log}")

    try:
        url = wait_for(r"serving reward 'jpeg_incompressibility' at (http://\S+)", 60).group(1)
        images, prompts, metadata = batch(3)
        remote_n = RemoteReward(url, **FAST)(images, prompts, metadata)
        local_n = build_reward("jpeg_incompressibility", quality=80)(images, prompts, metadata)
        torch.testing.assert_close(remote_n, local_n, rtol=0, atol=0)
        # quality=80 reached the reward: its scores differ from the default quality's.
        assert not torch.equal(local_n, build_reward("jpeg_incompressibility")(images, prompts, metadata))
        wait_for(r"GET /health 200", 10)
        wait_for(r"POST /score 200 \S+s n=3", 10)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
    while not lines.empty():
        log.append(lines.get())
    # SIGTERM is a clean stop, also right after an answer, while its handler thread is still ending.
    assert process.returncode == 0, "".join(log[-20:])


def test_reward_server_url_reports_the_bound_port():
    server = RewardServer(build_reward("jpeg_compressibility"), "127.0.0.1", 0)
    try:
        assert server.url == f"http://127.0.0.1:{server.server_address[1]}" and server.server_address[1] > 0
    finally:
        server.server_close()


def test_closing_the_server_waits_for_the_request_being_answered():
    # A process that exits while a handler thread still answers can abort in a library's teardown: closing
    # the server (what its SIGTERM does) waits for the answer in flight, which still reaches the client.
    entered, release = threading.Event(), threading.Event()

    class HeldReward(Reward):
        name = "held"

        def __call__(self, images, prompts, metadata):
            entered.set()
            release.wait(30)  # the 30 s only bound a broken test
            return torch.zeros(len(images))

    server = RewardServer(HeldReward(), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    answers: list = []
    client = threading.Thread(target=lambda: answers.append(RemoteReward(server.url, **FAST)(*batch(2))))
    client.start()
    assert entered.wait(10)
    server.shutdown()
    closed = threading.Event()
    threading.Thread(target=lambda: (server.server_close(), closed.set()), daemon=True).start()
    assert not closed.wait(0.5)  # still waiting for the handler thread: the reward has not answered
    release.set()
    assert closed.wait(10)
    client.join(10)
    assert len(answers) == 1 and torch.equal(answers[0], torch.zeros(2))

"""The server under concurrent load, made deterministic with a gate: the shipped captioner wrapped so that each
batch records its size and waits until the test opens the gate. Batching groups what waits, a full queue is 429
with Retry-After, a deadline is 504 and its waiting request never runs, a client that leaves frees its place, and a
batch that fails inside the model is retried request by request, so only the bad one fails."""

import asyncio
import contextlib
import os
import socket
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
import httpx  # noqa: E402
import uvicorn  # noqa: E402

from xattn.serve import Settings, create_app  # noqa: E402
from xattn.tasks.captioning import Captioner  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(REPO, "data", "samples")
IMAGES = sorted(os.path.join(SAMPLES, f) for f in os.listdir(SAMPLES) if f.startswith("scene-"))
POISON = (255, 0, 255)  # an image of this one colour breaks any batch it is in (a stand-in for a model failure)


class GatedCaptioner:
    """The shipped captioner; every batch is recorded and waits for `gate`."""

    def __init__(self, real: Captioner):
        self.real, self.engine, self.tokenizer, self.load = real, real.engine, real.tokenizer, real.load
        self.gate, self.started, self.batches = threading.Event(), threading.Event(), []

    def caption_results(self, pixels, **kwargs):
        self.batches.append(len(pixels))
        self.started.set()
        assert self.gate.wait(60), "the test never opened the gate"
        if any(_poisoned(p) for p in pixels):
            raise RuntimeError("poisoned batch")
        return self.real.caption_results(pixels, **kwargs)


def _bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _poisoned(pixels) -> bool:  # ViT normalisation (x - 0.5) / 0.5 of (255, 0, 255)
    return bool((pixels[0] == 1).all() and (pixels[1] == -1).all() and (pixels[2] == 1).all())


@pytest.fixture(scope="module")
def captioner():
    torch.set_num_threads(1)
    return Captioner()


@pytest.fixture()
def gated(captioner):
    gated = GatedCaptioner(captioner)
    yield gated
    gated.gate.set()


def _app(gated, **settings):  # the micro-batcher (in-flight batching: tests/test_inflight.py)
    return create_app(Settings(inflight=False, **settings), captioner=gated, transcriber=_Off(), speaker=_Off())


class _Off:  # a task the app is given but these tests never call
    pass


def _scenario(app, body):
    """Runs `await body(client)` against the app (its lifespan started), in-process over httpx."""
    async def main():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
            async with httpx.AsyncClient(transport=transport, base_url="http://xattn", timeout=60) as client:
                return await body(client)
    return asyncio.run(main())


def _caption(client, path: str, **fields):
    with open(path, "rb") as f:
        content = f.read()
    return client.post("/v1/caption", files={"file": (os.path.basename(path), content)}, data=fields)


async def _until(condition, what: str, limit: float = 30.0):
    """Waits (yielding to the app) until condition() holds."""
    end = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < end, f"never: {what}"
        await asyncio.sleep(0.005)


async def _first_batch_running(client, gated):
    first = asyncio.ensure_future(_caption(client, IMAGES[0]))
    await asyncio.get_running_loop().run_in_executor(None, gated.started.wait, 30)
    return first


def _expected(captioner, paths, **kwargs):
    out = []
    for path in paths:
        record = captioner.caption_results([captioner.load(path)], **kwargs)[0]
        out.append({"text": record.pop("caption"), **record})
    return out


@pytest.mark.parametrize("batching", [True, False], ids=["batching", "no-batching"])
def test_waiting_requests_share_a_batch_and_get_their_own_results(captioner, gated, batching):
    app = _app(gated, max_batch_size=3, batching=batching)
    pending = app.state.batchers

    async def body(client):
        first = await _first_batch_running(client, gated)
        rest = [asyncio.ensure_future(_caption(client, path)) for path in IMAGES[1:5]]
        beams = asyncio.ensure_future(_caption(client, IMAGES[5], num_beams="2"))  # other options: its own batch
        await _until(lambda: pending["caption"].pending == 5, "five requests waiting")
        gated.gate.set()
        return [await r for r in [first, *rest, beams]]

    answers = _scenario(app, body)
    assert [a.status_code for a in answers] == [200] * 6
    want = _expected(captioner, IMAGES[:5]) + _expected(captioner, IMAGES[5:6], num_beams=2)
    assert [a.json() for a in answers] == want
    assert gated.batches == ([1, 3, 1, 1] if batching else [1] * 6)


def test_a_full_queue_is_429_with_retry_after(gated):
    app = _app(gated, max_queue=2)

    async def body(client):
        first = await _first_batch_running(client, gated)
        waiting = [asyncio.ensure_future(_caption(client, path)) for path in IMAGES[1:3]]
        await _until(lambda: app.state.batchers["caption"].pending == 2, "two requests waiting")
        refused = await _caption(client, IMAGES[3])
        gated.gate.set()
        return refused, [await r for r in [first, *waiting]], await _caption(client, IMAGES[3])

    refused, served, later = _scenario(app, body)
    assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
    assert "--max-queue" in refused.json()["error"]["message"]
    assert [r.status_code for r in served] == [200] * 3 and later.status_code == 200


def test_a_deadline_is_504_and_the_waiting_request_never_runs(gated):
    app = _app(gated, timeout_s=0.5)

    async def body(client):
        first = await _first_batch_running(client, gated)
        late = await _caption(client, IMAGES[1])  # waits behind the gated batch past its deadline
        answers = [late, await first]
        gated.gate.set()
        await _until(lambda: not app.state.batchers["caption"].pending, "the queue empty")
        return answers, await _caption(client, IMAGES[2])

    (late, first), after = _scenario(app, body)
    assert late.status_code == 504 and "--timeout-s" in late.json()["error"]["message"]
    assert first.status_code == 504  # its batch ran on; its answer was too late
    assert after.status_code == 200
    assert gated.batches == [1, 1]  # the first, then `after`: the late request was dropped, never run


def test_a_failing_batch_fails_only_its_bad_request(captioner, gated, tmp_path):
    from PIL import Image

    poison = str(tmp_path / "poison.png")
    Image.new("RGB", (64, 64), POISON).save(poison)
    app = _app(gated)

    async def body(client):
        first = await _first_batch_running(client, gated)
        bad = asyncio.ensure_future(_caption(client, poison))
        good = asyncio.ensure_future(_caption(client, IMAGES[1]))
        await _until(lambda: app.state.batchers["caption"].pending == 2, "two requests waiting")
        gated.gate.set()
        return await first, await bad, await good, await _caption(client, IMAGES[2])

    first, bad, good, after = _scenario(app, body)
    assert bad.status_code == 500 and bad.json()["error"]["message"] == "internal error: RuntimeError: poisoned batch"
    assert first.status_code == good.status_code == after.status_code == 200
    assert good.json() == _expected(captioner, IMAGES[1:2])[0]
    assert gated.batches == [1, 2, 1, 1, 1]  # the pair failed, then each alone


def _free_port_socket():
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def _serving(app):
    """The app on a real uvicorn, on a free loopback port, in a thread: yields its URL."""
    sock = _free_port_socket()
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        _wait(lambda: server.started or not thread.is_alive(), "uvicorn started")
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@pytest.fixture()
def live(gated):
    app = _app(gated)
    with _serving(app) as url:
        yield app, url, int(url.rsplit(":", 1)[1])
        gated.gate.set()


def _wait(condition, what: str, limit: float = 30.0):
    end = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.005)


def test_a_client_that_leaves_frees_its_place(live, gated):
    app, url, port = live
    batcher = app.state.batchers["caption"]
    answers = []
    first = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{url}/v1/caption", files={"file": ("a.png", _bytes(IMAGES[0]))}, timeout=60)))
    first.start()
    assert gated.started.wait(30)
    # a second request, sent whole, then its connection closed before its batch runs
    request = httpx.Request("POST", f"{url}/v1/caption", files={"file": ("b.png", _bytes(IMAGES[1]))})
    raw = (f"POST /v1/caption HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: {request.headers['content-type']}\r\n"
           f"Content-Length: {len(request.read())}\r\n\r\n").encode() + request.read()
    leaving = socket.create_connection(("127.0.0.1", port))
    leaving.sendall(raw)
    _wait(lambda: batcher.pending == 1, "the second request waiting")
    leaving.close()
    _wait(lambda: batcher.pending == 0, "the left request dropped")
    gated.gate.set()
    first.join(60)
    assert answers[0].status_code == 200
    after = httpx.post(f"{url}/v1/caption", files={"file": ("c.png", _bytes(IMAGES[2]))}, timeout=60)
    assert after.status_code == 200
    assert gated.batches == [1, 1]  # the first and `after`: the request whose client left never ran


def test_many_bad_uploads_at_once_then_good_ones(captioner, gated, tmp_path):
    bad = []
    for i, content in enumerate([b"", b"hello", b"\x89PNG\r\n\x1a\n" + b"\0" * 40, os.urandom(5000)]):
        path = tmp_path / f"bad-{i}.png"
        path.write_bytes(content)
        bad.append(str(path))
    app = _app(gated)
    gated.gate.set()

    async def body(client):
        answers = await asyncio.gather(*[_caption(client, p) for p in bad * 5], *[_caption(client, p)
                                                                                  for p in IMAGES[:3]])
        return answers

    answers = _scenario(app, body)
    assert all(a.status_code in (415, 422) for a in answers[:20]), [a.text for a in answers[:20]]
    assert [a.json() for a in answers[20:]] == _expected(captioner, IMAGES[:3])


class EndlessSpeaker:
    """Speaks forever, one second of silence per piece; `closed` is set when the server stops asking for more."""

    voices = ["v"]
    engine = type("Engine", (), {"generation_config": None})()

    def __init__(self):
        self.pieces, self.closed = 0, threading.Event()

    def check_voice(self, voice):
        return voice or "v"

    def stream(self, text, voice, **kwargs):
        import numpy as np

        try:
            while True:
                self.pieces += 1
                yield np.zeros(16000, np.float32)
        finally:
            self.closed.set()


def test_a_listener_that_leaves_stops_the_speech(gated):
    speaker = EndlessSpeaker()
    app = create_app(Settings(inflight=False), captioner=gated, transcriber=_Off(), speaker=speaker)
    with _serving(app) as url:
        with httpx.stream("POST", f"{url}/v1/audio/speech", json={"input": "four"}, timeout=60) as response:
            assert response.status_code == 200
            assert next(response.iter_raw()).startswith(b"RIFF")
        assert speaker.closed.wait(30), "the speech went on after its listener left"
        assert httpx.get(f"{url}/health").json()["queue"]["speech"] == 0

"""`xattn serve` against requests that would cost it more than they should, or pass unnoticed: more decoding rows
than --max-batch-size on any endpoint, a body that arrives slowly, an attention map of a huge image, misspelt or
repeated form fields, do_sample=false against a model that samples, long values echoed back, refusals missing from
/metrics."""

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import soundfile
import torch

pytest.importorskip("fastapi")
from fastapi.testclient import TestClient  # noqa: E402
from PIL import Image  # noqa: E402

from xattn.cli import main  # noqa: E402
from xattn.serve import Settings, create_app  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(REPO, "data", "samples")
IMAGE, AUDIO = "scene-1.png", "digits-0.wav"


@pytest.fixture(scope="module")
def client():
    torch.set_num_threads(1)
    with TestClient(create_app(Settings(max_batch_size=4)), raise_server_exceptions=False) as client:
        yield client


def _sample(name: str, field: str = "file"):
    with open(os.path.join(SAMPLES, name), "rb") as f:
        return {field: (name, f.read())}


def _refused(response, status: int, *needles: str) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert "\n" not in message and len(message) < 400, message
    for needle in needles:
        assert needle in message, message
    return message


# ---- decoding rows ------------------------------------------------------------------------------------------------
def test_more_rows_than_max_batch_size_are_refused_on_every_endpoint(client):
    start = time.monotonic()
    _refused(client.post("/v1/caption", files=_sample(IMAGE), data={"num_beams": "5"}), 422,
             "num_beams: this request needs 5 decoding rows", "at most 4 per request (--max-batch-size)")
    _refused(client.post("/v1/caption", files=_sample(IMAGE), data={"do_sample": "true",
                                                                    "num_return_sequences": "9"}),
             422, "num_return_sequences: this request needs 9 decoding rows")
    _refused(client.post("/v1/audio/transcriptions", files=_sample(AUDIO), data={"num_beams": "50000"}), 422,
             "num_beams: this request needs 50000 decoding rows")
    _refused(client.post("/v1/audio/speech", json={"input": "four", "num_beams": 5, "do_sample": False}), 422,
             "needs 5 decoding rows")
    _refused(client.post("/v1/audio/speech", json={"input": "four", "num_return_sequences": 3}), 422,
             "num_return_sequences: speech streams one audio")
    assert time.monotonic() - start < 60  # refused before any decoding (50000 beams would take minutes)
    ok = client.post("/v1/audio/transcriptions", files=_sample(AUDIO), data={"num_beams": "4"})
    assert ok.status_code == 200 and ok.json()["text"]


# ---- fields -------------------------------------------------------------------------------------------------------
def test_misspelt_and_repeated_form_fields_are_refused(client):
    _refused(client.post("/v1/caption", files=_sample(IMAGE), data={"num_beam": "4"}), 422,
             "'num_beam': not a field of this endpoint", "num_beams")
    _refused(client.post("/v1/audio/transcriptions", files=_sample(AUDIO), data={"response_fromat": "text"}), 422,
             "'response_fromat': not a field")
    two_files = [("file", ("a.png", open(os.path.join(SAMPLES, IMAGE), "rb").read())),
                 ("file", ("b.png", open(os.path.join(SAMPLES, "scene-2.png"), "rb").read()))]
    _refused(client.post("/v1/caption", files=two_files), 422, "'file': sent 2 times")
    _refused(client.post("/v1/caption", files=_sample(IMAGE), data={"num_beams": ["abc", "2"]}), 422,
             "'num_beams': sent 2 times")
    # OpenAI's own fields are declared, so accepted
    ok = client.post("/v1/audio/transcriptions", files=_sample(AUDIO), data={"model": "whisper-1", "language": "en"})
    assert ok.status_code == 200, ok.text


def test_a_file_part_without_a_filename_and_a_speech_body_not_json(client):
    _refused(client.post("/v1/caption", files={"file": (None, b"not a file")}), 422, "file: not a file part",
             "with a filename")
    _refused(client.post("/v1/audio/speech", content=b"input=four", headers={"content-type": "text/plain"}), 422,
             "send a JSON object (Content-Type: application/json)")
    _refused(client.post("/v1/audio/speech", json={"input": "four", "seed": True}), 422, "seed")
    _refused(client.post("/v1/audio/speech", json={"input": "four", "max_new_tokens": "5"}), 422, "max_new_tokens")
    ok = client.post("/v1/audio/speech", json={"input": "four", "temperature": 1, "seed": 2})  # an int for a float
    assert ok.status_code == 200


def test_long_values_are_not_echoed_back_whole(client):
    long = "9" * 100_000
    _refused(client.post("/v1/caption", files=_sample(IMAGE), data={"num_beams": long}), 422, "num_beams")
    _refused(client.post("/v1/caption", files=_sample(IMAGE), data={"do_sample": "x" * 100_000}), 422, "do_sample")
    _refused(client.post("/v1/audio/transcriptions", files=_sample(AUDIO), data={"response_format": "x" * 100_000}),
             422, "response_format")
    _refused(client.post("/v1/audio/speech", json={"input": "".join(map(chr, range(200, 320)))}), 422,
             "characters this voice cannot say")


def test_do_sample_false_turns_off_a_models_default_sampling(client, tmp_path):
    speaker = client.app.state.models.speaker
    assert speaker.engine.generation_config.do_sample  # the shipped speaker samples by default
    bodies = [client.post("/v1/audio/speech", json={"input": "four two", "do_sample": False}).content
              for _ in range(2)]
    assert bodies[0] == bodies[1]  # greedy: the same audio each time, no seed needed
    out = tmp_path / "greedy.wav"
    assert main(["speak", "four two", "--no-do-sample", "-o", str(out)]) == 0
    want, _ = soundfile.read(out, dtype="int16")
    got, _ = soundfile.read(__import__("io").BytesIO(bodies[0]), dtype="int16")
    assert np.array_equal(got, want)
    ok = client.post("/v1/caption", files=_sample(IMAGE), data={"do_sample": "false", "num_beams": "2"})
    assert ok.status_code == 200, ok.text


# ---- attention maps -----------------------------------------------------------------------------------------------
def test_an_attention_map_draws_a_huge_image_small(monkeypatch, tmp_path):
    import matplotlib.axes

    from xattn.tasks.captioning import MAP_PIXELS, Attention, draw_attention

    drawn = []
    real = matplotlib.axes.Axes.imshow

    def imshow(self, data, *args, **kwargs):
        drawn.append(np.asarray(data).shape[:2])
        return real(self, data, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "imshow", imshow)
    huge = Image.new("RGB", (3000, 2000), "red")
    draw_attention(huge, Attention("a b", torch.rand(2, 65), ["a", "b"]), str(tmp_path / "map.png"))
    images = [shape for shape in drawn if shape != (8, 8)]  # the image panels, not the 8 x 8 patch grids
    assert images and all(max(shape) <= MAP_PIXELS for shape in images), drawn
    assert huge.size == (3000, 2000)  # the caller's image is left as it was


def test_an_attention_map_is_drawn_outside_the_decode_thread(client, monkeypatch):
    """While one request's map is being drawn, another request's caption is answered."""
    import xattn.serve.app as app_module

    drawing, release = threading.Event(), threading.Event()

    def slow_draw(image, attention):
        drawing.set()
        release.wait(60)
        return "drawn"

    monkeypatch.setattr(app_module, "attention_map_png", slow_draw)
    result = {}
    thread = threading.Thread(target=lambda: result.update(map=client.post(
        "/v1/caption", files=_sample(IMAGE), data={"attention_map": "true"})))
    thread.start()
    try:
        assert drawing.wait(60), "the map was never drawn through attention_map_png"
        plain = client.post("/v1/caption", files=_sample("scene-2.png"))
        assert plain.status_code == 200 and not release.is_set()
    finally:
        release.set()
        thread.join(60)
    assert result["map"].status_code == 200 and result["map"].json()["attention_map_png"] == "drawn"


# ---- the middleware -----------------------------------------------------------------------------------------------
def test_refusals_are_in_metrics_and_a_non_ascii_key_is_refused_at_start():
    app = create_app(Settings(api_key="k3y", captioner="none", recognizer="none", speaker="none", max_upload_mb=1))
    with TestClient(app) as client:
        assert client.post("/v1/caption", files={"file": ("a.png", b"x")}).status_code == 401

        def chunks():  # no Content-Length: counted while it streams in
            for _ in range(2):
                yield os.urandom(2**20)

        headers = {"Authorization": "Bearer k3y", "content-type": "multipart/form-data; boundary=x"}
        big = client.post("/v1/caption", content=chunks(), headers=headers)
        _refused(big, 413, "the request body is over 1 MB")
        text = client.get("/metrics").text
    assert 'xattn_requests_total{endpoint="/v1/caption",status="401"} 1.0' in text
    assert 'xattn_requests_total{endpoint="/v1/caption",status="413"} 1.0' in text
    with pytest.raises(ValueError, match="--api-key: use printable ASCII"):
        create_app(Settings(api_key="clé", captioner="none", recognizer="none", speaker="none"))


SERVER = textwrap.dedent("""
    import sys, uvicorn
    from xattn.serve import Settings, create_app

    app = create_app(Settings(captioner="none", recognizer="none", speaker="none", timeout_s=2))
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
""")


def test_a_body_that_arrives_slowly_is_refused_at_the_deadline(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], env=env)
    try:
        end = time.monotonic() + 120
        while True:
            assert server.poll() is None, "the server exited"
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=1)
                break
            except OSError:
                assert time.monotonic() < end, "the server never listened"
                time.sleep(0.1)
        with conn:
            conn.settimeout(30)
            conn.sendall(b"POST /v1/caption HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=x\r\n"
                         b"Content-Length: 100000\r\n\r\n" + b"--x\r\n" + b"a" * 74)  # then nothing more
            answer = b""
            while b"\r\n\r\n" not in answer:
                piece = conn.recv(4096)
                assert piece, f"the server closed without an answer: {answer!r}"
                answer += piece
        assert answer.startswith(b"HTTP/1.1 408"), answer
    finally:
        server.terminate()
        server.wait(30)

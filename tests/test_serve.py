"""`xattn serve`'s API contract, against the app with the shipped models (FastAPI's TestClient, httpx): each endpoint
answers what the CLI and the task APIs give for the same input, and refuses what the CLI refuses with the CLI's
one-line message (the upload's name where the CLI names its file) and an HTTP status; a run of bad inputs leaves
the server answering."""

import base64
import io
import json
import os

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
IMAGES = sorted(f for f in os.listdir(SAMPLES) if f.startswith("scene-"))
AUDIO = sorted(f for f in os.listdir(SAMPLES) if f.startswith("digits-"))


@pytest.fixture(scope="module")
def client():
    torch.set_num_threads(1)
    with TestClient(create_app(Settings(max_upload_mb=2)), raise_server_exceptions=False) as client:
        yield client


def _bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _sample(name: str):
    with open(os.path.join(SAMPLES, name), "rb") as f:
        return {"file": (name, f.read())}


def _one_line_error(response, status: int, *needles: str) -> str:
    assert response.status_code == status, response.text
    message = response.json()["error"]["message"]
    assert "\n" not in message and "Traceback" not in message
    for needle in needles:
        assert needle in message, message
    return message


# ---- results equal the task API's and the CLI's -------------------------------------------------------------------
def test_captions_equal_the_captioners(client):
    captioner = client.app.state.models.captioner
    expected = captioner.caption_results([captioner.load(os.path.join(SAMPLES, f)) for f in IMAGES])
    for name, want in zip(IMAGES, expected):
        got = client.post("/v1/caption", files=_sample(name))
        assert got.status_code == 200, got.text
        assert got.json() == {"text": want.pop("caption"), **want}


def test_caption_options_are_the_clis(client, capsys):
    path = os.path.join(SAMPLES, IMAGES[0])
    for flags, fields in [(["--num-beams", "3"], {"num_beams": "3"}),
                          (["--do-sample", "--seed", "5", "--top-k", "4"], {"do_sample": "true", "seed": "5",
                                                                             "top_k": "4"}),
                          (["--max-new-tokens", "3"], {"max_new_tokens": "3"})]:
        assert main(["caption", path, *flags]) == 0
        cli = capsys.readouterr().out.strip()
        got = client.post("/v1/caption", files=_sample(IMAGES[0]), data=fields)
        assert got.status_code == 200 and got.json()["text"] == cli, (flags, got.text)


def test_several_results_per_image(client):
    got = client.post("/v1/caption", files=_sample(IMAGES[1]), data={"num_beams": "3", "num_return_sequences": "2"})
    body = got.json()
    assert got.status_code == 200 and len(body["results"]) == 2 and body["text"] == body["results"][0]["text"]


def test_attention_map_is_a_png_of_the_same_caption(client, tmp_path, capsys):
    got = client.post("/v1/caption", files=_sample(IMAGES[2]), data={"attention_map": "true"})
    assert got.status_code == 200, got.text
    png = base64.b64decode(got.json()["attention_map_png"])
    assert Image.open(io.BytesIO(png)).format == "PNG"
    out = tmp_path / "map.png"
    assert main(["caption", os.path.join(SAMPLES, IMAGES[2]), "--attention-map", str(out)]) == 0
    assert capsys.readouterr().out.strip() == got.json()["text"]


def test_transcripts_equal_the_transcribers(client):
    transcriber = client.app.state.models.transcriber
    for name in AUDIO:
        want = transcriber.transcribe_results([transcriber.load(os.path.join(SAMPLES, name))])[0]
        got = client.post("/v1/audio/transcriptions", files=_sample(name), data={"model": "whisper-1"})
        assert got.status_code == 200 and got.json() == want, got.text
    text = client.post("/v1/audio/transcriptions", files=_sample(AUDIO[-1]), data={"response_format": "text"})
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    assert text.text == want["text"] + "\n"


def test_transcription_formats_and_options(client, capsys):
    path = os.path.join(SAMPLES, AUDIO[0])
    assert main(["transcribe", path, "--num-beams", "4"]) == 0
    cli = capsys.readouterr().out.strip()
    verbose = client.post("/v1/audio/transcriptions", files=_sample(AUDIO[0]),
                          data={"response_format": "verbose_json", "num_beams": "4"}).json()
    assert verbose["text"] == cli and verbose["segments"][0]["text"] == cli
    assert verbose["duration"] == pytest.approx(soundfile.info(path).duration, abs=0.01)
    text = client.post("/v1/audio/transcriptions", files=_sample(AUDIO[0]), data={"response_format": "text",
                                                                                 "num_beams": "4"})
    assert text.text == cli + "\n"
    sampled = client.post("/v1/audio/transcriptions", files=_sample(AUDIO[0]), data={"temperature": "0.7",
                                                                                    "seed": "1"})
    assert main(["transcribe", path, "--do-sample", "--temperature", "0.7", "--seed", "1"]) == 0
    assert sampled.json()["text"] == capsys.readouterr().out.strip()


def test_speech_streams_the_clis_audio(client, tmp_path):
    out = tmp_path / "cli.wav"
    assert main(["speak", "four two seven", "--seed", "3", "--voice", "us-female", "-o", str(out), "--stream"]) == 0
    want, rate = soundfile.read(out, dtype="int16")
    with client.stream("POST", "/v1/audio/speech", json={"input": "four two seven", "voice": "us-female",
                                                         "seed": 3}) as response:
        assert response.status_code == 200 and response.headers["content-type"] == "audio/wav"
        body = b"".join(response.iter_bytes())
    got, got_rate = soundfile.read(io.BytesIO(body), dtype="int16")
    assert got_rate == rate and np.array_equal(got, want)
    pcm = client.post("/v1/audio/speech", json={"input": "four two seven", "voice": "us-female", "seed": 3,
                                                 "response_format": "pcm"})
    assert np.array_equal(np.frombuffer(pcm.content, "<i2"), want)


# ---- refusals: the CLI's messages, an HTTP status, and the server goes on -----------------------------------------
def _bad_images(tmp):
    from test_bad_input_cli import _image_cases

    cases = [(p, m) for p, m in _image_cases(tmp) if m != "no such file"]
    return [(p, 415 if "readable" in m else 422, m) for p, m in cases]


def _bad_audio(tmp):
    from test_bad_input_cli import _audio_cases

    cases = [(p, m) for p, m in _audio_cases(tmp) if m != "no such file"]
    for samples in (1, 100, 399):  # shorter than the recognizer's first encoder frame (test_hostile_input)
        path = tmp / f"short-{samples}.wav"
        soundfile.write(path, np.random.default_rng(0).uniform(-0.3, 0.3, samples), 16000)
        cases.append((str(path), "too short for this model"))
    return [(p, 415 if "readable" in m else 422, m) for p, m in cases]


def test_bad_files_get_the_clis_messages_then_a_good_request_works(client, tmp_path, capsys):
    (tmp_path / "i").mkdir()
    (tmp_path / "a").mkdir()
    cases = [("/v1/caption", *case) for case in _bad_images(tmp_path / "i")] + \
            [("/v1/audio/transcriptions", *case) for case in _bad_audio(tmp_path / "a")]
    assert len(cases) >= 8
    for url, path, status, message in cases:
        name = os.path.basename(path)
        assert main(["caption" if "caption" in url else "transcribe", path]) == 2
        cli = capsys.readouterr().err.strip().split(": error: ", 1)[1]
        with open(path, "rb") as f:
            got = client.post(url, files={"file": (name, f)})
        message = _one_line_error(got, status, message, name)
        assert message == cli.replace(path, name)  # the CLI's line, naming the upload
        assert str(tmp_path) not in message and "xattn-serve-" not in message  # no server paths leak
    good = client.post("/v1/caption", files=_sample(IMAGES[0]))
    assert good.status_code == 200 and good.json()["text"]


@pytest.mark.parametrize("fields,message", [
    ({"max_new_tokens": "0"}, "max_new_tokens: must be at least 1, got 0"),
    ({"max_new_tokens": "500"}, "n_positions"),
    ({"max_new_tokens": "many"}, "max_new_tokens: expected a whole number, got 'many'"),
    ({"num_beams": "2", "num_return_sequences": "3"}, "must be <= num_beams"),
    ({"do_sample": "true", "temperature": "-1"}, "temperature: must be greater than 0"),
    ({"do_sample": "true", "top_p": "1.5"}, "top_p: must be at most 1"),
    ({"repetition_penalty": "0"}, "repetition_penalty: must be greater than 0"),
    ({"num_beams": "2", "do_sample": "true"}, "beam sampling is not supported"),
    ({"seed": "-1"}, "seed: must be at least 0"),
    ({"temperature": "nan"}, "temperature: expected a finite number"),
    ({"do_sample": "maybe"}, "do_sample: expected true or false"),
    ({"attention_map": "perhaps"}, "attention_map: expected true or false"),
])
def test_bad_generation_options_are_422_with_the_clis_message(client, fields, message):
    _one_line_error(client.post("/v1/caption", files=_sample(IMAGES[0]), data=fields), 422, message)


@pytest.mark.parametrize("fields,message", [
    ({"response_format": "srt"}, "response_format: 'srt' is not supported"),
    ({"prompt": "digits"}, "prompt: this recognizer takes no prompt"),
    ({"temperature": "-0.5"}, "temperature: must be at least 0"),
    ({"num_beams": "0"}, "num_beams: must be at least 1"),
])
def test_bad_transcription_fields(client, fields, message):
    _one_line_error(client.post("/v1/audio/transcriptions", files=_sample(AUDIO[0]), data=fields), 422, message)


@pytest.mark.parametrize("body,message", [
    ({"input": ""}, "the text is empty"),
    ({"input": "four 2"}, "characters this voice cannot say"),
    ({"input": "a" * 121}, "at most 120"),
    ({"input": "four", "voice": "alloy"}, "unknown voice 'alloy'; this model speaks gb-male, us-female"),
    ({"input": "four", "response_format": "mp3"}, "response_format: 'mp3' is not supported"),
    ({"input": "four", "speed": 2}, "speed: this speaker speaks at one speed"),
    ({"input": "four", "top_p": 2}, "top_p: must be at most 1"),
    ({"input": "four", "max_new_token": 3}, "max_new_token: Extra inputs are not permitted"),
    ({"voice": "gb-male"}, "input: Field required"),
])
def test_bad_speech_requests(client, body, message):
    _one_line_error(client.post("/v1/audio/speech", json=body), 422, message)


def test_malformed_requests(client):
    _one_line_error(client.post("/v1/caption", data={"num_beams": "2"}), 422, "file: Field required")
    broken = client.post("/v1/caption", content=b"--x\r\nContent-Disposition: form-data; name=\"file\"\r\nnonsense",
                         headers={"content-type": "multipart/form-data; boundary=x"})
    _one_line_error(broken, broken.status_code)
    assert broken.status_code in (400, 422)
    _one_line_error(client.post("/v1/audio/speech", content=b"{not json", headers={
        "content-type": "application/json"}), 422, "JSON")
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/health").json()["status"] == "ok"


# ---- limits -------------------------------------------------------------------------------------------------------
def test_an_upload_over_the_limit_is_413(client):
    big = os.urandom(3 * 2**20)
    _one_line_error(client.post("/v1/caption", files={"file": ("big.png", big)}), 413, "at most 2 MB")

    def chunks():  # no Content-Length: counted while it streams in
        for _ in range(3):
            yield os.urandom(2**20)

    streamed = client.post("/v1/audio/transcriptions", content=chunks(),
                           headers={"content-type": "multipart/form-data; boundary=x"})
    _one_line_error(streamed, 413, "at most 2 MB")
    assert client.post("/v1/caption", files=_sample(IMAGES[0])).status_code == 200


def test_bearer_token():
    app = create_app(Settings(api_key="s3cret", recognizer="none", speaker="none"))
    with TestClient(app) as client:
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}]:
            got = client.post("/v1/caption", files=_sample(IMAGES[0]), headers=headers)
            _one_line_error(got, 401, "API key")
            assert got.headers["www-authenticate"] == "Bearer"
        ok = client.post("/v1/caption", files=_sample(IMAGES[0]), headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert client.get("/health").status_code == 200  # load balancers probe without a key
        _one_line_error(client.post("/v1/audio/transcriptions", files=_sample(AUDIO[0]),
                                    headers={"Authorization": "Bearer s3cret"}), 404, "runs no recognizer")
        assert "HTTPBearer" in json.dumps(client.get("/openapi.json").json()["components"])


def test_the_loaded_models_objects_are_frozen_out_of_the_collector_while_the_app_runs():
    """gc.freeze() at startup: a full collection then walks only what requests make, not every module object."""
    import gc

    app = create_app(Settings(recognizer="none", speaker="none"))
    with TestClient(app) as client:
        frozen = gc.get_freeze_count()
        assert frozen > 10_000  # transformers' and the captioner's objects
        assert client.post("/v1/caption", files=_sample(IMAGES[0])).status_code == 200
    assert gc.get_freeze_count() == 0  # shutdown gives them back


# ---- service ------------------------------------------------------------------------------------------------------
def test_openapi_lists_the_clis_generation_options(client):
    spec = client.get("/openapi.json").json()
    assert {"/v1/caption", "/v1/audio/transcriptions", "/v1/audio/speech", "/health", "/metrics"} <= set(spec["paths"])
    text = json.dumps(spec)
    for name in ("max_new_tokens", "num_beams", "do_sample", "top_k", "top_p", "seed", "response_format"):
        assert name in text
    assert client.get("/docs").status_code == 200
    home = client.get("/", follow_redirects=False)  # the web page (tests/test_serve_page.py), with its script
    assert home.status_code == 200 and home.headers["content-type"].startswith("text/html")
    assert client.get("/app.js").status_code == 200 and client.get("/style.css").status_code == 200


def test_metrics(client):
    client.post("/v1/caption", files=_sample(IMAGES[0]))
    text = client.get("/metrics").text
    for name in ("xattn_queue_length", "xattn_batch_size_bucket", "xattn_generated_tokens_total",
                 "xattn_tokens_per_second", "xattn_request_latency_seconds_bucket", "xattn_queue_wait_seconds"):
        assert name in text, name
    assert 'xattn_requests_total{endpoint="/v1/caption",status="200"}' in text
    tokens = [line for line in text.splitlines() if line.startswith('xattn_generated_tokens_total{task="caption"}')]
    assert float(tokens[0].split()[-1]) > 0

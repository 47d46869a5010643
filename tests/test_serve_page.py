"""The page at `/` of `xattn serve`, in headless Chromium (Debian's `chromium`, driven by Playwright): against a
real server on a loopback port (with an API key, typed into the page), a picked image gives the API's caption and
its attention map, a dropped audio file the API's transcript, a recording from a fake microphone (webm in the
browser, WAV on the wire) a transcript, typed text audio that plays before the speech response has ended, and a
refusal its one line. A screenshot is kept (the test's tmp folder, and $XATTN_ARTIFACTS when set)."""

import base64
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

pytest.importorskip("fastapi")
import httpx  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLES = os.path.join(REPO, "data", "samples")
IMAGE, AUDIO, MICROPHONE = "scene-1.png", "digits-2.flac", "digits-0.wav"
KEY = "page-test-key"
TEXT = "four two seven one nine three"  # the shipped speaker says ~2 s: two chunks
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
# `xattn serve` with the shipped models and an API key, its speaker's chunks paced PACE_S apart, as a larger model's
# come on a CPU: the shipped speaker makes its ~2 s of audio in a few tenths of a second, which on a fast machine
# would leave no time between the first chunk and the end to tell streaming from waiting
PACE_S = 0.5
SERVER = textwrap.dedent(f"""
    import sys, time, uvicorn
    from xattn.serve import Settings, create_app
    from xattn.tasks.speech_synthesis import Speaker

    class Paced:
        def __init__(self, speaker):
            self.speaker, self.engine, self.voices = speaker, speaker.engine, speaker.voices

        def check_voice(self, voice):
            return self.speaker.check_voice(voice)

        def stream(self, *args, **kwargs):
            for i, piece in enumerate(self.speaker.stream(*args, **kwargs)):
                time.sleep({PACE_S} if i else 0)
                yield piece

    app = create_app(Settings(api_key={KEY!r}, threads=1), speaker=Paced(Speaker()))
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
""")
# headless Chromium on a machine with a closed network (machines/python.md), a fake microphone playing a sample
FLAGS = ["--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--autoplay-policy=no-user-gesture-required",
         "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
         f"--use-file-for-fake-audio-capture={os.path.join(SAMPLES, MICROPHONE)}"]


def _in_ci_or_skip(reason: str):
    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI runs this test: .ci/run installs Chromium and the test extra)")
    print(reason)
    pytest.skip(reason)


def _chromium() -> str:
    """Debian's Chromium; installed with apt-get (as root) when missing."""
    path = shutil.which("chromium")
    if path:
        return path
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        _in_ci_or_skip("no chromium, and this user cannot install it: apt-get install chromium (as root)")
    install = "apt-get install -y -qq chromium || (apt-get update -qq && apt-get install -y -qq chromium)"
    done = subprocess.run(install, shell=True, capture_output=True, text=True,
                          env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    path = shutil.which("chromium")
    if not path:
        pytest.fail(f"apt-get could not install chromium: {done.stderr.strip()[-500:]}")
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-c", SERVER, str(port)], env=ENV, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        end = time.monotonic() + 180
        while True:
            assert process.poll() is None, f"the server exited: {process.stdout.read()}"
            assert time.monotonic() < end, "the server never answered /health"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def browser():
    executable = _chromium()
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _in_ci_or_skip("playwright is not installed: pip install -c constraints.txt -e '.[test]'")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, args=FLAGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1180, "height": 900}, base_url=server)
    context.grant_permissions(["microphone"], origin=server)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda error: errors.append(error))
    page.goto("/")
    page.wait_for_selector("body[data-ready=true]")
    page.fill("#api-key", KEY)
    yield page
    context.close()
    assert not errors, errors  # no uncaught error in the page's script


def _api(server: str, path: str, **kwargs) -> httpx.Response:
    got = httpx.post(f"{server}{path}", headers={"Authorization": f"Bearer {KEY}"}, timeout=120, **kwargs)
    assert got.status_code == 200, got.text
    return got


def _sample(name: str):
    with open(os.path.join(SAMPLES, name), "rb") as f:
        return {"file": (name, f.read())}


def _done(page, section: str, timeout_s: float = 120):
    page.wait_for_selector(f"#{section}[data-state=done], #{section}[data-state=error]", timeout=timeout_s * 1000)
    error = page.locator(f"#{section} .error")
    assert page.get_attribute(f"#{section}", "data-state") == "done", error.text_content()
    assert error.is_hidden()


def _assert_confidence(page, selector: str, want: dict):
    assert float(page.get_attribute(selector, "data-avg-logprob")) == want["avg_logprob"]
    assert page.text_content(selector).startswith("avg log-prob ")
    assert ("low confidence" in page.text_content(selector)) == want["low_confidence"]


def _drop(page, selector: str, name: str, mime: str):
    """A file dropped on the element, as a drag from the desktop does (a DataTransfer with the file)."""
    with open(os.path.join(SAMPLES, name), "rb") as f:
        data = base64.b64encode(f.read()).decode()
    page.evaluate("""([selector, name, mime, data]) => {
        const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
        const transfer = new DataTransfer();
        transfer.items.add(new File([bytes], name, { type: mime }));
        const zone = document.querySelector(selector);
        zone.dispatchEvent(new DragEvent("dragover", { dataTransfer: transfer, bubbles: true, cancelable: true }));
        zone.dispatchEvent(new DragEvent("drop", { dataTransfer: transfer, bubbles: true, cancelable: true }));
    }""", [selector, name, mime, data])


def test_the_page_captions_transcribes_and_speaks(page, server, tmp_path):
    started = time.monotonic()
    # an image, picked: the API's caption, its confidence, the attention map
    page.set_input_files("#image-file", os.path.join(SAMPLES, IMAGE))
    _done(page, "caption")
    want = _api(server, "/v1/caption", files=_sample(IMAGE), data={"attention_map": "true"}).json()
    assert page.text_content("#caption-text") == want["text"]
    _assert_confidence(page, "#caption-confidence", want)
    assert page.get_attribute("#attention-image", "src") == f"data:image/png;base64,{want['attention_map_png']}"
    assert page.evaluate("document.getElementById('attention-image').naturalWidth") > 0

    # an audio file, dropped: the API's transcript
    _drop(page, "#transcribe .drop", AUDIO, "audio/flac")
    _done(page, "transcribe")
    want = _api(server, "/v1/audio/transcriptions", files=_sample(AUDIO)).json()
    assert page.text_content("#transcript") == want["text"]
    _assert_confidence(page, "#transcript-confidence", want)

    # typed text: audio plays before the streamed response ends
    page.fill("#speak-text", TEXT)
    page.click("#speak-button")
    page.wait_for_selector("#speak[data-state=playing]", timeout=60_000)
    _done(page, "speak")
    timing = page.evaluate("({...document.getElementById('speak').dataset})")
    first, end, played = int(timing["firstSoundMs"]), int(timing["responseEndMs"]), int(timing["playedAtEndMs"])
    print(f"speech: first sound {first} ms after the click, response ended at {end} ms, {played} ms played by then, "
          f"{int(timing['samples']) / 16000:.1f} s of audio")
    assert first < end and played > 0, timing
    assert end - first > PACE_S / 2, timing  # the first sound came with the first chunk, not at the end
    assert page.evaluate("document.getElementById('speech-audio').src").startswith("blob:")
    assert page.evaluate("""new Promise((done) => {
        const audio = document.getElementById('speech-audio');
        if (audio.readyState >= 1) done(audio.duration);
        else audio.addEventListener('loadedmetadata', () => done(audio.duration));
    })""") == pytest.approx(int(timing["samples"]) / 16000, abs=0.01)
    _screenshot(page, tmp_path)
    print(f"the page's round trip: {time.monotonic() - started:.1f} s")


def test_a_recording_is_sent_as_wav(page):
    page.click("#record")
    page.wait_for_selector("#transcribe[data-state=recording]")
    assert page.get_attribute("#record", "aria-pressed") == "true"
    page.wait_for_timeout(2500)
    page.click("#record")
    _done(page, "transcribe")
    assert page.get_attribute("#transcribe", "data-upload") == "audio/wav"
    print(f"the recording's transcript: {page.text_content('#transcript')!r}")
    assert page.text_content("#transcript").strip()


def test_refusals_show_the_apis_line(page, server):
    page.fill("#speak-text", "4 2 7!")
    page.press("#speak-text", "Enter")  # the keyboard's way
    page.wait_for_selector("#speak[data-state=error]")
    want = httpx.post(f"{server}/v1/audio/speech", json={"input": "4 2 7!"},
                      headers={"Authorization": f"Bearer {KEY}"}).json()["error"]["message"]
    assert page.text_content("#speak .error") == f"422: {want}"
    # the key is kept for the tab (sessionStorage) and sent as a bearer token; a wrong one is refused
    page.reload()
    page.wait_for_selector("body[data-ready=true]")
    assert page.input_value("#api-key") == KEY
    page.fill("#api-key", "wrong")
    page.set_input_files("#image-file", os.path.join(SAMPLES, IMAGE))
    page.wait_for_selector("#caption[data-state=error]")
    assert page.text_content("#caption .error").startswith("401: missing or wrong API key")
    assert page.locator("#caption .error").is_visible()


def test_stop_ends_the_speech(page):
    page.fill("#speak-text", TEXT)
    page.click("#speak-button")
    page.wait_for_selector("#speak[data-state=playing]", timeout=60_000)
    page.click("#speak-stop")
    page.wait_for_selector("#speak[data-state=stopped]")
    assert page.text_content("#speech-status") == "Stopped."
    assert page.is_disabled("#speak-stop") and page.locator("#speak .error").is_hidden()


def _screenshot(page, tmp_path):
    path = tmp_path / "serve-page.png"
    page.screenshot(path=str(path), full_page=True)
    assert path.stat().st_size > 10_000
    folder = os.environ.get("XATTN_ARTIFACTS")
    if folder:
        os.makedirs(folder, exist_ok=True)
        shutil.copy(path, os.path.join(folder, path.name))

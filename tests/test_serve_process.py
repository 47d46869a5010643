"""`xattn serve` as a process: SIGTERM lets the request in flight finish and refuses new connections (uvicorn's
graceful shutdown), and `--workers 2` serves from two processes sharing the port, /metrics summing both."""

import os
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
IMAGE = os.path.join(REPO, "data", "samples", "scene-1.png")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}

# the shipped captioner, each batch waiting until the test writes to the FIFO `gate` (it creates `started` first)
GATED_SERVER = textwrap.dedent("""
    import os, sys, uvicorn
    from xattn.serve import Settings, create_app
    from xattn.tasks.captioning import Captioner

    folder, port = sys.argv[1], int(sys.argv[2])
    real = Captioner()

    class Gated:
        engine, tokenizer, load = real.engine, real.tokenizer, real.load

        def caption_results(self, pixels, **kwargs):
            open(os.path.join(folder, "started"), "w").close()
            with open(os.path.join(folder, "gate")) as gate:
                gate.read()
            return real.caption_results(pixels, **kwargs)

    app = create_app(Settings(recognizer="none", speaker="none", threads=1, inflight=False), captioner=Gated())
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", timeout_graceful_shutdown=60)
""")


def _bytes(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(condition, what: str, process, limit: float = 120.0):
    end = time.monotonic() + limit
    while not condition():
        assert process.poll() is None, f"the server exited ({process.returncode}) before: {what}"
        assert time.monotonic() < end, f"never: {what}"
        time.sleep(0.02)


def _answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=5).close()
        return False
    except ConnectionRefusedError:
        return True


def test_sigterm_finishes_the_request_in_flight_and_refuses_new_ones(tmp_path):
    import threading

    os.mkfifo(tmp_path / "gate")
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-c", GATED_SERVER, str(tmp_path), str(port)], env=ENV, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: _answers(url), "the server answering", server)
        answer = []
        client = threading.Thread(target=lambda: answer.append(httpx.post(
            f"{url}/v1/caption", files={"file": ("a.png", _bytes(IMAGE))}, timeout=120)))
        client.start()
        _wait(lambda: (tmp_path / "started").exists(), "the request in its batch", server)
        server.send_signal(signal.SIGTERM)
        _wait(lambda: _refused(port), "new connections refused", server)
        with open(tmp_path / "gate", "w") as gate:
            gate.write("go")
        client.join(120)
        assert answer and answer[0].status_code == 200 and answer[0].json()["text"], answer
        # uvicorn re-raises the signal once it has shut down: the process ends by SIGTERM, after the answer
        assert server.wait(60) in (0, -signal.SIGTERM), server.stdout.read()
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_workers_share_the_port(tmp_path):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "xattn.cli", "serve", "--port", str(port), "--workers", "2",
                               "--threads", "1", "--recognizer", "none", "--speaker", "none", "--quiet"],
                              env=ENV, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait(lambda: _answers(url), "the server answering", server)
        pids = set()
        for _ in range(400):  # a new connection each time: the kernel hands it to either worker
            with httpx.Client() as client:
                pids.add(client.get(f"{url}/health").json()["pid"])
            if len(pids) == 2:
                break
        assert len(pids) == 2
        for _ in range(2):
            caption = httpx.post(f"{url}/v1/caption", files={"file": ("a.png", _bytes(IMAGE))},
                                 timeout=60)
            assert caption.status_code == 200 and caption.json()["text"]
        metrics = httpx.get(f"{url}/metrics").text  # either worker: the sum over both
        line = next(x for x in metrics.splitlines()
                    if x.startswith('xattn_requests_total{endpoint="/v1/caption",status="200"}'))
        assert float(line.split()[-1]) == 2.0
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) in (0, -signal.SIGTERM)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_a_bad_model_is_one_line_before_the_port_opens(tmp_path):
    done = subprocess.run([sys.executable, "-m", "xattn.cli", "serve", "--captioner", str(tmp_path / "missing"),
                           "--port", str(_free_port())], env=ENV, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and "xattn serve: error:" in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr

"""`xattn bench --serve`: HTTP load on /v1/caption, side by side, one server at a time on loopback.

Servers: `xattn serve` with in-flight batching, the same app one request at a time (--no-batching), and
transformers' `generate` behind the same app (bench/serve_peer.py, micro-batched: what arrives together is one
`generate` call); each in every weight format asked for. Each gets a warm-up, then closed-loop levels of N
clients (bench/serve_load.py), each client posting the next shipped sample image as soon as its answer came.
Then a soak on the first server: its resident memory over minutes of load. The model is the benchmark shape
(ViT-B/16 + GPT-2 small, random weights, saved once to a temporary checkpoint), so every request decodes exactly
max_new_tokens tokens (a random GPT-2 almost never says EOS)."""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from .serve_load import Level, RssSampler, images, rss_mb, run_level

LEVELS = (1, 8, 32, 128)
SAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data",
                       "samples")  # the source tree's; an installed xattn passes images= instead


@dataclass
class Server:
    name: str
    weights: str  # "exact", or decoder+encoder formats ("int8+int8")
    kind: str  # "inflight", "one-at-a-time", "transformers"
    load_s: float = 0.0  # process start to /health answering
    levels: list[Level] = field(default_factory=list)
    captions: dict[str, str] = field(default_factory=dict)  # sample name -> caption, one request each


@dataclass
class Report:
    checkpoint: str
    clients: list[int]
    seconds: float
    max_new_tokens: int
    max_batch_size: int
    threads: int
    images: list[str]
    servers: list[Server]
    soak: dict = field(default_factory=dict)


def default_images() -> list[str]:
    found = sorted(glob.glob(os.path.join(SAMPLES, "scene-*")))
    if not found:
        raise ValueError("no shipped sample images here (an installed xattn): pass --serve-images")
    return found


def bench_checkpoint(folder: str) -> str:
    """The benchmark model (bench.decode.vit_gpt2_small: ViT-B/16 + GPT-2 small, random weights) as a checkpoint
    any server can load: safetensors, a word-level tokenizer over GPT-2's 50257 ids, ViT's image processor."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast, ViTImageProcessor

    from .decode import vit_gpt2_small

    model = vit_gpt2_small()
    model.generation_config.max_length = None  # each request says max_new_tokens
    model.save_pretrained(folder)
    vocab = {f"w{i}": i for i in range(50256)} | {"<|endoftext|>": 50256}
    words = Tokenizer(WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, bos_token="<|endoftext|>",
                                        eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                        unk_token="<|endoftext|>")
    tokenizer.save_pretrained(folder)
    ViTImageProcessor().save_pretrained(folder)
    return folder


def server_command(kind: str, weights: str, checkpoint: str, port: int, max_batch_size: int, threads: int,
                   max_queue: int, timeout_s: float) -> list[str]:
    limits = ["--max-batch-size", str(max_batch_size), "--max-queue", str(max_queue), "--timeout-s", str(timeout_s),
              "--threads", str(threads)]
    if kind == "transformers":
        return [sys.executable, "-m", "xattn.bench.serve_peer", "--captioner", checkpoint, "--port", str(port),
                *limits]
    decoder, _, encoder = weights.partition("+")
    command = [sys.executable, "-m", "xattn", "serve", "--captioner", checkpoint, "--recognizer", "none",
               "--speaker", "none", "--port", str(port), "--quiet", "--weights", decoder, *limits]
    if encoder:
        command += ["--encoder-weights", encoder]
    if kind == "one-at-a-time":
        command.append("--no-batching")
    return command


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Running:
    """A server process, up (its /health answered) inside the with-block, stopped (SIGTERM, then kill) after."""

    def __init__(self, command: list[str], port: int, log: str, start_timeout_s: float = 600.0):
        self.command, self.port, self.log, self.start_timeout_s = command, port, log, start_timeout_s
        self.url = f"http://127.0.0.1:{port}"

    def __enter__(self):
        import httpx

        started = time.monotonic()
        self._log = open(self.log, "wb")
        self.process = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT)
        while True:
            if self.process.poll() is not None:
                self._stop()
                raise RuntimeError(f"the server exited ({self.process.returncode}) before answering: "
                                   f"{_tail(self.log)}")
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() - started > self.start_timeout_s:
                self._stop()
                raise RuntimeError(f"the server did not answer /health in {self.start_timeout_s:.0f} s: "
                                   f"{_tail(self.log)}")
            time.sleep(0.5)
        self.load_s = time.monotonic() - started
        return self

    def __exit__(self, *exc):
        self._stop()

    def _stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def _tail(path: str, chars: int = 600) -> str:
    with open(path, "rb") as f:
        return f.read().decode(errors="replace")[-chars:].strip().replace("\n", " | ")


def captions(url: str, pictures, fields: dict) -> dict[str, str]:
    """One request per image, one at a time: the server's caption of each."""
    import httpx

    out = {}
    with httpx.Client(timeout=None) as client:
        for name, data, kind in pictures:
            answer = client.post(url, files={"file": (name, data, kind)}, data=fields)
            answer.raise_for_status()
            out[name] = answer.json()["text"]
    return out


def run(weights: list[str] = ("exact",), clients: list[int] = LEVELS, seconds: float = 60.0,
        soak_s: float = 600.0, soak_clients: int = 32, max_new_tokens: int = 16, max_batch_size: int = 32,
        threads: int = 2, image_paths: list[str] | None = None, checkpoint: str | None = None,
        kinds: tuple[str, ...] = ("inflight", "one-at-a-time", "transformers"), progress=print) -> Report:
    """The whole bench (see the module's text); `checkpoint` replaces the benchmark model (tests use a small
    one)."""
    paths = image_paths or default_images()
    pictures = images(paths)
    fields = {"max_new_tokens": str(max_new_tokens)}
    timeout_s = 3600.0  # a request is never given up on by the server: a failure here is a real one
    max_queue = 4 * max(max(clients), soak_clients)
    with tempfile.TemporaryDirectory(prefix="xattn-bench-serve-") as folder:
        if checkpoint is None:
            progress("saving the benchmark model (ViT-B/16 + GPT-2 small, random weights)")
            checkpoint = bench_checkpoint(os.path.join(folder, "model"))
            name = "ViT-B/16 + GPT-2 small (random weights)"
        else:
            name = checkpoint
        servers = [Server(_label(kind, w), w, kind) for w in weights for kind in kinds
                   if not (kind == "transformers" and w != weights[0])]  # transformers has one format
        report = Report(name, list(clients), seconds, max_new_tokens, max_batch_size, threads,
                        [os.path.basename(p) for p in paths], servers)
        for index, server in enumerate(servers):
            port = free_port()
            command = server_command(server.kind, server.weights, checkpoint, port, max_batch_size, threads,
                                     max_queue, timeout_s)
            with Running(command, port, os.path.join(folder, f"server-{index}.log")) as up:
                server.load_s = round(up.load_s, 1)
                url = up.url + "/v1/caption"
                progress(f"{server.name}: up in {up.load_s:.0f} s")
                server.captions = captions(url, pictures, fields)
                run_level(url, server.name, min(8, max(clients)), min(10.0, seconds), pictures, fields)  # warm-up
                with RssSampler(up.process.pid) as sampler:
                    for n in clients:
                        level = run_level(url, server.name, n, seconds, pictures, fields, sampler)
                        server.levels.append(level)
                        progress(f"  {n:4d} clients: {level.requests_per_s:7.2f} req/s, p50 {level.p50_ms:8.0f} ms, "
                                 f"p99 {level.p99_ms:8.0f} ms, failed {level.failed}")
                    if index == 0 and soak_s > 0:
                        progress(f"  soak: {soak_clients} clients for {soak_s:.0f} s")
                        soak = run_level(url, server.name, soak_clients, soak_s, pictures, fields, sampler)
                        report.soak = _soak(soak, rss_mb(up.process.pid))
                        progress(f"  soak: {soak.requests_per_s:.2f} req/s, failed {soak.failed}, RSS "
                                 f"{report.soak['rss_first_minute_mb']:.0f} -> {report.soak['rss_last_minute_mb']:.0f}"
                                 f" MB")
    return report


def _label(kind: str, weights: str) -> str:
    if kind == "transformers":
        return "transformers generate (micro-batched)"
    return f"xattn {'in-flight' if kind == 'inflight' else 'one at a time'} ({weights})"


def _soak(level: Level, final_mb: float | None) -> dict:
    samples = level.rss_mb
    minute = max(1, min(60, len(samples) // 4))
    first, last = sorted(samples[:minute]), sorted(samples[-minute:])
    return {"server": level.server, "clients": level.clients, "seconds": level.seconds,
            "requests": level.requests, "failed": level.failed, "requests_per_s": level.requests_per_s,
            "p99_ms": level.p99_ms, "failures": level.failures,
            "rss_first_minute_mb": first[len(first) // 2] if first else float("nan"),
            "rss_last_minute_mb": last[len(last) // 2] if last else float("nan"),
            "rss_max_mb": max(samples, default=float("nan")), "rss_after_mb": final_mb, "rss_mb": samples}


def ratios(report: Report, clients: int = 32) -> dict[str, float]:
    """requests/s of each in-flight server over its one-at-a-time server and over transformers, at `clients`."""
    rate = {s.name: next((lv.requests_per_s for lv in s.levels if lv.clients == clients), None)
            for s in report.servers}
    peer = rate.get(_label("transformers", ""))
    out = {}
    for server in report.servers:
        if server.kind != "inflight" or not rate[server.name]:
            continue
        alone = rate.get(_label("one-at-a-time", server.weights))
        if alone:
            out[f"{server.name} / one at a time ({server.weights})"] = rate[server.name] / alone
        if peer:
            out[f"{server.name} / transformers"] = rate[server.name] / peer
    return out


def parity(report: Report) -> dict[str, float]:
    """Share of sample captions each server gives as transformers' server does (or as the first server)."""
    reference = next((s for s in report.servers if s.kind == "transformers"), report.servers[0])
    return {s.name: sum(s.captions.get(k) == v for k, v in reference.captions.items()) / len(reference.captions)
            for s in report.servers if s is not reference}


def failed(report: Report) -> int:
    return sum(lv.failed for s in report.servers for lv in s.levels) + report.soak.get("failed", 0)


def table(report: Report) -> str:
    lines = [f"{report.checkpoint}, {report.max_new_tokens} new tokens per caption, {len(report.images)} images, "
             f"{report.seconds:.0f} s per level, servers one at a time with {report.threads} torch threads",
             "| server | clients | req/s | p50 ms | p95 ms | p99 ms | failed | RSS max MB |",
             "|---|---|---|---|---|---|---|---|"]
    for server in report.servers:
        for lv in server.levels:
            lines.append(f"| {server.name} | {lv.clients} | {lv.requests_per_s:.2f} | {lv.p50_ms:.0f} | "
                         f"{lv.p95_ms:.0f} | {lv.p99_ms:.0f} | {lv.failed} | {max(lv.rss_mb, default=0):.0f} |")
    lines.append("")
    for name, ratio in ratios(report).items():
        lines.append(f"at 32 clients: {name}: {ratio:.2f}x")
    for name, share in parity(report).items():
        lines.append(f"captions as the reference server's: {name}: {share:.0%}")
    if report.soak:
        s = report.soak
        lines.append(f"soak ({s['server']}, {s['clients']} clients, {s['seconds']:.0f} s): {s['requests']} requests, "
                     f"{s['failed']} failed, RSS median first minute {s['rss_first_minute_mb']:.0f} MB, last minute "
                     f"{s['rss_last_minute_mb']:.0f} MB, max {s['rss_max_mb']:.0f} MB")
    lines.append(f"failed or lost requests, whole run: {failed(report)}")
    return "\n".join(lines)


def save(report: Report, path: str) -> None:
    import torch
    import transformers

    from ..files import save_json
    from .decode import machine

    record = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "load_average": os.getloadavg(),
              "torch": torch.__version__, "transformers": transformers.__version__, **asdict(report),
              "ratios_at_32_clients": ratios(report), "caption_parity": parity(report), "failed": failed(report)}
    save_json(json.loads(json.dumps(record, default=float)), path)


def draw(report: Report, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..files import save_figure

    panels = 3 if report.soak else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4.5))
    for server in report.servers:
        xs = [lv.clients for lv in server.levels]
        axes[0].plot(xs, [lv.requests_per_s for lv in server.levels], marker="o", label=server.name)
        axes[1].plot(xs, [lv.p99_ms / 1000 for lv in server.levels], marker="o", label=server.name)
    axes[0].set_ylabel("requests/s (higher is better)")
    axes[1].set_ylabel("p99 latency, s (lower is better)")
    axes[1].set_yscale("log")
    for ax in axes[:2]:
        ax.set_xscale("log", base=2)
        ax.set_xticks(report.clients, [str(c) for c in report.clients])
        ax.set_xlabel("concurrent clients")
    axes[0].legend(fontsize=7)
    if report.soak:
        rss = report.soak["rss_mb"]
        axes[2].plot(range(len(rss)), rss)
        axes[2].set_ylim(0, max(rss, default=1) * 1.15)
        axes[2].set_xlabel("seconds of soak load")
        axes[2].set_ylabel("server RSS, MB")
        axes[2].set_title(f"{report.soak['server']}, {report.soak['clients']} clients", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)

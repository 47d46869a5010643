"""`xattn bench --serve` at a small scale: the shipped captioner, short levels. Timings are never asserted (these
machines are noisy); what is: every request answered, the servers' captions equal (xattn's in-flight and
one-at-a-time servers against transformers' generate behind the same API), the record's structure, failures
counted, and the peer's avg_logprob equal to xattn's."""

import glob
import json
import os

import pytest
import torch

from xattn.bench import serve
from xattn.bench.serve_load import images, run_level
from xattn.bench.serve_peer import TransformersCaptioner
from xattn.cli import main
from xattn.tasks import SHIPPED_MODELS
from xattn.tasks.captioning import Captioner

CAPTIONER = os.path.join(SHIPPED_MODELS, "scene-captioner")
SAMPLES = sorted(glob.glob(os.path.join(os.path.dirname(SHIPPED_MODELS), "samples", "scene-*")))


def test_the_peer_is_transformers_generate_with_xattns_avg_logprob():
    ours, peer = Captioner(CAPTIONER), TransformersCaptioner(CAPTIONER)
    pixels = [ours.load(path) for path in SAMPLES]
    expected = ours.caption_results(pixels, max_new_tokens=12)
    got = peer.caption_results(pixels, max_new_tokens=12)
    assert [r["caption"] for r in got] == [r["caption"] for r in expected]
    assert [r["avg_logprob"] for r in got] == pytest.approx([r["avg_logprob"] for r in expected], abs=1e-4)
    plain = peer.engine.generate(pixel_values=torch.stack(pixels), max_new_tokens=12)  # transformers' own call
    assert peer.tokenizer.batch_decode(plain, skip_special_tokens=True) == [r["caption"] for r in got]


def test_a_short_load_run(tmp_path, capsys):
    record_path, chart = tmp_path / "serve.json", tmp_path / "serve.png"
    code = main(["bench", "--serve", "--serve-captioner", CAPTIONER, "--serve-clients", "1", "4",
                 "--serve-seconds", "2", "--serve-soak-s", "3", "--serve-tokens", "8", "--threads", "1",
                 "--json", str(record_path), "--chart", str(chart)])
    out = capsys.readouterr().out
    assert code == 0, out
    with open(record_path) as f:
        record = json.load(f)
    kinds = [(s["kind"], s["weights"]) for s in record["servers"]]
    assert kinds == [("inflight", "exact"), ("one-at-a-time", "exact"), ("transformers", "exact")]
    for server in record["servers"]:
        assert [lv["clients"] for lv in server["levels"]] == [1, 4]
        for level in server["levels"]:
            assert level["failed"] == 0 and level["failures"] == {}
            assert level["requests"] > 0 and level["requests_per_s"] > 0
            assert level["p50_ms"] <= level["p95_ms"] <= level["p99_ms"]
            assert level["rss_mb"] and min(level["rss_mb"]) > 50
        assert sorted(server["captions"]) == sorted(os.path.basename(p) for p in SAMPLES)
        assert all(server["captions"].values())
    assert record["caption_parity"] == {"xattn in-flight (exact)": 1.0, "xattn one at a time (exact)": 1.0}
    assert set(record["ratios_at_32_clients"]) == set()  # no level of 32 clients in this run
    soak = record["soak"]
    assert soak["server"] == "xattn in-flight (exact)" and soak["failed"] == 0 and soak["requests"] > 0
    assert len(soak["rss_mb"]) >= 2 and record["failed"] == 0
    assert "failed or lost requests, whole run: 0" in out
    with open(chart, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_failures_are_counted_not_dropped():
    port = serve.free_port()  # nothing listens there
    level = run_level(f"http://127.0.0.1:{port}/v1/caption", "nobody", 2, 0.3, images(SAMPLES[:1]), {})
    assert level.requests == 0 and level.failed > 0
    assert level.failures == {"ConnectError": level.failed}


def test_ratios_pair_each_in_flight_server_with_its_own_format():
    def server(kind, weights, rate):
        s = serve.Server(serve._label(kind, weights), weights, kind)
        s.levels = [serve.Level(s.name, 32, 1.0, 1, 0, rate, 1.0, 1.0, 1.0)]
        return s

    report = serve.Report("m", [32], 1.0, 8, 32, 1, [], [
        server("inflight", "exact", 6.0), server("one-at-a-time", "exact", 2.0), server("transformers", "exact", 3.0),
        server("inflight", "int8+int8", 12.0), server("one-at-a-time", "int8+int8", 8.0)])
    assert serve.ratios(report) == {
        "xattn in-flight (exact) / one at a time (exact)": 3.0,
        "xattn in-flight (exact) / transformers": 2.0,
        "xattn in-flight (int8+int8) / one at a time (int8+int8)": 1.5,
        "xattn in-flight (int8+int8) / transformers": 4.0,
    }


@pytest.mark.parametrize("argv, message", [
    (["--serve-weights", "int9"], "--serve-weights 'int9'"),
    (["--serve-weights", "exact+fp4"], "--serve-weights 'exact+fp4'"),
    (["--quick"], "--serve runs alone; drop --quick"),
    (["--serve-images", "no-such.png"], "no such file no-such.png"),
])
def test_bad_options_are_one_line(argv, message, capsys):
    assert main(["bench", "--serve", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err

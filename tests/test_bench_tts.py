"""`xattn bench --tts` at a tiny shape: the report's structure, and that the codes really are compared with coqui's
own (timings themselves are never asserted: these machines are noisy).

coqui's own decoding runs on transformers 4.57 in a subprocess: on the 4.57 line that is this interpreter, on 5.x
the checkout's .venv457 where it exists (as .ci/run makes it). The comparison itself is also tested without one:
coqui's column replaced by xattn's own exact codes, then by the same codes with one changed.
"""

import importlib.util
import json
import os
import sys
import types

import pytest
import torch
import transformers

if importlib.util.find_spec("TTS") is None:
    pytest.skip("coqui-tts is not installed (pip install -e '.[tts-pipelines]')", allow_module_level=True)

from xattn.bench import tts  # noqa: E402
from xattn.cli import main  # noqa: E402

TINY = ["--tts-layers", "2", "--tts-width", "64", "--tts-heads", "4", "--tts-tokens", "12", "--tts-text-tokens", "8",
        "--repeats", "1", "--threads", "1"]
SHAPE = tts.Shape(layers=2, width=64, heads=4, tokens=12, text_tokens=8)
ENGINES = ["coqui", "exact", "packed", "int8"]


def venv_457():
    if int(transformers.__version__.split(".")[0]) < 5:
        return sys.prefix  # this interpreter is the 4.57 line
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    venv = os.path.join(checkout, ".venv457")
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        pytest.skip("no transformers 4.57 environment (.venv457) to run coqui's own decoding in")
    return venv


def bench(tmp_path, *extra):
    path = tmp_path / "tts.json"
    code = main(["bench", "--tts", *TINY, "--json", str(path), *extra])
    with open(path) as f:
        return code, json.load(f)


def table_of(out: str) -> str:
    """The printed table, without the progress lines before it."""
    return out[out.index("\nrow "):]


def check_structure(record):
    results = record["results"]
    assert [(r["row"], r["engine"]) for r in results] == [(row, e) for row in tts.ROWS for e in ENGINES]
    assert record["codes_per_second_of_audio"] == pytest.approx(22050 / 1024)  # coqui's XttsArgs
    audio_s = 12 / (22050 / 1024)
    for r in results:
        if r["error"]:
            continue
        assert r["seconds"] > 0 and r["tokens"] == 12
        assert r["rows"] == (1 if r["row"] == "B=1 greedy" else 4)
        assert r["codes_per_s"] == pytest.approx(r["rows"] * 12 / r["seconds"])
        assert r["real_time_factor"] == pytest.approx(r["seconds"] / audio_s)
        if r["engine"] == "int8":
            assert 0 <= r["agreement_with_exact"] <= 1 and r["tokens_equal_to_coqui"] is None
    assert record["shape"]["layers"] == 2 and len(record["weights_sha256"]) == 64


def test_bench_against_coquis_own_decoding_on_transformers_4_57(tmp_path, capsys):
    code, record = bench(tmp_path, "--tts-venv", venv_457())
    check_structure(record)
    assert record["coqui_subprocess"]["transformers"].startswith("4.57")  # the hashes matched: no "error"
    assert "error" not in record["coqui_subprocess"]
    fp32 = [r for r in record["results"] if r["engine"] in ("exact", "packed")]
    assert len(fp32) == 4 and all(r["tokens_equal_to_coqui"] is True for r in fp32)
    assert all(r["error"] is None for r in record["results"])
    assert code == 0
    table = table_of(capsys.readouterr().out)
    assert table.count("same as coqui") == 4 and "x coqui" in table and "RTF" in table


@pytest.fixture(scope="module")
def own_codes():
    """What a faithful coqui column holds: xattn's exact codes per row, with the same weights' hash."""
    gpt = tts.build_gpt(SHAPE)
    cond, text = tts.inputs(SHAPE)
    from xattn.integrations import xtts

    xtts.enable(types.SimpleNamespace(gpt=gpt))
    rows = {}
    with torch.inference_mode():
        for row in tts.ROWS:
            torch.manual_seed(tts.SEED)
            codes = gpt.generate(cond, text, **tts.generate_keywords(gpt, text, row, SHAPE.tokens))
            rows[row] = {"seconds": 1.0, "tokens": codes.tolist()}
    return {"transformers": "4.57.6 (stand-in)", "coqui_tts": "0.28.0", "weights_sha256": tts.weights_sha256(gpt),
            "rows": rows}


@pytest.mark.parametrize("changed", [False, True], ids=["the same codes", "one code changed"])
def test_every_fp32_engine_is_compared_code_for_code(tmp_path, monkeypatch, capsys, own_codes, changed):
    column = json.loads(json.dumps(own_codes))
    if changed:
        tokens = column["rows"]["B=1 greedy"]["tokens"]
        tokens[0][7] = (tokens[0][7] + 1) % 1024
    monkeypatch.setattr(tts, "run_coqui", lambda *args, **kwargs: json.loads(json.dumps(column)))
    code, record = bench(tmp_path, "--tts-venv", str(tmp_path))
    check_structure(record)
    equal = {(r["row"], r["engine"]): r["tokens_equal_to_coqui"] for r in record["results"]}
    greedy = [equal[("B=1 greedy", e)] for e in ("exact", "packed")]
    sampled = [equal[("gpt_batch_size 4 sampling", e)] for e in ("exact", "packed")]
    assert sampled == [True, True]
    assert greedy == ([False, False] if changed else [True, True])
    assert code == (1 if changed else 0)
    assert table_of(capsys.readouterr().out).count("DIFFER from coqui") == (2 if changed else 0)


def test_other_weights_in_the_subprocess_are_not_compared(tmp_path, monkeypatch, own_codes):
    column = dict(own_codes, weights_sha256="0" * 64)
    monkeypatch.setattr(tts, "run_coqui", lambda *args, **kwargs: column)
    code, record = bench(tmp_path, "--tts-venv", str(tmp_path))
    assert "hashes differ" in record["coqui_subprocess"]["error"]
    assert all(r["tokens_equal_to_coqui"] is None for r in record["results"]) and code == 0


def test_without_a_4_57_environment_the_coqui_column_is_skipped(tmp_path, capsys):
    code, record = bench(tmp_path, "--tts-venv", str(tmp_path / "missing"))
    coqui = [r for r in record["results"] if r["engine"] == "coqui"]
    assert all("no Python at" in r["error"] for r in coqui)
    assert all(r["tokens_equal_to_coqui"] is None for r in record["results"])
    assert code == 0  # nothing compared, nothing differs
    out = capsys.readouterr().out
    assert "coqui's own decoding: no Python at" in out and "could not run" in out


def test_bad_options_are_one_line_errors(capsys):
    assert main(["bench", "--tts", "--tts-width", "30", "--tts-heads", "4"]) == 2
    assert main(["bench", "--tts", "--tts-tokens", "603"]) == 2
    assert main(["bench", "--tts", "--chart", "x.png"]) == 2
    err = capsys.readouterr().err
    assert "multiple of --tts-heads" in err and "max_gen_mel_tokens" in err and "--tts runs alone" in err


def test_a_failing_subprocess_is_reported_not_fatal(tmp_path, capsys):
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\necho 'ImportError: no module named TTS'\nexit 3\n")
    python.chmod(0o755)
    code, record = bench(tmp_path, "--tts-venv", str(tmp_path / "venv"))
    assert "failed: ImportError: no module named TTS" in record["coqui_subprocess"]["error"]
    assert [r["engine"] for r in record["results"] if r["error"]] == ["coqui", "coqui"] and code == 0

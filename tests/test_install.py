"""What an installed xattn carries: a plain (non-editable) `pip install .` finds the shipped models without the
repository, `xattn --version` answers, and tokenizers are saved in a form both transformers lines read."""

import json
import os
import shutil
import subprocess
import sys

import pytest

import xattn
from xattn.cli import main
from xattn.tasks import SHIPPED_MODELS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "data", "samples", "scene-1.png")


def test_a_plain_install_finds_the_shipped_models_without_the_repository(tmp_path, capsys):
    source = tmp_path / "source"  # a copy of what git tracks: pip builds in the source folder, never in the repo
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        os.makedirs(source / os.path.dirname(name), exist_ok=True)
        shutil.copy2(os.path.join(REPO, name), source / name)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(target), str(source)], check=True, capture_output=True, timeout=600)
    shutil.rmtree(source)  # the installed copy must stand alone
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(SAMPLE, elsewhere / "scene.png")
    env = dict(os.environ, PYTHONPATH=str(target))
    script = ("import xattn, xattn.tasks as t; print(xattn.__file__); print(t.SHIPPED_MODELS); "
              "from xattn.cli import main; raise SystemExit(main(['caption', 'scene.png', '-o', '-', '--quiet']))")
    run = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr
    module, models, line = run.stdout.splitlines()
    assert module.startswith(str(target)) and models == str(target / "xattn" / "models")
    assert main(["caption", SAMPLE, "-o", "-", "--quiet"]) == 0
    assert json.loads(line)["caption"] == json.loads(capsys.readouterr().out)["caption"]


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"xattn {xattn.__version__}"


@pytest.mark.parametrize("name", ["scene-captioner", "digit-recognizer", "speaker"])
def test_shipped_tokenizers_name_a_class_both_transformers_lines_have(name):
    with open(os.path.join(SHIPPED_MODELS, name, "tokenizer_config.json")) as f:
        config = json.load(f)
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert not isinstance(config.get("extra_special_tokens"), list)  # 4.57 reads a dict there


def test_saved_tokenizers_load_back_the_same(tmp_path):
    from transformers import AutoTokenizer

    from xattn.datasets.tokenizer import train_caption_tokenizer
    from xattn.hf.portable import save_tokenizer
    from xattn.tasks.speech_synthesis import text_tokenizer

    text = "a small red circle above a large blue square"
    for name, tokenizer, sample in [("captions", train_caption_tokenizer([text] * 5, vocab_size=300), text),
                                    ("voices", text_tokenizer(["gb-male", "us-female"]), "<us-female> four two")]:
        save_tokenizer(tokenizer, str(tmp_path / name))
        with open(tmp_path / name / "tokenizer_config.json") as f:
            assert json.load(f)["tokenizer_class"] == "PreTrainedTokenizerFast"
        loaded = AutoTokenizer.from_pretrained(str(tmp_path / name))
        assert loaded(sample).input_ids == tokenizer(sample).input_ids
        assert loaded.all_special_ids == tokenizer.all_special_ids and loaded.pad_token_id == tokenizer.pad_token_id


def _options(parser, name="xattn"):
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                yield from _options(subparser, f"{name} {sub}")
        else:
            yield name, action


def test_every_option_says_what_it_does_and_lists_its_choices():
    import argparse

    from xattn.cli import parser

    options = list(_options(parser()))
    assert len(options) > 60
    for command, action in options:
        assert action.help and action.help != argparse.SUPPRESS, f"{command} {action.option_strings}: no help"
        if action.choices:  # argparse shows them as {a,b,c} unless a metavar hides them
            assert action.metavar is None, f"{command} {action.option_strings}: choices hidden"


def test_speech_tests_skip_without_espeak_ng_and_say_how_to_install_it(tmp_path):
    empty = tmp_path / "bin"  # a PATH where no program is found
    empty.mkdir()
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                          "tests/test_speech.py::test_espeak_speech_is_written_with_its_metadata"], cwd=REPO,
                         env=dict(os.environ, PATH=str(empty)), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "1 skipped" in run.stdout, run.stdout + run.stderr
    assert "apt-get install espeak-ng" in run.stdout and "error" not in run.stdout.lower()

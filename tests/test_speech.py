"""Speech: audio loading at any rate/channel count, the espeak-ng digits data, WER, the transcribe CLI."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from xattn.cli import main
from xattn.datasets.digits import (
    DIGITS,
    HELD_OUT_VARIANTS,
    TRAIN_VARIANTS,
    read_split,
    utterance_for,
    write_split,
)
from xattn.datasets.tokenizer import train_caption_tokenizer
from xattn.tasks.audio import input_features, load_audio
from xattn.tasks.transcription import (
    SpeechBatches,
    Transcriber,
    new_digit_recognizer,
    transcription_scores,
    word_errors,
)


def dominant_frequency(samples: np.ndarray, rate: int) -> float:
    spectrum = np.abs(np.fft.rfft(samples))
    return float(np.fft.rfftfreq(len(samples), 1 / rate)[spectrum.argmax()])


@pytest.mark.parametrize("rate,channels,subtype,ext", [(8000, 1, "PCM_16", "wav"), (44100, 2, "PCM_24", "flac"),
                                                        (22050, 2, "FLOAT", "wav"), (16000, 1, "VORBIS", "ogg")])
def test_any_rate_and_channel_count_loads_as_16k_mono(tmp_path, rate, channels, subtype, ext):
    t = np.arange(int(rate * 0.5)) / rate
    tone = 0.5 * np.sin(2 * np.pi * 440 * t)
    data = np.stack([tone] * channels, axis=1) if channels > 1 else tone
    path = str(tmp_path / f"tone.{ext}")
    soundfile.write(path, data, rate, subtype=subtype)
    samples = load_audio(path)
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) - 8000) <= 2  # 0.5 s at 16 kHz
    assert dominant_frequency(samples, 16000) == pytest.approx(440, abs=3)
    assert np.abs(samples).max() == pytest.approx(0.5, abs=0.05)


def test_bad_audio_files_get_a_message_naming_the_file(tmp_path):
    text = tmp_path / "notes.wav"
    text.write_text("not audio")
    empty = str(tmp_path / "empty.wav")
    soundfile.write(empty, np.zeros(0), 16000)
    nan = str(tmp_path / "nan.wav")
    soundfile.write(nan, np.full(1600, np.nan), 16000, subtype="FLOAT")
    for path, message in [(str(tmp_path / "missing.wav"), "no such file"), (str(text), "not a readable audio"),
                          (empty, "no samples"), (nan, "NaN")]:
        with pytest.raises(ValueError, match=message) as error:
            load_audio(path)
        assert path in str(error.value)


def test_digit_utterances_are_reproducible_and_split_by_variant():
    assert not set(TRAIN_VARIANTS) & set(HELD_OUT_VARIANTS)
    u = utterance_for(3, 7, TRAIN_VARIANTS)
    assert utterance_for(3, 7, TRAIN_VARIANTS) == u and utterance_for(3, 8, TRAIN_VARIANTS) != u
    lengths = set()
    for i in range(300):
        u = utterance_for(5, i, HELD_OUT_VARIANTS)
        words = u.text.split()
        lengths.add(len(words))
        assert set(words) <= set(DIGITS) and u.variant in HELD_OUT_VARIANTS
    assert lengths == {1, 2, 3, 4, 5, 6}


@pytest.fixture(scope="module")
def spoken(tmp_path_factory, espeak_ng):
    """Six utterances synthesized by espeak-ng (held-out variants), written like the real data set."""
    directory = str(tmp_path_factory.mktemp("digits") / "test")
    write_split(directory, 6, lambda i: utterance_for(99, i, HELD_OUT_VARIANTS), progress=False)
    return read_split(directory)


def test_espeak_speech_is_written_with_its_metadata(spoken):
    assert len(spoken) == 6
    for row in spoken:
        info = soundfile.info(row["path"])
        assert info.samplerate == 22050 and info.channels == 1
        seconds = info.frames / info.samplerate
        assert 0.2 < seconds < 1.5 * len(row["text"].split()) + 0.5
        assert row["variant"] in HELD_OUT_VARIANTS


def test_word_error_counts():
    assert word_errors("one two three", "one two three") == 0
    assert word_errors("one two three", "one three") == 1  # deletion
    assert word_errors("one two", "one two two") == 1  # insertion
    assert word_errors("one two three", "one four three") == 1  # substitution
    assert word_errors("one two", "") == 2
    scores = transcription_scores(["one two", "three four five six"], ["one two", "three five six"])
    assert scores == {"wer": pytest.approx(1 / 6), "exact_match": 0.5}


@pytest.fixture(scope="module")
def recognizer_checkpoint(tmp_path_factory, spoken):
    """The digit recognizer's architecture with random weights, saved as a standard checkpoint."""
    tokenizer = train_caption_tokenizer([" ".join(DIGITS)] * 20, vocab_size=300)
    torch.manual_seed(0)
    model, features = new_digit_recognizer(tokenizer)
    model.generation_config.max_new_tokens = 6
    path = str(tmp_path_factory.mktemp("recognizer"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    features.save_pretrained(path)
    return path


def test_training_batches_equal_the_feature_extractor_on_the_batch(recognizer_checkpoint, spoken):
    from transformers import AutoFeatureExtractor, AutoTokenizer

    features = AutoFeatureExtractor.from_pretrained(recognizer_checkpoint)
    batches = SpeechBatches(features, AutoTokenizer.from_pretrained(recognizer_checkpoint))
    batch = batches(spoken)
    batch_again = batches(spoken)  # from the kept features
    expected = input_features(features, [load_audio(r["path"]) for r in spoken])
    for name in ("input_features", "attention_mask"):
        assert torch.equal(batch[name], expected[name]) and torch.equal(batch_again[name], expected[name])
    assert (batch["labels"] == -100).any()  # transcripts of different lengths are padded and ignored


def test_transcriber_matches_transformers_and_batch_equals_one_by_one(recognizer_checkpoint, spoken):
    from transformers import SpeechEncoderDecoderModel

    transcriber = Transcriber(recognizer_checkpoint)
    waveforms = [transcriber.load(r["path"]) for r in spoken]
    assert len({len(w) for w in waveforms}) > 1  # different lengths: padding and the encoder mask matter
    batched = transcriber.transcribe(waveforms)
    assert batched == [transcriber.transcribe([w])[0] for w in waveforms]
    model = SpeechEncoderDecoderModel.from_pretrained(recognizer_checkpoint).eval()
    with torch.no_grad():
        expected = model.generate(**transcriber.features(waveforms))
    assert batched == [t.strip() for t in transcriber.tokenizer.batch_decode(expected, skip_special_tokens=True)]


def test_transcribe_cli_writes_jsonl_reports_bad_files_and_refuses_long_audio(recognizer_checkpoint, spoken,
                                                                               tmp_path, capsys):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF....WAVEfmt garbage")
    long = str(tmp_path / "long.wav")
    soundfile.write(long, np.zeros(16000 * 3), 16000)
    files = [spoken[0]["path"], str(bad), long, spoken[1]["path"]]
    out = str(tmp_path / "out.jsonl")
    code = main(["transcribe", *files, "--model", recognizer_checkpoint, "-o", out, "--max-seconds", "2",
                 "--quiet"])
    rows = [json.loads(line) for line in Path(out).read_text().splitlines()]
    assert code == 1 and [r["file"] for r in rows] == files
    assert "text" in rows[0] and "text" in rows[3]
    assert "not a readable audio" in rows[1]["error"] and "at most 2 s" in rows[2]["error"]
    assert "2 of 4 files failed" in capsys.readouterr().err
    # one file: just the text; a folder: every audio file in it
    assert main(["transcribe", spoken[0]["path"], "--model", recognizer_checkpoint]) == 0
    assert capsys.readouterr().out.strip() == rows[0]["text"]
    folder = os.path.dirname(spoken[0]["path"])
    assert main(["transcribe", folder, "--model", recognizer_checkpoint, "-o", str(tmp_path / "all.jsonl"),
                 "--quiet"]) == 0
    assert len((tmp_path / "all.jsonl").read_text().splitlines()) == len(spoken)


def test_a_captioner_is_not_a_transcriber(tmp_path, capsys):
    from conftest import tiny_captioner

    tiny_captioner().save_pretrained(str(tmp_path))
    assert main(["transcribe", "x.wav", "--model", str(tmp_path)]) == 2
    assert "not a speech model" in capsys.readouterr().err

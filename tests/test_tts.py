"""xattn's own TTS pieces: text checks, the codebook, chunked vocoding, streaming = whole, candidates from
one prefill, and the `xattn speak` command (on a tiny random model: these check the machinery, not the voice)."""

import warnings
from pathlib import Path

import numpy as np
import pytest
import soundfile
import torch

from xattn.cli import main
from xattn.tasks.audio_codes import CHUNK, HOP, LOOKAHEAD, N_MELS, SAMPLE_RATE, Codebook, log_mel
from xattn.tasks.speech_synthesis import Speaker, check_text, new_speaker, text_tokenizer


def test_text_is_normalised_or_refused_with_a_reason():
    assert check_text("  Four   TWO\tseven ") == "four two seven"
    for bad, message in [("", "empty"), ("   ", "empty"), ("4 2", "characters this voice cannot say"),
                         ("hello!", "'!'"), ("a" * 500, "at most")]:
        with pytest.raises(ValueError, match=message):
            check_text(bad)


def test_log_mel_of_a_tone_peaks_at_its_band():
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    low, high = (log_mel(0.5 * np.sin(2 * np.pi * f * t).astype(np.float32)) for f in (300, 3000))
    assert low.shape == (SAMPLE_RATE // HOP + 1, N_MELS)
    assert low.mean(0).argmax() < high.mean(0).argmax()


def test_codebook_encodes_to_the_nearest_centroid_and_round_trips_through_files(tmp_path):
    frames = np.random.default_rng(0).normal(size=(600, N_MELS)).astype(np.float32)
    codebook = Codebook.fit(frames, size=16)
    codes = codebook.encode(frames)
    distances = ((frames[:, None] - codebook.centroids[None]) ** 2).sum(-1)
    assert np.array_equal(distances.min(1), distances[np.arange(len(frames)), codes])
    codebook.save_pretrained(str(tmp_path))
    assert np.array_equal(Codebook.from_pretrained(str(tmp_path)).centroids, codebook.centroids)
    with pytest.raises(ValueError, match="no codebook"):
        Codebook.from_pretrained(str(tmp_path / "elsewhere"))


@pytest.fixture(scope="module")
def tiny_speaker(tmp_path_factory):
    """The TTS architecture with random weights and a random codebook, saved as a checkpoint."""
    path = str(tmp_path_factory.mktemp("speaker"))
    tokenizer = text_tokenizer(["one", "two"])
    torch.manual_seed(0)
    rng = np.random.default_rng(1)
    codebook = Codebook(rng.normal(-4, 2, size=(32, N_MELS)).astype(np.float32))
    model = new_speaker(tokenizer, codebook.size, max_codes=2 * CHUNK + 20)
    with torch.no_grad():  # every step's hidden state is b, and start/stop/pad score -20: the audio runs on
        ln_f = model.decoder.transformer.ln_f
        ln_f.weight.zero_()
        ln_f.bias.normal_()
        special = model.decoder.lm_head.weight[codebook.size:]  # tied with wte
        special.copy_(-20 * ln_f.bias / ln_f.bias.pow(2).sum())
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    codebook.save_pretrained(path)
    return path


def test_stream_concatenates_to_speak_and_starts_before_the_end(tiny_speaker):
    speaker = Speaker(tiny_speaker)
    kwargs = dict(max_new_tokens=2 * CHUNK + 10, do_sample=True, temperature=0.8)
    whole = speaker.speak("four two", "two", generator=torch.Generator().manual_seed(5), **kwargs)
    pieces = list(speaker.stream("four two", "two", generator=torch.Generator().manual_seed(5), **kwargs))
    assert len(pieces) >= 3  # audio arrived in chunks, the first one long before generation ended
    assert np.array_equal(np.concatenate(pieces), whole)


def test_candidates_share_one_prefill_and_differ(tiny_speaker):
    speaker = Speaker(tiny_speaker)
    candidates = speaker.codes("nine", "one", num_return_sequences=3, max_new_tokens=12, do_sample=True,
                               generator=torch.Generator().manual_seed(2))
    assert len(candidates) == 3 and len({tuple(c) for c in candidates}) > 1
    again = speaker.codes("nine", "one", num_return_sequences=3, max_new_tokens=12, do_sample=True,
                          generator=torch.Generator().manual_seed(2))
    assert all(np.array_equal(a, b) for a, b in zip(candidates, again))


def test_speak_command_writes_a_wav_and_refuses_bad_text(tiny_speaker, tmp_path, capsys):
    out = str(tmp_path / "out.wav")
    png = str(tmp_path / "mel.png")
    assert main(["speak", "four two", "--model", tiny_speaker, "-o", out, "--voice", "one", "--max-new-tokens",
                 "30", "--stream", "--spectrogram", png, "--seed", "1"]) == 0
    info = soundfile.info(out)
    assert info.samplerate == SAMPLE_RATE and info.frames > 0
    err = capsys.readouterr().err
    assert "first audio after" in err and "wrote" in err
    for text, message in [("", "empty"), ("4 2", "cannot say"), ("x" * 300, "at most")]:
        assert main(["speak", text, "--model", tiny_speaker, "-o", out]) == 2
        assert message in capsys.readouterr().err
    assert main(["speak", "hi", "--model", tiny_speaker, "-o", out, "--voice", "three"]) == 2
    assert "unknown voice" in capsys.readouterr().err
    assert main(["speak", "hi", "--model", str(tmp_path / "missing"), "-o", out]) == 2
    assert "no such checkpoint directory" in capsys.readouterr().err
    assert main(["speak", "hi", "--model", str(tmp_path), "-o", out]) == 2  # a folder, but no TTS in it
    assert "no codebook.npz" in capsys.readouterr().err


@pytest.mark.parametrize("frames", [10, 60, 400])
def test_spectrogram_title_fits_the_figure_for_any_allowed_text(frames):
    from xattn.tasks.audio_codes import spectrogram_figure
    from xattn.tasks.speech_synthesis import MAX_TEXT

    title = "one: " + ("seven " * 40)[:MAX_TEXT]
    fig = spectrogram_figure(np.zeros((frames, N_MELS), np.float32), title)
    renderer = fig.canvas.get_renderer()
    box = fig.axes[0].title.get_window_extent(renderer)
    width, height = fig.bbox.width, fig.bbox.height
    assert box.x0 >= 0 and box.x1 <= width and box.y0 >= 0 and box.y1 <= height, (box, width, height)
    assert "".join(fig.axes[0].get_title().split()) == "".join(title.split())  # wrapped, nothing dropped


@pytest.fixture(scope="module")
def shipped_codebook():
    return Codebook.from_pretrained(str(Path(__file__).parents[1] / "data" / "models" / "speaker"))


@pytest.mark.parametrize("count", [1, 2, CHUNK - 1, CHUNK, CHUNK + 1, CHUNK + LOOKAHEAD, CHUNK + LOOKAHEAD + 1, 137])
def test_each_code_vocodes_to_one_hop_of_audio_without_warnings(shipped_codebook, count):
    codes = np.random.default_rng(count).integers(0, shipped_codebook.size, count)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # librosa's "n_fft too large" came from vocoding short chunks
        audio = shipped_codebook.vocode(codes)
    assert audio.shape == (count * HOP,) and audio.dtype == np.float32 and np.isfinite(audio).all()
    assert np.abs(audio).max() > 0


def test_a_streamed_chunk_waits_only_for_its_look_ahead(shipped_codebook):
    count = 2 * CHUNK + 17
    consumed = 0

    def codes():
        nonlocal consumed
        for code in np.random.default_rng(3).integers(0, shipped_codebook.size, count):
            consumed += 1
            yield int(code)

    arrivals = [(consumed, len(piece)) for piece in shipped_codebook.vocode_stream(codes())]
    assert arrivals == [(CHUNK + LOOKAHEAD, CHUNK * HOP), (2 * CHUNK + LOOKAHEAD, CHUNK * HOP), (count, 17 * HOP)]


def _boundary_click(audio: np.ndarray, boundaries) -> float:
    """The largest sample-to-sample step within a hop of a chunk boundary, over the 99.9th percentile of the
    steps elsewhere (away from the ends): above 1, a boundary stands out as a click."""
    steps = np.abs(np.diff(audio))
    near = np.zeros(len(steps), dtype=bool)
    for boundary in boundaries:
        near[boundary - HOP : boundary + HOP] = True
    elsewhere = ~near
    elsewhere[: 2 * HOP] = elsewhere[-2 * HOP :] = False
    return float(steps[near].max() / np.percentile(steps[elsewhere], 99.9))


def test_streamed_chunks_join_without_a_click(shipped_codebook):
    loud = int(shipped_codebook.magnitudes.sum(1).argmax())  # a steady tone: any seam would show
    codes = [loud] * (3 * CHUNK)
    boundaries = [CHUNK * HOP, 2 * CHUNK * HOP]
    assert _boundary_click(shipped_codebook.vocode(codes), boundaries) < 1.0
    # chunks vocoded apart (each its own phase, as streaming did before) do click: the measure can fail
    apart = np.concatenate([shipped_codebook.vocode(codes[i : i + CHUNK]) for i in range(0, len(codes), CHUNK)])
    assert _boundary_click(apart, boundaries) > 1.0

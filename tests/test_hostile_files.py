"""Hostile input files, built here byte by byte: a WAV header's sample rate, float samples near float32's
largest value, FIFOs and folders where files are expected, Pillow's own ValueErrors, a FLAC of unknown length and
signed 32-bit images. Each is a one-line refusal naming the file, or a correct result, through the loaders the CLI
and the server use (Transcriber.load, Captioner.load, serve's Uploads.load) and the CLI itself."""

import contextlib
import errno
import io
import json
import math
import os
import struct
import subprocess
import sys
import threading
import tracemalloc
import zlib

import numpy as np
import pytest
import soundfile
from PIL import Image
from test_hostile_input import _one_line  # tests/ is on sys.path (pytest puts it there)

from xattn.cli import main
from xattn.tasks.audio import load_audio, to_mono
from xattn.tasks.vision import load_image

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
XATTN = os.path.join(os.path.dirname(sys.executable), "xattn")
SPOKEN = os.path.join(REPO, "data", "samples", "digits-0.wav")  # 22050 Hz, mono, a spoken digit string


def _wav(path, rate: int, frames: int = 100, channels: int = 1) -> str:
    """A 16-bit PCM WAV whose header says `rate` (any uint32), with `frames` frames of a quiet ramp."""
    data = (np.arange(frames * channels) % 200 - 100).astype("<i2").tobytes()
    header = struct.pack("<IHHIIHH", 16, 1, channels, rate, (rate * 2 * channels) & 0xFFFFFFFF, 2 * channels, 16)
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + header + b"data"
                + struct.pack("<I", len(data)) + data)
    return str(path)




def _peak_bytes(call):
    """call()'s result and the peak of Python-tracked memory (numpy's arrays included) it allocated."""
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.fixture(scope="module")
def transcriber():
    from xattn.tasks.transcription import Transcriber

    return Transcriber()


# ---- 1. the sample rate -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("rate", [768_001, 4_000_037, 2_147_483_647])
def test_a_header_rate_over_768k_is_refused_in_one_line(tmp_path, transcriber, rate):
    path = _wav(tmp_path / f"r{rate}.wav", rate)
    with pytest.raises(ValueError) as refused:
        transcriber.load(path)
    assert str(refused.value) == f"{path}: sample rate {rate} Hz is outside 1 Hz-768 kHz"
    with pytest.raises(ValueError, match=r"^sample rate 4000037 Hz is outside 1 Hz-768 kHz$"):
        to_mono(np.zeros(100, np.float32), 4_000_037)
    with pytest.raises(ValueError, match=r"^sample rate 0 Hz is outside 1 Hz-768 kHz$"):
        to_mono(np.zeros(100, np.float32), 0)


def test_a_header_rate_is_refused_before_the_samples_are_read(tmp_path, transcriber, monkeypatch):
    import xattn.tasks.audio as audio

    path = _wav(tmp_path / "fast.wav", 4_000_037)
    monkeypatch.setattr(audio, "_read", lambda *a: pytest.fail("read the samples of a refused file"))
    with pytest.raises(ValueError, match="outside 1 Hz-768 kHz"):
        transcriber.load(path)


@pytest.mark.parametrize("rate", [44_101, 383_999, 767_999, 1])
def test_a_rate_without_a_small_ratio_resamples_in_bounded_memory(tmp_path, rate):
    """Coprime with 16 kHz: scipy's polyphase filter would have 20 * rate taps (0.3 GB at 44,101 Hz, 0.65 GB at
    383,999 Hz measured); FFT resampling costs a few copies of the clip."""
    frames = max(rate // 2, 10)
    path = _wav(tmp_path / "odd.wav", rate, frames=frames)
    out, peak = _peak_bytes(lambda: load_audio(path, 16_000, max_seconds=20))
    assert out.dtype == np.float32 and len(out) == math.ceil(frames * 16_000 / rate)
    assert np.isfinite(out).all()
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB to resample {frames} frames"


def test_a_tone_at_a_coprime_rate_is_the_same_tone_at_16k():
    rate, seconds = 44_101, 1.0
    t = np.arange(int(rate * seconds)) / rate
    out = to_mono(np.sin(2 * np.pi * 440 * t).astype(np.float32), rate)
    expected = np.sin(2 * np.pi * 440 * np.arange(len(out)) / 16_000)
    middle = slice(800, len(out) - 800)  # away from the ends (FFT resampling treats the clip as periodic)
    assert len(out) == math.ceil(len(t) * 16_000 / rate)
    assert np.abs(out[middle] - expected[middle]).max() < 0.01


@pytest.mark.parametrize("rate", [8000, 11025, 16000, 22050, 24000, 32000, 44100, 48000, 88200, 96000, 176400,
                                  192000, 352800, 384000, 705600, 768000])
def test_every_common_rate_keeps_the_polyphase_filter(rate):
    from scipy.signal import resample_poly

    g = math.gcd(rate, 16_000)
    assert max(16_000 // g, rate // g) <= 1000
    samples = np.random.default_rng(rate).uniform(-0.5, 0.5, (rate // 10, 2)).astype(np.float32)
    expected = resample_poly(samples.astype(np.float64).mean(axis=1), 16_000 // g, rate // g) if rate != 16_000 \
        else samples.astype(np.float64).mean(axis=1)
    assert np.array_equal(to_mono(samples, rate), expected.astype(np.float32))


def test_a_memory_error_while_resampling_is_a_one_line_refusal(tmp_path, monkeypatch):
    import scipy.signal

    def exhausted(*args, **kwargs):
        raise MemoryError("Unable to allocate 320. GiB")

    monkeypatch.setattr(scipy.signal, "resample_poly", exhausted)
    path = _wav(tmp_path / "a.wav", 44_100, frames=4410)
    with pytest.raises(ValueError, match=r"a\.wav: too large to load in memory \(MemoryError\)$"):
        load_audio(path, 16_000, max_seconds=20)


def test_the_server_answers_a_fast_header_with_422_naming_the_upload(tmp_path, transcriber):
    from xattn.serve.limits import file_error
    from xattn.serve.runners import Uploads
    from xattn.tasks.transcription import AUDIO_EXTENSIONS

    data = open(_wav(tmp_path / "x.wav", 4_000_037), "rb").read()
    uploads = Uploads()
    try:
        with pytest.raises(ValueError) as refused:
            uploads.load(io.BytesIO(data), "clip.wav", AUDIO_EXTENSIONS, transcriber.load)
    finally:
        uploads.close()
    assert str(refused.value) == "clip.wav: sample rate 4000037 Hz is outside 1 Hz-768 kHz"
    assert file_error(str(refused.value)).status_code == 422


def test_the_cli_refuses_a_fast_header_in_one_line(tmp_path):
    path = _wav(tmp_path / "rate4m.wav", 4_000_037)
    run = subprocess.run([XATTN, "transcribe", path], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2
    _one_line(run.stderr, f"xattn transcribe: error: {path}: sample rate 4000037 Hz is outside 1 Hz-768 kHz")


# ---- 2. float samples near float32's largest value -------------------------------------------------------------
def _loud(tmp_path, channels: int) -> str:
    source, rate = soundfile.read(SPOKEN, dtype="float64")
    loud = (source / np.abs(source).max() * 3.3e38).astype(np.float32)
    path = str(tmp_path / f"loud{channels}.wav")
    soundfile.write(path, loud if channels == 1 else np.stack([loud] * channels, axis=1), rate, subtype="FLOAT")
    return path


@pytest.mark.parametrize("channels", [1, 2])
def test_samples_near_float32_max_transcribe_as_the_original(tmp_path, transcriber, channels):
    """The recognizer normalises loudness (per-utterance log-mel normalisation), so the same words at any
    loudness: the file is mixed and resampled (22050 Hz) in float64, never overflowing to inf."""
    loud = transcriber.load(_loud(tmp_path, channels))
    assert np.isfinite(loud).all() and 0.5 < np.abs(loud).max() < 1.5  # scaled to about full scale
    original = transcriber.transcribe_results([transcriber.load(SPOKEN)])[0]
    result = transcriber.transcribe_results([loud])[0]
    assert original["text"] and result["text"] == original["text"]


def test_a_loud_float_file_through_the_cli_gives_the_words(tmp_path):
    path = _loud(tmp_path, 2)
    run = subprocess.run([XATTN, "transcribe", path, SPOKEN, "-o", "-", "--quiet"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    loud, original = (json.loads(line) for line in run.stdout.splitlines())
    assert loud["file"] == path and loud["text"] and loud["text"] == original["text"]


def test_float64_samples_that_overflow_when_mixed_stay_finite():
    samples = np.full((1000, 2), 1e308)
    out = to_mono(samples, 16_000)
    assert out.dtype == np.float32 and np.isfinite(out).all() and np.allclose(out, 1.0)
    with pytest.raises(ValueError, match="^the audio contains NaN or infinite samples$"):
        to_mono(np.array([0.0, np.inf]), 16_000)


def test_ordinary_loudness_is_left_as_it_is():
    samples = np.random.default_rng(0).uniform(-3, 3, 1600).astype(np.float32)  # over full scale, but real
    assert np.array_equal(to_mono(samples, 16_000), samples)


# ---- 3. FIFOs, devices and folders where files are expected ----------------------------------------------------
@contextlib.contextmanager
def _rescued(fifo: str):
    """Unblocks anyone who opens `fifo` for reading (writes junk and closes), so a loader that opens it fails the
    test instead of hanging it; yields a list that holds True once someone was rescued."""
    rescued, stop = [], threading.Event()

    def watch():
        while not stop.wait(0.2):
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while nobody reads
            except OSError as error:
                if error.errno != errno.ENXIO:
                    return
                continue
            rescued.append(True)
            with contextlib.suppress(OSError):
                os.write(fd, b"not an image or audio")
            os.close(fd)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield rescued
    finally:
        stop.set()
        thread.join()


@pytest.mark.parametrize("loader", [load_image, load_audio])
@pytest.mark.parametrize("kind", ["fifo", "folder", "device", "link to a fifo"])
def test_only_a_regular_file_is_opened(tmp_path, loader, kind):
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    path = str(tmp_path / "x.png")
    if kind == "fifo":
        path = fifo
    elif kind == "folder":
        os.mkdir(path)
    elif kind == "device":
        os.symlink("/dev/zero", path)
    else:
        os.symlink(fifo, path)
    with _rescued(fifo) as rescued, pytest.raises(ValueError) as refused:
        loader(path)
    assert not rescued, "the loader opened the FIFO"
    assert str(refused.value).startswith(f"{path}: not a regular file (")
    assert len(str(refused.value).splitlines()) == 1


def test_a_missing_file_and_a_dangling_link_are_still_no_such_file(tmp_path):
    os.symlink(tmp_path / "gone.png", tmp_path / "dangling.png")
    for name in ("missing.png", "dangling.png"):
        for loader in (load_image, load_audio):
            with pytest.raises(ValueError, match=r"^.*" + name.replace(".", r"\.") + ": no such file$"):
                loader(str(tmp_path / name))


def test_a_folder_job_reports_a_fifo_and_a_folder_and_goes_on(tmp_path):
    folder = tmp_path / "f"
    folder.mkdir()
    Image.new("RGB", (64, 48), "red").save(folder / "a.png")
    os.mkfifo(folder / "b.png")
    (folder / "c.png").mkdir()
    Image.new("RGB", (64, 48), "blue").save(folder / "d.png")
    out = tmp_path / "f.jsonl"
    with _rescued(str(folder / "b.png")) as rescued:
        run = subprocess.run([XATTN, "caption", str(folder), "-o", str(out), "--quiet"], capture_output=True,
                             text=True, timeout=300)
    assert not rescued, "caption opened the FIFO"
    assert run.returncode == 1, run.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["file"] for r in rows] == [str(folder / n) for n in ("a.png", "b.png", "c.png", "d.png")]
    assert "caption" in rows[0] and "caption" in rows[3]
    assert rows[1]["error"] == f"{folder / 'b.png'}: not a regular file (a device, pipe or socket)"
    assert rows[2]["error"] == f"{folder / 'c.png'}: not a regular file (a folder)"
    assert "2 of 4 files failed" in run.stderr


@pytest.mark.parametrize("command,name", [("caption", "fifo.png"), ("transcribe", "fifo.wav")])
def test_the_cli_refuses_a_fifo_in_one_line(tmp_path, capsys, command, name):
    path = str(tmp_path / name)
    os.mkfifo(path)
    with _rescued(path) as rescued:
        assert main([command, path]) == 2
    assert not rescued
    _one_line(capsys.readouterr().err, f"xattn {command}: error: {path}: not a regular file")


def test_transcribe_calls_a_link_to_dev_zero_not_a_regular_file(tmp_path, capsys):
    path = str(tmp_path / "zero.wav")
    os.symlink("/dev/zero", path)
    assert main(["transcribe", path]) == 2
    _one_line(capsys.readouterr().err, f"{path}: not a regular file", "device")


# ---- 4. Pillow's own ValueErrors --------------------------------------------------------------------------------
def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_with(chunk: bytes) -> bytes:
    """A small PNG with `chunk` inserted before its image data."""
    buffer = io.BytesIO()
    Image.new("RGB", (16, 16), "green").save(buffer, format="PNG")
    png = buffer.getvalue()
    idat = png.index(b"IDAT") - 4
    return png[:idat] + chunk + png[idat:]


@pytest.mark.parametrize("chunk", [
    _chunk(b"zTXt", b"comment\0\0" + zlib.compress(b"a" * (4 << 20), 9)),
    _chunk(b"iCCP", b"profile\0\0" + zlib.compress(b"\0" * (4 << 20), 9)),
])
def test_a_png_chunk_that_inflates_past_pillows_limit_is_not_a_readable_image(tmp_path, chunk):
    path = tmp_path / "bomb.png"
    path.write_bytes(_png_with(chunk))
    with pytest.raises(ValueError) as refused:
        load_image(str(path))
    message = str(refused.value)
    assert message.startswith(f"{path}: not a readable image (ValueError: ") and "MAX_TEXT_CHUNK" in message
    assert len(message.splitlines()) == 1


def test_a_pillow_value_error_through_the_cli_names_the_file(tmp_path, capsys):
    path = tmp_path / "ztxt.png"
    path.write_bytes(_png_with(_chunk(b"zTXt", b"c\0\0" + zlib.compress(b"a" * (4 << 20), 9))))
    assert main(["caption", str(path)]) == 2
    _one_line(capsys.readouterr().err, f"xattn caption: error: {path}: not a readable image (ValueError: ")


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_xattns_own_bomb_message_still_passes_as_is(tmp_path):
    ihdr = struct.pack(">IIBBBBB", 11000, 10000, 8, 2, 0, 0, 0)  # over xattn's limit, under Pillow's error
    path = tmp_path / "declared.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(b"\0" * 10))
                     + _chunk(b"IEND", b""))
    with pytest.raises(ValueError, match=r"^.*declared\.png: image declares 11000x10000 pixels, over the "
                                         r"100000000 limit \(a decompression bomb\?\)$"):
        load_image(str(path))


# ---- 5. a FLAC of unknown length; signed 32-bit images ---------------------------------------------------------
def _flac_of_unknown_length(path, seconds: float) -> str:
    """A FLAC whose STREAMINFO's total_samples is 0 ("unknown", legal for a streamed FLAC)."""
    rate = 16_000
    tone = 0.3 * np.sin(2 * np.pi * 300 * np.arange(int(rate * seconds)) / rate)
    soundfile.write(path, tone, rate, format="FLAC", subtype="PCM_16")
    data = bytearray(open(path, "rb").read())
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0  # STREAMINFO first
    fields = int.from_bytes(data[18:26], "big") & ~((1 << 36) - 1)  # rate, channels, bits, total_samples (36)
    data[18:26] = fields.to_bytes(8, "big")
    open(path, "wb").write(bytes(data))
    assert soundfile.info(path).frames >= 2**62  # libsndfile: unknown
    return str(path)


def test_a_flac_of_unknown_length_is_read_to_its_end(tmp_path, transcriber):
    path = _flac_of_unknown_length(tmp_path / "stream.flac", 1.5)
    out = load_audio(path)
    assert len(out) == 24_000
    assert np.allclose(out, 0.3 * np.sin(2 * np.pi * 300 * np.arange(24_000) / 16_000), atol=1e-3)
    assert len(transcriber.load(path)) == 24_000


def test_a_flac_of_unknown_length_over_max_seconds_says_so(tmp_path, transcriber, capsys):
    path = _flac_of_unknown_length(tmp_path / "long.flac", 25)
    with pytest.raises(ValueError) as refused:
        transcriber.load(path)
    assert str(refused.value) == (f"{path}: over 20 s of audio (length not in its header); this model transcribes "
                                  "at most 20 s (split it, or raise --max-seconds)")
    assert main(["transcribe", path]) == 2
    _one_line(capsys.readouterr().err, f"{path}: over 20 s of audio (length not in its header)")


def test_signed_32_bit_images_scale_by_their_range(tmp_path):
    values = np.array([[-1000, 0, 1000], [-500, 500, -1000]], dtype=np.int32)
    path = tmp_path / "signed.tiff"
    Image.fromarray(values).save(path)
    assert Image.open(path).mode == "I"
    gray = np.asarray(load_image(str(path)))[..., 0]
    assert gray.tolist() == [[0, 127, 255], [63, 191, 0]]


def test_unsigned_and_non_negative_images_scale_as_before(tmp_path):
    values = np.array([[0, 250, 1000]], dtype=np.int32)
    Image.fromarray(values).save(tmp_path / "i.tiff")
    assert np.asarray(load_image(str(tmp_path / "i.tiff")))[0, :, 0].tolist() == [0, 63, 255]
    Image.fromarray(np.array([[0, 300, 600]], dtype=np.uint16)).save(tmp_path / "i16.png")
    assert np.asarray(load_image(str(tmp_path / "i16.png")))[0, :, 0].tolist() == [0, 127, 255]
    Image.fromarray(np.full((2, 2), -7, dtype=np.int32)).save(tmp_path / "flat.tiff")
    assert np.asarray(load_image(str(tmp_path / "flat.tiff"))).max() == 0

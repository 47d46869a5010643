"""xattn beside transformers' own pipelines on the shipped models: `xattn transcribe` gives the text of
`pipeline("automatic-speech-recognition")` on every clip, fed the very same features, and the shipped captioner
loads in `pipeline("image-to-text")` and captions the samples as `xattn caption` does. Everything loads from the
local folders; nothing is downloaded."""

import dataclasses
import glob
import json
import logging
import os

import numpy as np
import pytest
import soundfile
import torch
import transformers
from transformers import GenerationConfig, pipeline

from xattn.cli import main
from xattn.datasets.digits import HELD_OUT_VARIANTS, synthesize, utterance_for
from xattn.tasks import SHIPPED_MODELS
from xattn.tasks.audio import load_audio
from xattn.tasks.transcription import DEFAULT_MODEL, Transcriber

SAMPLES = os.path.join(os.path.dirname(SHIPPED_MODELS), "samples")
CAPTIONER = os.path.join(SHIPPED_MODELS, "scene-captioner")


@pytest.fixture(scope="module")
def clips(tmp_path_factory, espeak_ng) -> list[str]:
    """16 kHz float wav files of espeak-ng digit strings by voices the recognizer never heard: six at ordinary
    speed and six fast (espeak-ng -s 230 and up, faster than any training clip), 1-6 digits, so that their frame
    counts fall on every remainder of the feature extractor's stacks of 4. Fast speech is where transformers' cut of
    the last frames most often changes the text: the first three fast ones came out differently with
    `pad_to_stride` when this was written."""
    directory = tmp_path_factory.mktemp("clips")
    ordinary = [utterance_for(13, i, HELD_OUT_VARIANTS) for i in range(6)]
    fast = [dataclasses.replace(utterance_for(17, i, HELD_OUT_VARIANTS), speed=230 + i % 40)
            for i in (33, 65, 81, 0, 1, 2)]
    paths = []
    for i, utterance in enumerate(ordinary + fast):
        spoken = str(directory / f"{i}-espeak.wav")
        synthesize(utterance, spoken)
        paths.append(str(directory / f"{i}.wav"))
        soundfile.write(paths[-1], load_audio(spoken), 16_000, subtype="FLOAT")  # read back bit for bit
    return paths


@pytest.fixture(scope="module")
def recognizer_pipeline():
    # the model's own length limit, said again: transformers 4.57's pipeline puts its defaults (max_new_tokens=256,
    # num_beams=5) above the model's generation config, and 256 tokens of beam search run past the decoder's 32
    # positions (IndexError); 5.x keeps the model's 16 by itself
    limit = GenerationConfig.from_pretrained(DEFAULT_MODEL).max_new_tokens
    return pipeline("automatic-speech-recognition", model=DEFAULT_MODEL, max_new_tokens=limit)


def _transcribe_cli(files: list[str], out, *flags: str) -> list[str]:
    assert main(["transcribe", *files, "-o", str(out), "--quiet", "--batch-size", "5", *flags]) == 0
    return [json.loads(line)["text"] for line in out.read_text().splitlines()]


def test_transcribe_gives_the_asr_pipelines_text_on_every_clip(clips, recognizer_pipeline, tmp_path):
    waveforms = [load_audio(path) for path in clips]
    plain = [recognizer_pipeline(w)["text"] for w in waveforms]
    # The pipeline decodes with 5 beams unless the model's generation_config.json names num_beams; the shipped one
    # says 1, which transformers 5 honours (then the pipeline decodes as `generate` and xattn do), while 4.57 puts
    # its own 5 above it. Either way xattn's padded batches of 5 give each clip's text alone, greedy and 5 beams.
    greedy = [recognizer_pipeline(w, num_beams=1)["text"] for w in waveforms]
    assert _transcribe_cli(clips, tmp_path / "greedy.jsonl") == greedy
    beams = [recognizer_pipeline(w, num_beams=5)["text"] for w in waveforms]
    assert _transcribe_cli(clips, tmp_path / "beams.jsonl", "--num-beams", "5") == beams
    assert plain == (greedy if transformers.__version__.startswith("5.") else beams)


def test_the_transcribers_features_are_the_pipelines(clips, recognizer_pipeline):
    transcriber, stride_padded = Transcriber(), Transcriber(pad_to_stride=True)
    frames_cut = 0
    for path in clips:
        waveform = load_audio(path)
        theirs = next(iter(recognizer_pipeline.preprocess(waveform)))
        ours = transcriber.features([waveform])
        for name in ("input_features", "attention_mask"):
            assert torch.equal(ours[name], theirs[name])
        frames_cut += stride_padded.features([waveform])["input_features"].shape[1] > ours["input_features"].shape[1]
    assert 0 < frames_cut < len(clips)  # the clips have both kinds of length; pad_to_stride differs on some


def test_the_shortest_clip_the_transcriber_takes_is_the_shortest_the_pipeline_takes(recognizer_pipeline, tmp_path):
    transcriber = Transcriber()
    shortest = transcriber.min_samples
    noise = np.random.default_rng(1).standard_normal(shortest).astype(np.float32)
    assert transcriber.transcribe([noise]) == [recognizer_pipeline(noise, num_beams=1)["text"]]
    shorter = next(iter(recognizer_pipeline.preprocess(noise[:-1])))
    assert shorter["input_features"].shape[1] == 0  # nothing for the encoder: the pipeline fails on it too
    soundfile.write(short := str(tmp_path / "short.wav"), noise[:-1], 16_000, subtype="FLOAT")
    with pytest.raises(ValueError, match="too short"):
        transcriber.load(short)


def test_the_shipped_captioner_captions_as_xattn_in_the_image_to_text_pipeline(tmp_path, caplog):
    images = sorted(glob.glob(os.path.join(SAMPLES, "scene-*")))
    out = tmp_path / "captions.jsonl"
    assert main(["caption", *images, "-o", str(out), "--quiet"]) == 0
    expected = [json.loads(line)["caption"] for line in out.read_text().splitlines()]
    # transformers 5 warns that "image-to-text" is now "image-text-to-text" through a malformed logging call (a
    # stray UserWarning argument): printed as a logging error, it is raised under pytest
    caplog.set_level(logging.ERROR, logger="transformers.pipelines")
    captioner = pipeline("image-to-text", model=CAPTIONER)
    if type(captioner).__name__ == "ImageToTextPipeline":  # transformers 4.x: the image alone
        got = [captioner(image)[0]["generated_text"] for image in images]
    else:
        # transformers 5 serves "image-to-text" with its image-text-to-text pipeline, which takes every image with a
        # text prompt for the decoder to continue: here the decoder's start token (processor_config.json names
        # the generic processor that joins the checkpoint's image processor and tokenizer)
        start = captioner.processor.tokenizer.convert_ids_to_tokens(
            captioner.model.generation_config.decoder_start_token_id)
        got = [captioner(images=image, text=start, return_full_text=False)[0]["generated_text"] for image in images]
    assert got == expected

"""`xattn train` / recipes/finetune.py: fine-tune (or train from scratch) an image captioner, a speech
recognizer or a speaker on a data folder, through xattn.train (checkpoints, --resume, torchrun).

Everything a user hands it is checked before any training: numeric options by their argparse types (built from
TrainConfig.LIMITS), the data folders' metadata.jsonl (xattn.datasets.metadata: every file inside its folder),
transcripts against the decoder's length, checkpoints through xattn.hf (never code shipped with them)."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import re
import shutil

import numpy as np
import torch

NEW_MODELS = ("new-scene-captioner", "new-digit-recognizer", "new-speaker")


def add_arguments(parser) -> None:
    from ..argtypes import THREADS, integer, number
    from .loop import TrainConfig

    parser.add_argument("--data", required=True, help="directory with train/ and validation/ (imagefolders, or "
                        "audio files + metadata.jsonl)")
    parser.add_argument("--model", default="new-scene-captioner", help="checkpoint directory or hub id, or "
                        "new-scene-captioner / new-digit-recognizer / new-speaker")
    parser.add_argument("--revision", help="with a hub id: the branch, tag or commit to start from (default: main)")
    parser.add_argument("--out", required=True, help="checkpoints, loss.png and final/ go here")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    parser.add_argument("--eval-limit", type=integer(1), default=500,
                        help="validation examples scored at each evaluation")
    parser.add_argument("--patch-size", type=_patch_size, default=8,
                        help="new-scene-captioner: ViT patch size (divides the 64 px image)")
    parser.add_argument("--threads", type=THREADS, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--augment", action="store_true",
                        help="captioners and recognizers: corrupt each training example afresh each time it is "
                        "used, as real files are (images, xattn.datasets.augment: JPEG q30-95 with 4:2:0 or 4:4:4 "
                        "chroma, WebP, resizing to 32-1024 px, slight blur and noise, brightness/contrast jitter; "
                        "30%% left as they are; speech, xattn.datasets.augment_audio: 0-1 s of silence before and "
                        "after, a noise floor, white noise at 10-40 dB SNR, the 8 kHz band, gain -20 to +6 dB; "
                        "25%% left clean); drawn from --seed, so --resume stays exact")
    for field in dataclasses.fields(TrainConfig):
        if field.name == "output_dir":
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = type(field.default)
        if kind is bool:
            parser.add_argument(flag, action="store_true", help=CONFIG_HELP[field.name])
            continue
        help_text = f"{CONFIG_HELP[field.name]} (default {field.default})"
        if field.name in TrainConfig.LIMITS:
            low, high, low_open = TrainConfig.LIMITS[field.name]
            check = integer(low, high) if kind is int else number(low, high, low_open=low_open)
            parser.add_argument(flag, type=check, default=field.default, help=help_text)
        elif field.name == "mixed_precision":
            parser.add_argument(flag, choices=TrainConfig.MIXED_PRECISION, default=field.default, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=field.default, help=help_text)


CONFIG_HELP = {  # TrainConfig's fields as options
    "max_steps": "optimizer steps in all",
    "batch_size": "examples per optimizer step",
    "learning_rate": "peak learning rate (AdamW)",
    "warmup_steps": "steps of linear warm-up, then cosine decay to 10%%",
    "weight_decay": "AdamW's weight decay",
    "max_grad_norm": "gradients are clipped to this norm",
    "eval_every": "steps between evaluations on the validation split (and loss.png updates)",
    "save_every": "steps between checkpoints",
    "seed": "seeds python's random, numpy, torch and the data order",
    "gradient_checkpointing": "recompute activations in the backward pass: less memory, more time",
    "mixed_precision": "auto: bf16 autocast where the CPU has native bf16, else fp32; bf16: always; no: fp32",
    "keep_checkpoints": "how many of the newest checkpoints to keep",
}


def _patch_size(text: str) -> int:
    import argparse

    from ..argtypes import integer
    from ..datasets.scenes import IMAGE_SIZE

    value = integer(1, IMAGE_SIZE)(text)
    if IMAGE_SIZE % value:
        divisors = [d for d in range(1, IMAGE_SIZE + 1) if IMAGE_SIZE % d == 0]
        raise argparse.ArgumentTypeError(f"must divide the {IMAGE_SIZE} px image ({', '.join(map(str, divisors))}), "
                                         f"got {text}")
    return value


def main(args) -> int:
    from .loop import TrainConfig

    for split in ("train", "validation"):
        if not os.path.isdir(os.path.join(args.data, split)):
            raise ValueError(f"{args.data}: no {split}/ folder (make one with recipes/make_scenes.py, "
                             "recipes/make_digits.py or recipes/make_tts_data.py)")
    if args.model.startswith("new-") and args.model not in NEW_MODELS and not os.path.isdir(args.model):
        raise ValueError(f"unknown --model {args.model!r}: new-scene-captioner, new-digit-recognizer, new-speaker "
                         "or a checkpoint")
    if args.model in NEW_MODELS[:2] and not os.path.isdir(os.path.join(args.data, "tokenizer")):
        raise ValueError(f"{args.data}: no tokenizer/ folder for a new model")
    if args.model not in NEW_MODELS:
        from ..hf.hub import resolve_checkpoint

        args.model = resolve_checkpoint(args.model, args.revision)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ValueError(f"--out {args.out}: is a file; name a folder")
    _refuse_to_overwrite_a_run(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = TrainConfig(output_dir=args.out, **{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                                                 if f.name != "output_dir"})
    run(args, config)
    return 0


def _refuse_to_overwrite_a_run(args) -> None:
    """A run without --resume into a folder holding one would replace its checkpoints and final/ at its first save:
    refused before any work (hours of training are not lost to a forgotten flag)."""
    from .checkpoints import LATEST

    if args.resume or not os.path.isdir(args.out):
        return
    held = sorted(n for n in os.listdir(args.out) if n == LATEST or n == "final" or re.fullmatch(r"checkpoint-\d+", n))
    if held:
        raise ValueError(f"--out {args.out}: already holds a run ({', '.join(held[:4])}); pass --resume to continue "
                         "it, or name another folder (delete this one to start over)")


def run(args, config):
    from ..hf.loading import load_config, load_tokenizer
    from ..hf.portable import save_tokenizer
    from .checkpoints import replace_directory, writing
    from .loop import seed_everything, train

    kinds = {"new-scene-captioner": _images, "new-digit-recognizer": _speech, "new-speaker": _tts,
             "vision-encoder-decoder": _images, "speech-encoder-decoder": _speech, "encoder-decoder": _tts}
    kind = args.model if args.model in NEW_MODELS else load_config(args.model).model_type
    if kind not in kinds:
        raise ValueError(f"{args.model}: a {kind} checkpoint; train takes vision-, speech- or text-to-speech "
                         "encoder-decoder models")
    if args.augment and kinds[kind] is _tts:
        raise ValueError(f"--augment corrupts training images and speech; {args.model} is a speaker, whose audio is "
                         "what it learns to say: leave --augment out")
    if args.model == "new-speaker":
        from ..datasets.digits import TTS_VOICES
        from ..tasks.speech_synthesis import text_tokenizer

        tokenizer = text_tokenizer(sorted(TTS_VOICES))
    elif args.model in NEW_MODELS:
        tokenizer = load_tokenizer(os.path.join(args.data, "tokenizer"))
    else:
        tokenizer = load_tokenizer(args.model)
    seed_everything(config.seed)  # a new model's initial weights
    model, preprocessor, train_set, collate, evaluate = kinds[kind](args, tokenizer)
    same_on_resume = {"data": os.path.realpath(args.data), "augment": bool(args.augment),
                      "model": args.model if args.model in NEW_MODELS else os.path.realpath(args.model)}
    train(model, train_set, collate, config, evaluate=evaluate, resume=args.resume, run_options=same_on_resume)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, process 0 saves
        return
    final = os.path.join(config.output_dir, "final")
    # complete under a temporary name, then renamed: a kill or a full disk never leaves a partial final/
    with writing(final, "save the final model", "the last checkpoint is intact: free some space and rerun with "
                 "--resume", cleanup=final + ".tmp"):
        shutil.rmtree(final + ".tmp", ignore_errors=True)
        model.save_pretrained(final + ".tmp")
        save_tokenizer(tokenizer, final + ".tmp")
        preprocessor.save_pretrained(final + ".tmp")
        replace_directory(final + ".tmp", final)
    print(f"saved {final}")


class ImageRows:
    """The rows of a checked imagefolder split as {"image": RGB image, "text"}, each image decoded when asked
    for by xattn.vision.load_image (as the Captioner reads images: one-line errors naming the file).

    augment: each image comes corrupted afresh (xattn.datasets.augment) every time it is asked for."""

    def __init__(self, rows: list[dict], augment: bool = False):
        self.rows, self.augment = rows, augment

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        from ..tasks.vision import load_image

        row = self.rows[index]
        image = load_image(row["path"])
        if self.augment:
            from ..datasets.augment import corrupt

            # one draw from python's random per example: the training loop seeds it and --resume restores it, so a
            # resumed run corrupts alike; the index keeps torchrun's processes (seeded alike) from corrupting alike
            image = corrupt(image, random.Random(f"{random.getrandbits(64)}:{index}"))
        return {"image": image, "text": row["text"], "path": row["path"]}


def _images(args, tokenizer):
    from transformers import VisionEncoderDecoderModel

    from ..datasets.digits import read_split
    from ..hf.loading import load_image_processor, load_model
    from ..hf.model import from_hf
    from ..tasks.captioning import CaptionBatches, caption_accuracy, new_scene_captioner

    train_rows = read_split(os.path.join(args.data, "train"))
    validation = ImageRows(read_split(os.path.join(args.data, "validation")))
    if args.model == "new-scene-captioner":
        model, processor = new_scene_captioner(tokenizer, patch_size=args.patch_size)
    else:
        processor = load_image_processor(args.model)
        model = load_model(VisionEncoderDecoderModel, args.model)
    _check_text_lengths(train_rows, tokenizer, model)

    def evaluate(m):
        return caption_accuracy(from_hf(m), processor, tokenizer, validation, limit=args.eval_limit)

    return model, processor, ImageRows(train_rows, args.augment), CaptionBatches(processor, tokenizer), evaluate


def _speech(args, tokenizer):
    from transformers import SpeechEncoderDecoderModel

    from ..datasets.augment_audio import corrupt
    from ..datasets.digits import read_split
    from ..hf.loading import load_feature_extractor, load_model
    from ..hf.model import from_hf
    from ..tasks.transcription import SpeechBatches, new_digit_recognizer, transcription_accuracy

    train_set = read_split(os.path.join(args.data, "train"))
    validation = read_split(os.path.join(args.data, "validation"))
    if args.model == "new-digit-recognizer":
        model, features = new_digit_recognizer(tokenizer)
    else:
        features = load_feature_extractor(args.model)
        model = load_model(SpeechEncoderDecoderModel, args.model)
    _check_text_lengths(train_set, tokenizer, model)

    def evaluate(m):
        return transcription_accuracy(from_hf(m), features, tokenizer, validation, limit=args.eval_limit)

    augment = corrupt if args.augment else None
    return model, features, train_set, SpeechBatches(features, tokenizer, augment), evaluate


def _check_text_lengths(rows: list[dict], tokenizer, model) -> None:
    """Every transcript (+ EOS) fits the decoder's positions; a longer one would fail mid-training."""
    decoder = model.config.decoder
    limit = getattr(decoder, "n_positions", None) or getattr(decoder, "max_position_embeddings", None)
    if not limit:
        return
    ids = tokenizer([r["text"] + tokenizer.eos_token for r in rows])["input_ids"]
    for row, tokens in zip(rows, ids):
        if len(tokens) > limit:
            raise ValueError(f"{row['path']}: its text in metadata.jsonl is {len(tokens)} tokens long; this model's "
                             f"decoder holds at most {limit}: shorten it or leave the file out")


def _tts(args, tokenizer):
    from transformers import EncoderDecoderModel

    from ..datasets.digits import read_split, tts_voice_name
    from ..hf.loading import load_model
    from ..tasks.audio_codes import HOP, SAMPLE_RATE, Codebook, log_mel
    from ..tasks.speech_synthesis import CodeBatches, check_text, new_speaker
    from .checkpoints import replace_directory, writing

    def fits(row):
        tts_voice_name(row)
        check_text(row["text"])
        row["seconds"] = _audio_seconds(row["path"])

    rows = read_split(os.path.join(args.data, "train"), check=fits)
    for row in rows:
        row["voice_name"] = tts_voice_name(row)
    if args.model == "new-speaker":
        saved = os.path.join(args.out, "codebook")
        if args.resume and os.path.isdir(saved):  # a resumed run keeps its codebook
            codebook = Codebook.from_pretrained(saved)
        else:
            from ..tasks.audio import load_audio

            frames = np.concatenate([log_mel(load_audio(r["path"])) for r in rows[:1500]])
            if len(frames) < 256:
                raise ValueError(f"{os.path.join(args.data, 'train')}: {len(frames)} frames of audio, too few to "
                                 "learn a codebook of 256 codes: give more training audio")
            codebook = Codebook.fit(frames, size=256, seed=args.seed)
            # written whole under a temporary name: a kill never leaves half a codebook for --resume
            with writing(saved, "save the codebook", "free some space and rerun", cleanup=saved + ".tmp"):
                shutil.rmtree(saved + ".tmp", ignore_errors=True)
                codebook.save_pretrained(saved + ".tmp")
                replace_directory(saved + ".tmp", saved)
        model = new_speaker(tokenizer, codebook.size)
    else:
        codebook = Codebook.from_pretrained(args.model)
        model = load_model(EncoderDecoderModel, args.model)
        if model.config.decoder.vocab_size != codebook.size + 3:
            raise ValueError(f"{args.model}: its decoder has {model.config.decoder.vocab_size} codes, its codebook "
                             f"{codebook.size} (+ start, stop, pad): not a speaker checkpoint")
    # the decoder reads the start code and every audio frame's code (the labels: the codes, then stop)
    positions = model.config.decoder.n_positions
    for row in rows:
        if 2 + math.ceil(row["seconds"] * SAMPLE_RATE) // HOP > positions:
            raise ValueError(f"{row['path']}: {row['seconds']:.1f} s of audio, longer than the speaker's "
                             f"{(positions - 2) * HOP / SAMPLE_RATE:.1f} s: leave it out of the training data")
    return model, codebook, rows, CodeBatches(tokenizer, codebook), None


def _audio_seconds(path: str) -> float:
    import soundfile

    try:
        info = soundfile.info(path)
    except Exception as error:  # soundfile raises LibsndfileError, RuntimeError... for unreadable files
        raise ValueError(f"{path}: not a readable audio file ({type(error).__name__})") from None
    return info.frames / info.samplerate if info.samplerate > 0 else 0.0

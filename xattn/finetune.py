"""`xattn train` / recipes/finetune.py: fine-tune (or train from scratch) an image captioner or a speech
recognizer on a data folder, through xattn.train (checkpoints, --resume, torchrun)."""

from __future__ import annotations

import os

import numpy as np
import torch


def add_arguments(parser) -> None:
    from .train import TrainConfig

    parser.add_argument("--data", required=True, help="directory with train/ and validation/ (imagefolders, or "
                        "audio files + metadata.jsonl)")
    parser.add_argument("--model", default="new-scene-captioner", help="checkpoint directory or hub id, or "
                        "new-scene-captioner / new-digit-recognizer")
    parser.add_argument("--out", required=True, help="checkpoints, loss.png and final/ go here")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    parser.add_argument("--eval-limit", type=int, default=500, help="validation examples scored at each evaluation")
    parser.add_argument("--patch-size", type=int, default=8, help="new-scene-captioner: ViT patch size")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    for field, default in TrainConfig.__dataclass_fields__.items():
        if field != "output_dir":
            kind = type(default.default)
            flag = "--" + field.replace("_", "-")
            if kind is bool:
                parser.add_argument(flag, action="store_true")
            else:
                parser.add_argument(flag, type=kind, default=default.default)


def main(args) -> int:
    from .train import TrainConfig

    for split in ("train", "validation"):
        if not os.path.isdir(os.path.join(args.data, split)):
            raise ValueError(f"{args.data}: no {split}/ folder (make one with recipes/make_scenes.py or "
                             "recipes/make_digits.py)")
    if args.model.startswith("new-") and args.model not in ("new-scene-captioner", "new-digit-recognizer",
                                                            "new-speaker"):
        raise ValueError(f"unknown --model {args.model!r}: new-scene-captioner, new-digit-recognizer, new-speaker "
                         "or a checkpoint")
    if args.model in ("new-scene-captioner", "new-digit-recognizer") and not os.path.isdir(
            os.path.join(args.data, "tokenizer")):
        raise ValueError(f"{args.data}: no tokenizer/ folder for a new model")
    if not args.model.startswith("new-") and (os.path.sep in args.model or args.model.startswith(".")) \
            and not os.path.isdir(args.model):
        raise ValueError(f"{args.model}: no such checkpoint directory")
    if args.threads:
        torch.set_num_threads(args.threads)
    config = TrainConfig(output_dir=args.out, **{f: getattr(args, f) for f in TrainConfig.__dataclass_fields__
                                                 if f != "output_dir"})
    run(args, config)
    return 0


def run(args, config):
    from transformers import AutoConfig, AutoTokenizer

    from .train import train

    kinds = {"new-scene-captioner": _images, "new-digit-recognizer": _speech, "new-speaker": _tts,
             "vision-encoder-decoder": _images, "speech-encoder-decoder": _speech, "encoder-decoder": _tts}
    kind = args.model if args.model.startswith("new-") else AutoConfig.from_pretrained(args.model).model_type
    if kind not in kinds:
        raise ValueError(f"{args.model}: a {kind} checkpoint; train takes vision-, speech- or text-to-speech "
                         "encoder-decoder models")
    if args.model == "new-speaker":
        from .datasets.digits import TTS_VOICES
        from .speak import text_tokenizer

        tokenizer = text_tokenizer(sorted(TTS_VOICES))
        torch.manual_seed(config.seed)
    elif args.model.startswith("new-"):
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.data, "tokenizer"))
        torch.manual_seed(config.seed)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    model, preprocessor, train_set, collate, evaluate = kinds[kind](args, tokenizer)
    train(model, train_set, collate, config, evaluate=evaluate, resume=args.resume)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun, process 0 saves
        return
    final = os.path.join(config.output_dir, "final")
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    preprocessor.save_pretrained(final)
    print(f"saved {final}")


def _images(args, tokenizer):
    import datasets
    from transformers import AutoImageProcessor, VisionEncoderDecoderModel

    from .captioning import CaptionBatches, caption_accuracy, new_scene_captioner
    from .models import from_hf

    data = datasets.load_dataset("imagefolder", data_dir=args.data)
    if args.model == "new-scene-captioner":
        model, processor = new_scene_captioner(tokenizer, patch_size=args.patch_size)
    else:
        processor = AutoImageProcessor.from_pretrained(args.model)
        model = VisionEncoderDecoderModel.from_pretrained(args.model, use_safetensors=True)

    def evaluate(m):
        return caption_accuracy(from_hf(m), processor, tokenizer, data["validation"], limit=args.eval_limit)

    return model, processor, data["train"], CaptionBatches(processor, tokenizer), evaluate


def _speech(args, tokenizer):
    import datasets
    from transformers import AutoFeatureExtractor, SpeechEncoderDecoderModel

    from .datasets.digits import read_split
    from .models import from_hf
    from .speech import SpeechBatches, new_digit_recognizer, transcription_accuracy

    train_set = datasets.Dataset.from_list(read_split(os.path.join(args.data, "train")))
    validation = read_split(os.path.join(args.data, "validation"))
    if args.model == "new-digit-recognizer":
        model, features = new_digit_recognizer(tokenizer)
    else:
        features = AutoFeatureExtractor.from_pretrained(args.model)
        model = SpeechEncoderDecoderModel.from_pretrained(args.model, use_safetensors=True)

    def evaluate(m):
        return transcription_accuracy(from_hf(m), features, tokenizer, validation, limit=args.eval_limit)

    return model, features, train_set, SpeechBatches(features, tokenizer), evaluate


def _tts(args, tokenizer):
    import datasets
    from transformers import EncoderDecoderModel

    from .codes import Codebook, log_mel
    from .datasets.digits import read_split, tts_voice_name
    from .speak import CodeBatches, new_speaker

    rows = read_split(os.path.join(args.data, "train"))
    for row in rows:
        row["voice_name"] = tts_voice_name(row)
    if args.model == "new-speaker":
        saved = os.path.join(args.out, "codebook")
        if os.path.isdir(saved):  # a resumed run keeps its codebook
            codebook = Codebook.from_pretrained(saved)
        else:
            from .audio import load_audio

            frames = np.concatenate([log_mel(load_audio(r["path"])) for r in rows[:1500]])
            codebook = Codebook.fit(frames, size=256, seed=args.seed)
            codebook.save_pretrained(saved)
        model = new_speaker(tokenizer, codebook.size)
    else:
        codebook = Codebook.from_pretrained(args.model)
        model = EncoderDecoderModel.from_pretrained(args.model, use_safetensors=True)
    return model, codebook, datasets.Dataset.from_list(rows), CodeBatches(tokenizer, codebook), None

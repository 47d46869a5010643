"""Fine-tune (or train from scratch) an image captioner or a speech recognizer.

    python recipes/make_scenes.py build/scenes
    python recipes/finetune.py --data build/scenes --model new-scene-captioner --out build/captioner \\
        --max-steps 6000 --batch-size 64 --learning-rate 2e-3
    python recipes/make_digits.py build/digits
    python recipes/finetune.py --data build/digits --model new-digit-recognizer --out build/recognizer ...
    python recipes/finetune.py ... --resume        # continue a killed run exactly where it stopped

--data holds train/ and validation/: Hugging Face imagefolders (images + metadata.jsonl with `text`) for a
captioner, or audio files + metadata.jsonl (file_name, text) for a recognizer. --model is a
VisionEncoderDecoder or SpeechEncoderDecoder checkpoint directory (or hub id), or `new-scene-captioner` /
`new-digit-recognizer` for the small architectures of xattn.captioning / xattn.speech with the tokenizer
found in DATA/tokenizer. The final model, tokenizer and image processor or feature extractor are saved to
OUT/final as a standard save_pretrained checkpoint.
"""

import argparse
import os

import torch


def main():
    from xattn.train import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, help="directory with train/ and validation/ imagefolders")
    parser.add_argument("--model", default="new-scene-captioner")
    parser.add_argument("--out", required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--eval-limit", type=int, default=500, help="validation images scored at each evaluation")
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
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = TrainConfig(output_dir=args.out, **{f: getattr(args, f) for f in TrainConfig.__dataclass_fields__
                                                 if f != "output_dir"})
    run(args, config)


def run(args, config):
    from transformers import AutoConfig, AutoTokenizer

    from xattn.train import train

    if args.model.startswith("new-"):
        speech = args.model == "new-digit-recognizer"
    else:
        speech = AutoConfig.from_pretrained(args.model).model_type == "speech-encoder-decoder"
    if args.model.startswith("new-"):
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.data, "tokenizer"))
        torch.manual_seed(config.seed)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
    model, preprocessor, train_set, collate, evaluate = (_speech if speech else _images)(args, tokenizer)
    train(model, train_set, collate, config, evaluate=evaluate, resume=args.resume)
    final = os.path.join(config.output_dir, "final")
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    preprocessor.save_pretrained(final)
    print(f"saved {final}")


def _images(args, tokenizer):
    import datasets
    from transformers import AutoImageProcessor, VisionEncoderDecoderModel

    import xattn
    from xattn.captioning import CaptionBatches, caption_accuracy, new_scene_captioner

    data = datasets.load_dataset("imagefolder", data_dir=args.data)
    if args.model == "new-scene-captioner":
        model, processor = new_scene_captioner(tokenizer, patch_size=args.patch_size)
    else:
        processor = AutoImageProcessor.from_pretrained(args.model)
        model = VisionEncoderDecoderModel.from_pretrained(args.model, use_safetensors=True)

    def evaluate(m):
        return caption_accuracy(xattn.from_hf(m), processor, tokenizer, data["validation"], limit=args.eval_limit)

    return model, processor, data["train"], CaptionBatches(processor, tokenizer), evaluate


def _speech(args, tokenizer):
    import datasets
    from transformers import AutoFeatureExtractor, SpeechEncoderDecoderModel

    import xattn
    from xattn.datasets.digits import read_split
    from xattn.speech import SpeechBatches, new_digit_recognizer, transcription_accuracy

    train_set = datasets.Dataset.from_list(read_split(os.path.join(args.data, "train")))
    validation = read_split(os.path.join(args.data, "validation"))
    if args.model == "new-digit-recognizer":
        model, features = new_digit_recognizer(tokenizer)
    else:
        features = AutoFeatureExtractor.from_pretrained(args.model)
        model = SpeechEncoderDecoderModel.from_pretrained(args.model, use_safetensors=True)

    def evaluate(m):
        return transcription_accuracy(xattn.from_hf(m), features, tokenizer, validation, limit=args.eval_limit)

    return model, features, train_set, SpeechBatches(features, tokenizer), evaluate


if __name__ == "__main__":
    main()

"""Fine-tune (or train from scratch) a captioner on a Hugging Face imagefolder data set.

    python recipes/make_scenes.py build/scenes
    python recipes/finetune.py --data build/scenes --model new-scene-captioner --out build/captioner \\
        --max-steps 6000 --batch-size 64 --learning-rate 2e-3
    python recipes/finetune.py ... --resume        # continue a killed run exactly where it stopped

--model is a VisionEncoderDecoder checkpoint directory (or hub id), or `new-scene-captioner` for the small
architecture of xattn.captioning with the tokenizer found in DATA/tokenizer. The final model, tokenizer and
image processor are saved to OUT/final as a standard save_pretrained checkpoint.
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
    import datasets
    from transformers import AutoImageProcessor, AutoTokenizer, VisionEncoderDecoderModel

    import xattn
    from xattn.captioning import CaptionBatches, caption_accuracy, new_scene_captioner
    from xattn.train import train

    data = datasets.load_dataset("imagefolder", data_dir=args.data)
    if args.model == "new-scene-captioner":
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(args.data, "tokenizer"))
        torch.manual_seed(config.seed)
        model, processor = new_scene_captioner(tokenizer, patch_size=args.patch_size)
    else:
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        processor = AutoImageProcessor.from_pretrained(args.model)
        model = VisionEncoderDecoderModel.from_pretrained(args.model, use_safetensors=True)
    validation = data["validation"]

    def evaluate(m):
        return caption_accuracy(xattn.from_hf(m), processor, tokenizer, validation, limit=args.eval_limit)

    train(model, data["train"], CaptionBatches(processor, tokenizer), config, evaluate=evaluate, resume=args.resume)
    final = os.path.join(config.output_dir, "final")
    model.save_pretrained(final)
    tokenizer.save_pretrained(final)
    processor.save_pretrained(final)
    print(f"saved {final}")


if __name__ == "__main__":
    main()

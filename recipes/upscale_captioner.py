"""Give a trained ViT captioner a larger input size, to be fine-tuned from there (the ViT paper's recipe for
fine-tuning at a higher resolution): the patch size and every weight stay, the patch position embeddings are
interpolated (bicubic, by transformers' own ViTEmbeddings.interpolate_pos_encoding) to the new grid, and the
image processor resizes to the new size.

    python recipes/upscale_captioner.py data/models/scene-captioner build/captioner-96 --image-size 96
"""

import argparse
import os
import shutil

import torch
from transformers import AutoImageProcessor, AutoTokenizer, VisionEncoderDecoderModel

CARRIED = ("processor_config.json",)  # files of the checkpoint that the new one keeps as they are


def upscale(source: str, out: str, image_size: int) -> None:
    model = VisionEncoderDecoderModel.from_pretrained(source)
    embeddings = model.encoder.embeddings
    patch = model.config.encoder.patch_size
    if image_size % patch:
        raise SystemExit(f"--image-size {image_size} is not a multiple of the patch size {patch}")
    grid = image_size // patch
    placeholder = torch.zeros(1, 1 + grid * grid, model.config.encoder.hidden_size)
    with torch.no_grad():
        positions = embeddings.interpolate_pos_encoding(placeholder, image_size, image_size).clone()

    config = model.config
    config.encoder.image_size = image_size
    upscaled = VisionEncoderDecoderModel(config)
    state = model.state_dict()
    state["encoder.embeddings.position_embeddings"] = positions
    upscaled.load_state_dict(state)
    upscaled.generation_config = model.generation_config
    upscaled.save_pretrained(out)

    AutoTokenizer.from_pretrained(source).save_pretrained(out)
    processor = AutoImageProcessor.from_pretrained(source)
    processor.size = {"height": image_size, "width": image_size}
    processor.save_pretrained(out)
    for name in CARRIED:
        if os.path.exists(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("source", help="a VisionEncoderDecoder checkpoint directory")
    parser.add_argument("out")
    parser.add_argument("--image-size", type=int, required=True)
    args = parser.parse_args()
    upscale(args.source, args.out, args.image_size)


if __name__ == "__main__":
    main()

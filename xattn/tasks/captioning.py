"""Image captioning: the scene captioner's architecture, its training batches and its accuracy."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..files import save_figure
from . import SHIPPED_MODELS
from .confidence import Confidence
from .encoder_decoder import new_encoder_decoder
from .vision import load_image, pixel_values


def new_scene_captioner(tokenizer, image_size: int = 64, patch_size: int = 8):
    """A small VisionEncoderDecoderModel (ViT, 8 px patches + GPT-2 with cross-attention), random weights,
    and its ViTImageProcessor. Sized to train on 2 CPU cores in well under an hour."""
    from transformers import (
        VisionEncoderDecoderConfig,
        VisionEncoderDecoderModel,
        ViTConfig,
        ViTImageProcessor,
    )

    encoder = ViTConfig(image_size=image_size, patch_size=patch_size, hidden_size=128, num_hidden_layers=4,
                        num_attention_heads=4, intermediate_size=256, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = new_encoder_decoder(VisionEncoderDecoderModel, VisionEncoderDecoderConfig, encoder, tokenizer,
                                n_positions=48, n_layer=3, max_new_tokens=24)
    processor = ViTImageProcessor(size={"height": image_size, "width": image_size}, do_resize=True,
                                  image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return model, processor


class CaptionBatches:
    """Examples {"image": PIL image, "text": caption} -> model kwargs with labels (padding ignored)."""

    def __init__(self, processor, tokenizer):
        self.processor, self.tokenizer = processor, tokenizer

    def __call__(self, examples: list[dict]) -> dict:
        eos = self.tokenizer.eos_token
        encoded = self.tokenizer([e["text"] + eos for e in examples], padding=True, return_tensors="pt")
        labels = encoded["input_ids"].masked_fill(encoded["attention_mask"] == 0, -100)
        images = [e["image"].convert("RGB") for e in examples]
        return {"pixel_values": pixel_values(self.processor, images), "labels": labels}


@torch.no_grad()
def caption_accuracy(engine, processor, tokenizer, dataset, limit: int | None = None, batch_size: int = 64,
                     progress: bool = False) -> dict:
    """Exact-match and token accuracy of greedy captions (decoded by the xattn engine) against the truth."""
    from tqdm import tqdm

    n = len(dataset) if limit is None else min(limit, len(dataset))
    exact = tokens_right = tokens_total = 0
    for start in tqdm(range(0, n, batch_size), desc="evaluating", disable=not progress):
        rows = [dataset[i] for i in range(start, min(start + batch_size, n))]
        pixels = pixel_values(processor, [r["image"].convert("RGB") for r in rows])
        out = engine.generate(pixel_values=pixels)
        for row, ids in zip(rows, out):
            predicted = tokenizer.decode(ids, skip_special_tokens=True).strip()
            exact += predicted == row["text"]
            truth = tokenizer(row["text"])["input_ids"]
            guess = tokenizer(predicted)["input_ids"]
            tokens_right += sum(a == b for a, b in zip(truth, guess))
            tokens_total += max(len(truth), len(guess))
    return {"exact_match": exact / n, "token_accuracy": tokens_right / max(tokens_total, 1)}


DEFAULT_MODEL = os.path.join(SHIPPED_MODELS, "scene-captioner")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


class Captioner:
    """A VisionEncoderDecoder checkpoint (directory or hub id) with its tokenizer and image processor,
    decoding through the xattn engine."""

    def __init__(self, model: str | None = None, compile: bool = False, allow_pickle: bool = False,
                 weights: str = "exact", revision: str | None = None, encoder_weights: str | None = None):
        from ..hf.hub import resolve_checkpoint
        from ..hf.loading import load, load_image_processor, load_tokenizer

        path = DEFAULT_MODEL if model is None else resolve_checkpoint(model, revision, allow_pickle)
        if model is None and not os.path.isdir(path):
            raise ValueError(f"the shipped captioner is not at {path}; pass --model with a checkpoint")
        # with encoder_weights, the decoder's copies are made once, with the encoder's (XattnModel.with_weights)
        self.engine = load(path, allow_pickle=allow_pickle, weights="exact" if encoder_weights else weights)
        if getattr(self.engine.encoder, "main_input_name", None) != "pixel_values":
            raise ValueError(f"{path} is not an image captioner (no vision encoder)")
        if encoder_weights:
            self.engine = self.engine.with_weights(weights, encoder_weights)
        self.tokenizer = load_tokenizer(path)
        self.processor = load_image_processor(path)
        _check_processor_size(self.processor, path)
        self.confidence = Confidence.from_pretrained(path)
        if compile:
            self.engine.compile()

    def load(self, path: str) -> torch.Tensor:
        """An image file as the model sees it, [3, H, W]: decoded and preprocessed one file at a time, so a batch
        holds preprocessed tensors, never more than one decoded image (see vision.MAX_PIXELS)."""
        return pixel_values(self.processor, [load_image(path)])[0]

    def caption(self, images: list, **generate_kwargs) -> list[str]:
        """Captions of PIL images (num_return_sequences of them per image, in order)."""
        return self.caption_pixels(list(pixel_values(self.processor, images)), **generate_kwargs)

    def caption_pixels(self, pixels: list[torch.Tensor], **generate_kwargs) -> list[str]:
        """Captions of preprocessed images ([3, H, W] each, from load())."""
        out = self.engine.generate(**self.encoder_inputs(pixels), **generate_kwargs)
        return [text.strip() for text in self.tokenizer.batch_decode(out, skip_special_tokens=True)]

    def caption_results(self, pixels: list[torch.Tensor], **generate_kwargs) -> list[dict]:
        """{"caption", "avg_logprob", "low_confidence"[, "low_confidence_reason"]} per caption (tasks/confidence)."""
        out = self.engine.generate(**self.encoder_inputs(pixels), return_dict_in_generate=True, **generate_kwargs)
        return self.results(out.sequences, out.avg_logprob)

    def results(self, sequences: torch.Tensor, avg_logprob: torch.Tensor) -> list[dict]:
        """caption_results' records of generated sequences [n, T] and their avg_logprob [n] (also what the server's
        in-flight batching gets back for a request)."""
        texts = [text.strip() for text in self.tokenizer.batch_decode(sequences, skip_special_tokens=True)]
        return self.confidence.results(texts, avg_logprob.tolist(), "caption")

    def encoder_inputs(self, pixels: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.stack(pixels)}

    def attention_map(self, image, path: str, **generate_kwargs) -> str:
        """Caption one image and draw, for each generated token, its cross-attention over the image patches
        (mean over layers and heads) as a PNG grid. Returns the caption."""
        attention = self.attention(image, **generate_kwargs)
        draw_attention(image, attention, path)
        return attention.caption

    @torch.no_grad()
    def attention(self, image, **generate_kwargs) -> Attention:
        """Caption one image with each kept word's cross-attention over the image patches (the model's part of
        attention_map; draw_attention draws it)."""
        pixels = pixel_values(self.processor, [image])
        out = self.engine.generate(pixel_values=pixels, return_dict_in_generate=True, **generate_kwargs)
        ids = out.sequences[:1]
        decoder = self.engine.decoder
        cache = decoder.new_cache(1, ids.shape[1])  # replay from position 0, reading the cross K/V computed once
        cache.set_cross(out.cache.cross_keys, out.cache.cross_values, out.cache.cross_mask)
        probs = decoder.cross_attention_probs(cache, ids)  # [layers, 1, H, T, S]
        # the attention while predicting token t+1 is the one of position t
        weights = probs.mean(dim=(0, 2))[0, :-1]  # [T-1, S]
        words = [self.tokenizer.decode([int(t)]) for t in ids[0, 1:]]
        keep = [i for i, t in enumerate(ids[0, 1:].tolist()) if t not in self.tokenizer.all_special_ids]
        caption = self.tokenizer.decode(ids[0], skip_special_tokens=True).strip()
        return Attention(caption, weights[keep], [words[i] for i in keep])


MAX_INPUT_SIDE = 4096  # pixels a processor may resize to (ViT-L/14 at 336 px is 336): past it, a damaged config


def _check_processor_size(processor, path: str) -> None:
    """An image processor resizing to absurd sizes would allocate gigabytes per image, blamed on the image."""
    size = getattr(processor, "size", None)
    for key in ("height", "width", "shortest_edge", "longest_edge"):
        value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)  # a dict, or a SizeDict (5.x)
        if value is not None and (not isinstance(value, int) or not 1 <= value <= MAX_INPUT_SIDE):
            raise ValueError(f"{path}: preprocessor_config.json resizes images to {key}={value!r}; a size is "
                             f"1-{MAX_INPUT_SIDE} px")


@dataclass(frozen=True)
class Attention:
    caption: str
    weights: torch.Tensor  # [words, encoder positions]: each word's cross-attention, mean over layers and heads
    words: list[str]


MAP_PIXELS = 512  # an attention map draws the image at most this wide and high: it shows patches, not detail


def draw_attention(image, attention: Attention, path: str) -> None:
    """The image, then one panel per word with its attention over the patches, as a PNG grid at `path`."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    image = image.copy()
    image.thumbnail((MAP_PIXELS, MAP_PIXELS))  # a 100-megapixel upload costs no more to draw than a small one
    weights, words = attention.weights, attention.words
    patches = weights.shape[-1]
    side = int(math.isqrt(patches))
    grid = weights[:, patches - side * side:]  # drop the [CLS] position of ViT
    grid = grid.reshape(-1, side, side)
    cols = min(6, len(words) + 1)
    rows = math.ceil((len(words) + 1) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(2.2 * cols, 2.4 * rows), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    axes.flat[0].imshow(image)
    axes.flat[0].set_title("image")
    extent = (0, image.width, image.height, 0)
    for k, (word, heat) in enumerate(zip(words, grid), start=1):
        ax = axes.flat[k]
        ax.imshow(image, extent=extent)
        ax.imshow(heat.numpy(), cmap="inferno", alpha=0.6, extent=extent, interpolation="bilinear")
        ax.set_title(word.strip() or repr(word))
    fig.tight_layout()
    save_figure(fig, path, dpi=100)
    plt.close(fig)


@torch.no_grad()
def weight_format_agreement(captioner: Captioner, images: list, truths: list[str], formats: list[str],
                            batch_size: int = 100) -> dict:
    """For each weight format ("packed", "bf16", "int8", optionally "int8+int8" for an int8 encoder too):
    the share of images whose greedy caption equals the exact fp32 one, its exact-match accuracy against the
    truth, and its seconds; "exact" itself is the reference."""
    import time

    def captions(engine):
        start, out = time.perf_counter(), []
        for begin in range(0, len(images), batch_size):
            pixels = pixel_values(captioner.processor, images[begin: begin + batch_size])
            ids = engine.generate(pixel_values=pixels)
            out += [t.strip() for t in captioner.tokenizer.batch_decode(ids, skip_special_tokens=True)]
        return out, time.perf_counter() - start

    reference, seconds = captions(captioner.engine.with_weights("exact"))
    report = {"exact": {"equal_to_fp32": 1.0, "exact_match": _share(reference, truths), "seconds": seconds}}
    for name in formats:
        decoder_weights, _, encoder_weights = name.partition("+")
        out, seconds = captions(captioner.engine.with_weights(decoder_weights, encoder_weights or None))
        report[name] = {"equal_to_fp32": _share(out, reference), "exact_match": _share(out, truths),
                        "seconds": seconds}
    return report


def _share(a: list[str], b: list[str]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def image_files(paths: list[str]) -> list[str]:
    """Files as given, folders expanded to their image files (sorted)."""
    from ..jobs import input_files

    return input_files(paths, IMAGE_EXTENSIONS)

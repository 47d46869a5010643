"""End-to-end batch captioning: images/s over the same images, encoder included, side by side in one run.

The bench model (random ViT-B/16 + GPT-2 small), 64 random 224 px images, `new_tokens` tokens per caption
(the random model never stops early, so every engine does the same work). At batch 16 the ViT encoder's
pass is bound by compute, not memory, and costs about as much as the whole decode: speeding the decoder alone
cannot give more than (encoder + transformers' decode) / encoder.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class EndToEnd:
    engine: str
    images: int
    batch: int
    seconds: float
    images_per_s: float
    encoder_s: float | None = None  # time in the encoder (xattn engines)
    tokens_equal_to_transformers: bool | None = None
    agreement_with_fp32: float | None = None  # int8: share of tokens equal to xattn fp32's


def run(images: int = 64, batch: int = 16, new_tokens: int = 16, threads: int = 2, progress=print) -> list[EndToEnd]:
    import xattn

    from .decode import best_of, vit_gpt2_small

    torch.set_num_threads(threads)
    model = vit_gpt2_small()
    pixels = torch.randn(images, 3, 224, 224, generator=torch.Generator().manual_seed(64))
    kwargs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens}
    base = xattn.from_hf(model)
    engines = {  # name -> (a transformers model or an XattnModel, images per call)
        f"transformers, batches of {batch}": (model, batch),
        "transformers, one image at a time": (model, 1),
        "xattn fp32 (packed)": (base.with_weights("packed"), batch),
        "xattn int8 decoder": (base.with_weights("int8"), batch),
        "xattn int8 encoder+decoder": (base.with_weights("int8", encoder_weights="int8"), batch),
    }
    results, outputs = [], {}
    with torch.inference_mode():
        for name, (engine, per_call) in engines.items():
            generate = engine.generate
            generate(pixel_values=pixels[:per_call], max_new_tokens=2)  # warm-up
            encoder_s = None
            if isinstance(engine, xattn.XattnModel):  # the encoder's share: one batch, times the batches
                one_batch, _ = best_of(lambda engine=engine: engine.encode(pixel_values=pixels[:batch]), 1)
                encoder_s = one_batch * (images // batch)
            start = time.perf_counter()
            outputs[name] = torch.cat([generate(pixel_values=pixels[i: i + per_call], **kwargs)
                                       for i in range(0, images, per_call)])
            seconds = time.perf_counter() - start
            r = EndToEnd(name, images, per_call, seconds, images / seconds, encoder_s)
            reference = outputs[f"transformers, batches of {batch}"]
            if "int8" in name:
                r.agreement_with_fp32 = float((outputs[name] == outputs["xattn fp32 (packed)"]).float().mean())
            elif name != f"transformers, batches of {batch}":
                r.tokens_equal_to_transformers = bool(torch.equal(outputs[name], reference))
            progress(f"{name:36s} {r.images_per_s:6.2f} images/s ({seconds:.1f} s)")
            results.append(r)
    return results


def table(results: list[EndToEnd]) -> str:
    from .decode import tokens_cell

    base = results[0].images_per_s
    lines = [f"{'engine':36s} {'images/s':>8s} {'x ' + results[0].engine:>30s} {'encoder s':>9s}  tokens"]
    for r in results:
        tokens = tokens_cell(r.tokens_equal_to_transformers, r.agreement_with_fp32)
        encoder = "-" if r.encoder_s is None else f"{r.encoder_s:.1f}"
        lines.append(f"{r.engine:36s} {r.images_per_s:8.2f} {r.images_per_s / base:30.2f} {encoder:>9s}  {tokens}")
    return "\n".join(lines)

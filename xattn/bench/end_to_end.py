"""End-to-end batch captioning: images/s over the same images, encoder included, side by side in one run.

The bench model (random ViT-B/16 + GPT-2 small), 64 random 224 px images, `new_tokens` tokens per caption
(the random model never stops early, so every engine does the same work). At batch 16 the ViT encoder's
pass is bound by compute, not memory, and costs about as much as the whole decode: speeding the decoder alone
cannot give more than (encoder + transformers' decode) / encoder.
"""

from __future__ import annotations

import os
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
    agreement_with_fp32: float | None = None  # int8 / bf16: share of tokens equal to xattn fp32's
    stages_s: dict | None = None  # xattn engines: seconds per stage for all the images, each stage timed alone


STAGES = ("decode images", "processor", "encoder", "cross K/V", "prefill", "steps")
# the shipped sample images (the source tree's), decoded and processed for the first two stages; NaN where missing
SAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data",
                       "samples")


def _onednn_encoder(engine, vit):
    """engine with its bf16 ViT kernel on oneDNN's products instead of xattn's AMX tiles (faster in large batches
    here, but an image's rows depend on the batch's size)."""
    import xattn
    from xattn.fast.vit import ViTEncoder

    return xattn.XattnModel(engine.decoder, encoder=ViTEncoder(vit, "bf16", tiles=False),
                            enc_to_dec_proj=engine.enc_to_dec_proj, generation_config=engine.generation_config,
                            hf_model=engine.hf_model)


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
        # bfloat16 products run on AMX or AVX-512 BF16 where the CPU has them (several times fbgemm's int8 rate)
        "xattn bf16 encoder + int8 decoder": (base.with_weights("int8", encoder_weights="bf16"), batch),
    }
    tiled = engines["xattn bf16 encoder + int8 decoder"][0]
    if getattr(tiled.encoder, "tiles", False):  # AMX: xattn's row-independent tile products; oneDNN's beside them
        engines["xattn bf16 encoder (oneDNN) + int8 decoder"] = (_onednn_encoder(tiled, base.encoder), batch)
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
            if isinstance(engine, xattn.XattnModel):
                r.stages_s = stages(engine, pixels[:batch], images // batch, new_tokens)
            reference = outputs[f"transformers, batches of {batch}"]
            if "int8" in name:
                r.agreement_with_fp32 = float((outputs[name] == outputs["xattn fp32 (packed)"]).float().mean())
            elif name != f"transformers, batches of {batch}":
                r.tokens_equal_to_transformers = bool(torch.equal(outputs[name], reference))
            progress(f"{name:36s} {r.images_per_s:6.2f} images/s ({seconds:.1f} s)")
            results.append(r)
    return results


def stages(engine, pixels: torch.Tensor, batches: int, new_tokens: int) -> dict:
    """Seconds per stage for `batches` batches like `pixels`, each stage timed alone on one batch (best of 2) and
    multiplied: decoding the shipped sample images (Pillow) and the ViT processor at 224 px (the bench itself feeds
    pixel tensors, so these two are not in its total), the encoder, the cross K/V projection, the prefill of the
    start token, and the steps: from generate's first decode step to its return, `new_tokens` of them."""
    import glob

    from transformers import ViTImageProcessor

    from ..tasks.vision import load_image, pixel_values
    from .decode import best_of

    batch = pixels.shape[0]
    files = sorted(glob.glob(os.path.join(SAMPLES, "scene-*")))
    files = [files[i % len(files)] for i in range(batch)] if files else []
    processor = ViTImageProcessor(size={"height": 224, "width": 224})
    loaded = [load_image(f) for f in files]
    decoder = engine.decoder
    out = {
        "decode images": best_of(lambda: [load_image(f) for f in files], 2)[0] if files else float("nan"),
        "processor": best_of(lambda: pixel_values(processor, loaded), 2)[0] if files else float("nan"),
    }
    out["encoder"], (states, mask) = best_of(lambda: engine.encode(pixel_values=pixels), 2)
    out["cross K/V"], _ = best_of(lambda: decoder.cross_key_values(states), 2)
    start = torch.full((batch, 1), engine.generation_config.decoder_start_token_id, dtype=torch.long)
    prefills = []
    for _ in range(2):  # each on a cache of its own, made before the clock starts
        cache = decoder.new_cache(batch, 32, states, mask)
        began = time.perf_counter()
        decoder.prefill(cache, input_ids=start)
        prefills.append(time.perf_counter() - began)
    out["prefill"] = min(prefills)
    out["steps"] = min(_steps_seconds(engine, states, new_tokens) for _ in range(2))
    return {name: seconds * batches for name, seconds in out.items()}


def _steps_seconds(engine, states: torch.Tensor, new_tokens: int) -> float:
    """One generate call's time from its first decode step (greedy or not) to its return."""
    from .paired import wrapped_steps

    first = []

    def marked(step):
        def run(*args):
            if not first:
                first.append(time.perf_counter())
            return step(*args)
        return run

    with wrapped_steps(engine, marked):
        engine.generate(encoder_hidden_states=states, max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        return time.perf_counter() - first[0]


def stages_table(results: list[EndToEnd]) -> str:
    rows = [r for r in results if r.stages_s]
    lines = [f"{'seconds per stage':36s} " + " ".join(f"{name:>13s}" for name in STAGES)]
    for r in rows:
        lines.append(f"{r.engine:36s} " + " ".join(f"{r.stages_s.get(name, float('nan')):13.2f}" for name in STAGES))
    lines.append("(decode images and processor: the shipped samples at 224 px, not in the bench's total, which feeds "
                 "pixel tensors)")
    return "\n".join(lines)


def table(results: list[EndToEnd]) -> str:
    from .decode import tokens_cell

    base = results[0].images_per_s
    lines = [f"{'engine':36s} {'images/s':>8s} {'x ' + results[0].engine:>30s} {'encoder s':>9s}  tokens"]
    for r in results:
        tokens = tokens_cell(r.tokens_equal_to_transformers, r.agreement_with_fp32)
        encoder = "-" if r.encoder_s is None else f"{r.encoder_s:.1f}"
        lines.append(f"{r.engine:36s} {r.images_per_s:8.2f} {r.images_per_s / base:30.2f} {encoder:>9s}  {tokens}")
    return "\n".join(lines)

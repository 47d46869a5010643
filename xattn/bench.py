"""Side-by-side decode benchmark: xattn vs transformers' generate on the same model, in one run.

Model: random ViT-B/16 (224 px, 197 encoder positions) + GPT-2 small with cross-attention (the
nlpconnect/vit-gpt2 shape), fp32. Decode ms/step is the slope between two generation lengths, so the
encoder and the prefill cancel out; end-to-end ms is the longer run. Only ratios from one run mean anything.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass

import torch

ROWS = {  # name -> (batch, num_beams)
    "B=1 greedy": (1, 1),
    "B=1 beam 4": (1, 4),
    "B=8 greedy": (8, 1),
    "B=8 beam 4": (8, 4),
}


@dataclass
class Measurement:
    row: str
    engine: str
    ms_per_step: float
    end_to_end_ms: float
    tokens_equal_to_transformers: bool | None


def vit_gpt2_small(seed: int = 0):
    from transformers import GPT2Config, VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig

    torch.manual_seed(seed)
    decoder = GPT2Config(add_cross_attention=True, is_decoder=True, bos_token_id=50256, eos_token_id=50256)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(ViTConfig(), decoder)
    config.decoder_start_token_id = config.pad_token_id = config.eos_token_id = 50256
    return VisionEncoderDecoderModel(config).eval()


def _timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def run(rows=tuple(ROWS), short: int = 8, long: int = 24, repeats: int = 2, compiled: bool = False,
        threads: int = 2, progress=print) -> list[Measurement]:
    import xattn

    torch.set_num_threads(threads)
    model = vit_gpt2_small()
    engines = {"transformers": model.generate, "xattn eager": xattn.from_hf(model).generate}
    if compiled:
        engines["xattn compiled"] = xattn.from_hf(model).compile().generate
    results = []
    with torch.inference_mode():
        for row in rows:
            batch, beams = ROWS[row]
            pixels = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(batch))
            reference = None
            for name, generate in engines.items():
                def call(n, generate=generate, pixels=pixels, beams=beams):
                    return generate(pixel_values=pixels, max_new_tokens=n, min_new_tokens=n, num_beams=beams)

                call(short), call(long)  # warm-up (and compilation)
                t_short, _ = _timed(lambda: call(short), repeats)
                t_long, out = _timed(lambda: call(long), repeats)
                if name == "transformers":
                    reference = out
                same = None if reference is None or name == "transformers" else bool(torch.equal(out, reference))
                m = Measurement(row, name, (t_long - t_short) / (long - short) * 1000, t_long * 1000, same)
                progress(f"{row:12s} {name:15s} {m.ms_per_step:8.1f} ms/step {m.end_to_end_ms:9.0f} ms"
                         f"{'' if same is None else '  same tokens' if same else '  TOKENS DIFFER'}")
                results.append(m)
            floor = floor_probe_ms(xattn.from_hf(model).decoder, batch * beams, repeats=max(3, repeats))
            progress(f"{row:12s} {'floor probe':15s} {floor:8.1f} ms/step (the step's weights, read once)")
            results.append(Measurement(row, "floor probe", floor, float("nan"), None))
    return results


def floor_probe_ms(decoder, rows: int, repeats: int = 5) -> float:
    """The time to stream one decode step's weights once: a [rows, in] x [in, out] product over each tensor the
    step reads (self-attention, cross-attention query/output, MLP, LM head), nothing else. A decode step cannot
    beat this on the same machine; the ratio to it says how much of a step is overhead."""
    weights = []
    for block in decoder.blocks:
        weights += [block.attn.c_attn.weight, block.attn.c_proj.weight, block.mlp.c_fc.weight, block.mlp.c_proj.weight]
        if hasattr(block, "crossattention"):
            weights += [block.crossattention.q_attn.weight, block.crossattention.c_proj.weight]
    head = decoder.lm_head.weight  # [vocab, D]: read as its transpose
    inputs = [torch.randn(rows, w.shape[0]) for w in weights]
    x_head = torch.randn(rows, head.shape[1])

    def stream():
        for x, w in zip(inputs, weights):
            torch.mm(x, w)
        torch.mm(x_head, head.t())

    with torch.inference_mode():
        stream()
        seconds, _ = _timed(stream, repeats)
    return seconds * 1000


def table(results: list[Measurement]) -> str:
    """Ratios to transformers per row; the floor probe's row is the bound a decode step cannot beat."""
    lines = [f"{'row':12s} {'engine':15s} {'ms/step':>9s} {'x transformers':>15s} {'end-to-end ms':>14s}  tokens"]
    base = {m.row: m.ms_per_step for m in results if m.engine == "transformers"}
    for m in results:
        ratio = m.ms_per_step / base[m.row] if m.row in base else float("nan")
        same = "-" if m.tokens_equal_to_transformers is None else str(m.tokens_equal_to_transformers)
        end_to_end = "-" if m.end_to_end_ms != m.end_to_end_ms else f"{m.end_to_end_ms:.0f}"  # NaN: no run
        lines.append(f"{m.row:12s} {m.engine:15s} {m.ms_per_step:9.1f} {ratio:15.2f} {end_to_end:>14s}  {same}")
    return "\n".join(lines)


def save(results: list[Measurement], path: str) -> None:
    import transformers

    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "results": [asdict(m) for m in results],
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def training_step_cost(checkpointing: bool, batch: int = 8, tokens: int = 32, steps: int = 2,
                       threads: int = 2) -> dict:
    """Seconds per AdamW step (best of `steps`) and the process's peak RSS, training the ViT-B/16 + GPT-2
    small captioner with or without gradient checkpointing. Run each setting in its own process: peak RSS
    is per process."""
    import resource

    from .train import enable_checkpointing

    torch.set_num_threads(threads)
    model = vit_gpt2_small().train()
    model.config.use_cache = False
    if checkpointing:
        enable_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    pixels = torch.randn(batch, 3, 224, 224, generator=generator)
    labels = torch.randint(0, 50000, (batch, tokens), generator=generator)

    def step():
        loss = model(pixel_values=pixels, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # the optimizer's state exists from here on, as in a real run
    seconds, _ = _timed(step, steps)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    return {"gradient_checkpointing": checkpointing, "batch": batch, "tokens": tokens,
            "seconds_per_step": seconds, "peak_rss_mb": peak_mb}

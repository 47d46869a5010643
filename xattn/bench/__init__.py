"""Benchmarks, each measured side by side in one run (only ratios from one run mean anything here).

decode: ms per decode step, xattn vs transformers (dynamic and static cache) vs CTranslate2, by weight format,
    with the weight-streaming floor; end_to_end: images/s captioning a batch of images; compile_cache: first-call
    compile time in a fresh process and in a second one reusing the cache; chart: the PNG; tts (`--tts`): XTTS v2's
    GPT stage, xattn vs coqui-tts' own decoding on transformers 4.57 (a subprocess in that environment).
"""

from .decode import ROWS, Measurement, floor_probe_ms, run, save, table, vit_gpt2_small
from .training import training_step_cost

__all__ = ["ROWS", "Measurement", "floor_probe_ms", "run", "save", "table", "training_step_cost", "vit_gpt2_small"]

"""Memory per weight format: the process's resident memory with the model alone, after the format's copies are made,
and at its peak while generating, each format in a fresh process (a process's freed memory is not always given back,
so formats measured one after another in one process would read each other's leftovers).

`one_copy_mb` is what one copy of the decoder's per-step projections (every block's, and the LM head) takes in the
format's own dtype (int8: with its per-channel scales), so that `extra_mb / one_copy_mb` counts copies.

    python -m xattn.bench.memory packed      # one format, one JSON line (what `xattn bench --memory` runs per format)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field

FORMATS = ("exact", "packed", "bf16", "int8")
ROWS = {"B=1 greedy": (1, 1), "B=8 beam 4": (8, 4)}  # generation rows, each after the peak is reset
BYTES = {"exact": 4, "packed": 4, "bf16": 2, "int8": 1}


@dataclass
class Footprint:
    weights: str
    model_mb: float  # RSS with the model built and the libraries loaded, before any copy (the interpreter included)
    extra_mb: float  # RSS after the format's copies, less model_mb
    one_copy_mb: float
    peak_extra_mb: dict[str, float] = field(default_factory=dict)  # row -> peak RSS while generating, less model_mb
    error: str | None = None
    # what loading xattn's kernels and probing fbgemm's and oneDNN's products pages in, once per process whatever the
    # format (library code and the probes' buffers; 13-15 MB on a Xeon with AMX): in model_mb, not in extra_mb
    libraries_mb: float = 0.0

    @property
    def copies(self) -> float:
        return self.extra_mb / self.one_copy_mb


def _status_mb(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _reset_peak() -> None:
    """Start VmHWM again from the current RSS (Linux: 5 written to clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def one_copy_mb(decoder, weights: str) -> float:
    """MB of one copy of the per-step projections in the format's dtype (exact: transformers' fp32 ones)."""
    convs = []
    for block in decoder.transformer.h:
        convs += [block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj]
        if hasattr(block, "crossattention"):
            convs += [block.crossattention.q_attn, block.crossattention.c_proj]
    head = decoder.lm_head.weight  # [out, in]; a Conv1D's is [in, out]
    values = sum(conv.weight.numel() for conv in convs) + head.numel()
    scales = sum(conv.weight.shape[1] for conv in convs) + head.shape[0]  # one per output channel
    return (values * BYTES[weights] + (4 * scales if weights == "int8" else 0)) / 2**20


def measure(weights: str, threads: int = 2, max_new_tokens: int = 8) -> Footprint:
    """This process: the benchmark model (ViT-B/16 + GPT-2 small, random weights), then the format, then each row."""
    import gc

    import torch

    from ..fast import kernels, release_freed_memory, torch_ops
    from ..hf.model import from_hf
    from .decode import vit_gpt2_small

    torch.set_num_threads(threads)
    model = from_hf(vit_gpt2_small())
    gc.collect()
    release_freed_memory()  # as the format's copies are measured: after their temporaries are given back
    before_libraries = _status_mb("VmRSS")
    kernels.available(), torch_ops.fbgemm_available(), torch_ops.onednn_available()  # each loads once per process
    gc.collect()
    model_mb = _status_mb("VmRSS")
    engine = model.with_weights(weights) if weights != "exact" else model
    gc.collect()
    footprint = Footprint(weights, model_mb, _status_mb("VmRSS") - model_mb, one_copy_mb(model.decoder, weights),
                          libraries_mb=model_mb - before_libraries)
    generator = torch.Generator().manual_seed(0)
    for row, (batch, beams) in ROWS.items():
        pixels = torch.randn(batch, 3, 224, 224, generator=generator)
        gc.collect()
        _reset_peak()
        engine.generate(pixel_values=pixels, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                        num_beams=beams)
        footprint.peak_extra_mb[row] = _status_mb("VmHWM") - model_mb
    return footprint


def run(formats=FORMATS, threads: int = 2, progress=print) -> list[Footprint]:
    """Each format in its own fresh process (python -m xattn.bench.memory FORMAT); on a CPU with AVX-512 VNNI, int8
    also as a CPU with AVX2 alone runs it ("int8 avx2": fbgemm's products, and its copy, from 5 rows)."""
    from ..fast import kernels

    runs = [(weights, weights, {}) for weights in formats]
    if "int8" in formats and kernels.int8_kernel_is_vnni():
        runs.append(("int8 avx2", "int8", {"XATTN_INT8_KERNEL": "avx2"}))
    results = []
    for label, weights, env in runs:
        process = subprocess.run([sys.executable, "-m", "xattn.bench.memory", weights, "--threads", str(threads)],
                                 capture_output=True, text=True,
                                 env={**os.environ, "PYTHONWARNINGS": "ignore", **env})
        lines = process.stdout.strip().splitlines()
        if process.returncode or not lines:
            reason = (process.stderr.strip().splitlines() or [f"exit {process.returncode}"])[-1]
            results.append(Footprint(label, float("nan"), float("nan"), float("nan"), error=reason[:300]))
        else:
            results.append(Footprint(**{**json.loads(lines[-1]), "weights": label}))
        progress(_line(results[-1]))
    return results


def _line(f: Footprint) -> str:
    if f.error:
        return f"{f.weights:8s} error: {f.error}"
    peaks = "  ".join(f"{row} +{mb:.0f}" for row, mb in f.peak_extra_mb.items())
    return (f"{f.weights:9s} model {f.model_mb:6.0f} MB (libraries {f.libraries_mb:.0f})  +format {f.extra_mb:5.0f} "
            f"MB = {f.copies:4.2f} copies of {f.one_copy_mb:.0f} MB  peak generating: {peaks} MB")


def table(results: list[Footprint]) -> str:
    return "\n".join(["memory (RSS, each format in a fresh process)"] + [_line(f) for f in results])


def as_json(results: list[Footprint]) -> list[dict]:
    return [{**asdict(f), "copies": None if f.error else round(f.copies, 3)} for f in results]


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("weights", choices=FORMATS)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    print(json.dumps(asdict(measure(args.weights, threads=args.threads))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

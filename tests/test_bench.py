"""The benchmark's pieces (timings themselves are never asserted: these machines are noisy)."""

import math

import xattn
from conftest import tiny_captioner
from xattn.bench import Measurement, floor_probe_ms, table


def test_floor_probe_reads_every_per_step_weight(monkeypatch):
    import torch

    decoder = xattn.from_hf(tiny_captioner(seed=3)).decoder
    shapes = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: shapes.append((tuple(a.shape), tuple(b.shape))) or real_mm(a, b))
    ms = floor_probe_ms(decoder, rows=3, repeats=1)
    assert ms > 0 and math.isfinite(ms)
    per_pass = 6 * decoder.num_layers + 1  # qkv, attn out, cross q, cross out, mlp in, mlp out; + LM head
    assert len(shapes) == 2 * per_pass  # warm-up + one timed pass
    weights = sum(b[0] * b[1] for _, b in shapes[:per_pass])
    expected = sum(p.numel() for n, p in decoder.transformer.named_parameters()
                   if n.endswith(("c_attn.weight", "c_proj.weight", "c_fc.weight", "q_attn.weight"))
                   and "crossattention.c_attn" not in n) + decoder.lm_head.weight.numel()
    assert weights == expected and all(a[0] == 3 for a, _ in shapes)


def test_table_gives_ratios_and_marks_rows_without_an_end_to_end_run():
    rows = [Measurement("B=1 greedy", "transformers", 40.0, 600.0, None),
            Measurement("B=1 greedy", "xattn eager", 30.0, 500.0, True),
            Measurement("B=1 greedy", "floor probe", 20.0, float("nan"), None)]
    lines = table(rows).splitlines()
    assert "0.75" in lines[2] and "0.50" in lines[3] and lines[3].split()[-2] == "-"

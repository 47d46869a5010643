"""The benchmark's pieces (timings themselves are never asserted: these machines are noisy)."""

import math

import torch

import xattn
from conftest import tiny_captioner
from xattn.bench import Measurement, floor_probe_ms, table


def test_floor_probe_reads_every_per_step_weight(monkeypatch):
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


def test_table_gives_ratios_to_transformers_floor_and_ctranslate2_of_the_same_precision():
    nan = float("nan")
    rows = [Measurement("B=1 greedy", "transformers", 40.0, 600.0, None),
            Measurement("B=1 greedy", "xattn packed", 30.0, 500.0, True),
            Measurement("B=1 greedy", "xattn int8", 12.0, 400.0, None, agreement_with_fp32=0.995),
            Measurement("B=1 greedy", "ctranslate2 float32", 25.0, nan, None),
            Measurement("B=1 greedy", "ctranslate2 int8", 15.0, nan, None),
            Measurement("B=1 greedy", "transformers static", nan, nan, None, error="not supported"),
            Measurement("B=1 greedy", "floor probe", 20.0, nan, None),
            Measurement("B=1 greedy", "int8 floor probe", 6.0, nan, None)]
    lines = table(rows).splitlines()
    packed, int8 = lines[2].split(), lines[3].split()
    assert packed[5:8] == ["0.75", "1.50", "1.20"] and packed[-1] == "same"  # x transformers, x floor, x ct2 fp32
    assert int8[6:8] == ["2.00", "0.80"] and "99.5% = fp32" in lines[3]  # x the int8 floor, x CTranslate2 int8
    assert "could not run: not supported" in lines[6] and lines[7].split()[-2] == "-"


def test_ctranslate2_whisper_shaped_model_decodes_and_counts_its_steps(tmp_path):
    from xattn.bench import ct2

    directory = ct2.build_whisper_like(str(tmp_path / "ct2"), encoder_positions=10, hidden=64, layers=2, heads=4,
                                       ffn=128)
    import torch

    threads = torch.get_num_threads()
    decoder = ct2.CT2Decoder(directory, "int8", threads=1, encoder_positions=10)
    encoded = decoder.encode(2)
    short, long = decoder.generate(encoded, 2, 1, 8), decoder.generate(encoded, 2, 1, 24)
    assert torch.get_num_threads() == threads  # CTranslate2 shares torch's OpenMP: it must not keep its count
    assert 0 < short < long <= 24
    assert 0 < decoder.generate(encoded, 2, 4, 24) <= 24  # beam search runs too


def test_compiled_decode_reuses_the_compile_cache_in_a_second_process(tmp_path):
    from xattn.bench import compile_cache

    record = compile_cache.first_calls(threads=1, cache_dir=str(tmp_path), decoder_layers=1)
    assert record["fresh_process"]["graph_cache_misses"] > 0 and record["fresh_process"]["graph_cache_hits"] == 0
    assert record["second_process"]["graph_cache_hits"] > 0 and record["second_process"]["graph_cache_misses"] == 0


def test_int8_floor_probe_reads_every_int8_weight_once():
    """What the probe streams: one byte per weight of every projection a step reads and of the head (its timing is
    the bench's to report, never a test's to assert)."""
    import xattn
    from conftest import tiny_captioner
    from xattn.bench.decode import _step_weights, int8_floor_probe_ms, int8_step_words

    decoder = xattn.from_hf(tiny_captioner(seed=5, n_embd=256, n_layer=4, vocab_size=4096)).decoder
    weights, head = _step_weights(decoder)
    assert len(weights) == 4 * 6 and head.shape == (4096, 256)  # every projection a step reads, then the head
    words = int8_step_words(decoder)
    assert [w.dtype for w in words] == [torch.int64] * 25
    assert [w.numel() * 8 for w in words] == [t.numel() // 8 * 8 for t in (*weights, head)]
    assert int8_floor_probe_ms(decoder, repeats=2) > 0


def test_chart_draws_decode_rows_and_end_to_end(tmp_path):
    from PIL import Image

    from xattn.bench import chart
    from xattn.bench.end_to_end import EndToEnd
    from xattn.bench.end_to_end import table as e2e_table

    rows = [Measurement(r, e, ms, 1.0, None) for r in ("B=1 greedy", "B=8 greedy")
            for e, ms in (("transformers", 40.0), ("xattn int8", 12.0), ("floor probe", 20.0),
                          ("int8 floor probe", 6.0))]
    e2e = [EndToEnd("transformers, batches of 16", 64, 16, 20.0, 3.2), EndToEnd("xattn int8", 64, 16, 10.0, 6.4)]
    path = tmp_path / "bench.png"
    chart.draw(rows, e2e, str(path), title="test")
    assert Image.open(path).size[0] > 1000
    assert e2e_table(e2e).splitlines()[2].split()[-3:] == ["2.00", "-", "-"]


def test_end_to_end_stages_time_each_part_directly(monkeypatch):
    from xattn.bench import end_to_end
    from xattn.bench.end_to_end import STAGES, EndToEnd, stages, stages_table

    engine = xattn.from_hf(tiny_captioner(seed=12)).with_weights("int8")
    pixels = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(12))
    extra = [0.0]  # the clock runs 0.25 s fast at each decode step
    real_clock, real_step = end_to_end.time.perf_counter, engine._greedy_step or engine._decode_step

    def slow_step(*args):
        extra[0] += 0.25
        return real_step(*args)

    monkeypatch.setattr(engine, "_greedy_step" if engine._greedy_step else "_decode_step", slow_step)
    monkeypatch.setattr(end_to_end.time, "perf_counter", lambda: real_clock() + extra[0])
    measured = stages(engine, pixels, batches=3, new_tokens=5)
    assert list(measured) == list(STAGES)
    assert all(math.isfinite(v) and v >= 0 for v in measured.values())
    assert measured["decode images"] > 0 and measured["processor"] > 0  # the shipped samples were read
    # five tokens: the prefill's logits give the first, four steps the rest; three batches, each stage x 3
    assert 3 * 4 * 0.25 <= measured["steps"] < 3 * 4 * 0.25 + 0.3
    assert measured["encoder"] < 0.25 and measured["prefill"] < 0.25  # no step ran inside their clocks
    assert engine._greedy_step is slow_step or engine._decode_step is slow_step  # the engine's own steps restored
    table = stages_table([EndToEnd("transformers", 12, 4, 5.0, 2.4),
                          EndToEnd("xattn int8", 12, 4, 5.0, 2.4, stages_s=measured)])
    assert "xattn int8" in table and "transformers" not in table.splitlines()[1]


def test_rounds_time_the_probes_in_every_round_between_the_engines():
    from xattn.bench.decode import _rounds

    events = []

    def engine(n):
        events.append(("engine", n))
        return torch.zeros(1, n), n

    def probe():
        events.append(("probe",))

    measured, probes = _rounds("B=1 greedy", {"xattn int8": engine}, 2, 6, 3, 0.0, {"int8 floor probe": [probe]})
    m, out = measured["xattn int8"]
    assert math.isfinite(m.ms_per_step) and out.shape == (1, 6)
    assert set(probes) == {"int8 floor probe"} and 0 < probes["int8 floor probe"] < float("inf")
    rounds = events[2:]  # after the warm-up's short and long runs: per round the engine twice, then the probe
    assert rounds == [("engine", 2), ("engine", 6)] + [("probe",)] * 4 + [("engine", 2), ("engine", 6)] + \
        [("probe",)] * 4 + [("engine", 2), ("engine", 6)] + [("probe",)] * 4  # as many passes as the slope spans


def test_paired_ratio_sets_each_step_against_the_probe_pass_just_before_it(monkeypatch):
    """A fake clock: each probe pass takes 2 units, step i of a call 3 + i, the search's bookkeeping 1 after each."""
    from xattn.bench import paired

    clock = [0.0]
    monkeypatch.setattr(paired.time, "perf_counter", lambda: clock[0])

    class Engine:
        def __init__(self):
            self._decode_step, self._greedy_step = self.step, None
            self.taken = []

        def step(self, i):
            clock[0] += 3 + i
            self.taken.append(i)

        def generate(self):
            for i in range(4):  # four steps, each followed by bookkeeping
                self._decode_step(i)
                clock[0] += 1

    def probe():
        clock[0] += 2

    engine = Engine()
    measured = paired.paired_ratio(engine, engine.generate, probe, calls=2)
    # per call, three whole intervals (steps 0, 1, 2 with their bookkeeping: 4, 5, 6 units); step 3's ends in return
    assert measured.steps == 6 and engine.taken == [0, 1, 2, 3] * 2
    assert measured.step_ms == 5000 and measured.probe_ms == 2000 and measured.ratio == 2.5
    assert engine._decode_step == engine.step and engine._greedy_step is None  # the engine's own steps restored

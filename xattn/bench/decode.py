"""Decode speed side by side in one run: xattn (by weight format) vs transformers vs CTranslate2, and the floor.

Model: random ViT-B/16 (224 px, 197 encoder positions) + GPT-2 small with cross-attention (the
nlpconnect/vit-gpt2 shape), 2 threads. Every engine decodes from the same encoder output (computed once per
row), so ms/step is the slope between two generation lengths with the encoder and the prefill cancelled out;
end-to-end ms is the encoder's time plus the longer run. fp32 engines are checked token for token against
transformers; bf16/int8 report the share of generated tokens equal to xattn fp32's.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass

import torch

from ..fast import kernels
from ..files import save_json

ROWS = {  # name -> (batch, num_beams)
    "B=1 greedy": (1, 1),
    "B=1 beam 4": (1, 4),
    "B=8 greedy": (8, 1),
    "B=8 beam 4": (8, 4),
}
XATTN_WEIGHTS = {"xattn eager": "exact", "xattn packed": "packed", "xattn bf16": "bf16", "xattn int8": "int8"}
COMPILED = {"xattn eager": "xattn compiled", "xattn packed": "xattn packed compiled",
            "xattn int8": "xattn int8 compiled"}
FP32_ENGINES = ("transformers static", "xattn eager", "xattn compiled", "xattn packed", "xattn packed compiled")


@dataclass
class Measurement:
    row: str
    engine: str
    ms_per_step: float
    end_to_end_ms: float
    tokens_equal_to_transformers: bool | None
    agreement_with_fp32: float | None = None  # bf16/int8: share of generated tokens equal to xattn fp32's
    compile_s: float | None = None  # compiled engines: the first call's time (tracing + compiling + running)
    error: str | None = None  # why an engine could not run this row
    paired_floor_ratio: float | None = None  # PAIRED: the median step / probe ratio over pairs (bench/paired.py)


def vit_gpt2_small(seed: int = 0, decoder_layers: int = 12):
    from transformers import GPT2Config, VisionEncoderDecoderConfig, VisionEncoderDecoderModel, ViTConfig

    torch.manual_seed(seed)
    decoder = GPT2Config(add_cross_attention=True, is_decoder=True, bos_token_id=50256, eos_token_id=50256,
                         n_layer=decoder_layers)
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(ViTConfig(), decoder)
    config.decoder_start_token_id = config.pad_token_id = config.eos_token_id = 50256
    return VisionEncoderDecoderModel(config).eval()


def best_of(fn, repeats: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def _engines(model, compiled: bool) -> dict:
    """name -> generate(states, beams, n) -> (sequences, steps); transformers first: it is the reference."""
    from transformers.modeling_outputs import BaseModelOutput

    import xattn

    def transformers_generate(**extra):
        def generate(states, beams, n):
            return model.generate(encoder_outputs=BaseModelOutput(last_hidden_state=states), max_new_tokens=n,
                                  min_new_tokens=n, num_beams=beams, **extra), n
        return generate

    def xattn_generate(wrapped):
        def generate(states, beams, n):
            return wrapped.generate(encoder_hidden_states=states, max_new_tokens=n, min_new_tokens=n,
                                    num_beams=beams), n
        return generate

    base = xattn.from_hf(model)
    engines = {"transformers": transformers_generate(),
               "transformers static": transformers_generate(cache_implementation="static")}
    for name, weights in XATTN_WEIGHTS.items():
        engines[name] = xattn_generate(base.with_weights(weights))
        if compiled and name in COMPILED:
            engines[COMPILED[name]] = xattn_generate(base.with_weights(weights).compile())
    if kernels.int8_kernel_is_vnni():  # the AVX2 kernel (and fbgemm from 5 rows) beside
        engines[INT8_AVX2] = _with_int8_kernel("avx2", xattn_generate(base.with_weights("int8")))
    return engines


INT8_AVX2 = "xattn int8 avx2"  # on a CPU with AVX-512 VNNI: the int8 format as a CPU with AVX2 alone runs it


def _with_int8_kernel(name: str, generate):
    def generate_with(states, beams, n):
        with kernels.using_int8_kernel(name):
            return generate(states, beams, n)
    return generate_with


def run(rows=tuple(ROWS), short: int = 8, long: int = 24, repeats: int = 2, compiled: bool = False,
        threads: int = 2, ctranslate2: bool = True, progress=print) -> list[Measurement]:
    """Per row: every engine is warmed up (and compiled), then timed in rounds, one short and one long run of
    each engine per round (so a noisy moment of the machine hits all of them), best of `repeats` rounds."""
    import xattn

    from . import ct2

    torch.set_num_threads(threads)
    if compiled:  # one graph per engine x row shape, all of the same decode_step code: more than dynamo's default 8
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    model = vit_gpt2_small()
    engines = _engines(model, compiled)
    ct2_models = _ct2_models(threads) if ctranslate2 and ct2.available() else {}
    decoder = xattn.from_hf(model).decoder
    paired_engine = xattn.from_hf(model).with_weights("int8")  # timed apart, its steps paired with the int8 probe
    results = []
    with torch.inference_mode():
        for row in rows:
            batch, beams = ROWS[row]
            pixels = torch.randn(batch, 3, 224, 224, generator=torch.Generator().manual_seed(batch))
            encoder_s, states = best_of(lambda pixels=pixels: model.encoder(pixel_values=pixels)[0], repeats)
            calls = {name: (lambda n, g=generate, s=states, k=beams: g(s, k, n)) for name, generate in engines.items()}
            for name, decoder_ct2 in ct2_models.items():
                encoded = decoder_ct2.encode(batch)
                # its max_length is not a token count: ask for twice as many and count what comes back
                calls[name] = lambda n, d=decoder_ct2, e=encoded, b=batch, k=beams: (None, d.generate(e, b, k, 2 * n))
            # the probes run in the same rounds as the engines, over as many passes as their slopes span steps, so
            # that a ratio to a probe compares like windows of one stretch of the machine
            probes = {"floor probe": floor_streams(decoder, batch * beams)}
            if any("int8" in name for name in engines):
                probes["int8 floor probe"] = [int8_floor_stream(decoder)]
            measured, probe_ms = _rounds(row, calls, short, long, repeats, encoder_s, probes)
            _compare_tokens(measured)
            for m, _ in measured.values():
                _report(progress, m)
                results.append(m)
            for name, ms in probe_ms.items():
                results.append(Measurement(row, name, ms, float("nan"), None))
                _report(progress, results[-1])
            if "int8 floor probe" in probes:
                results.append(_paired_int8(paired_engine, states, beams, long, repeats, probes["int8 floor probe"][0],
                                            row))
                _report(progress, results[-1])
    return results


PAIRED = "xattn int8 paired"  # the int8 step with the int8 floor probe run before each of its steps


def _paired_int8(engine, states, beams, n, calls, probe, row) -> Measurement:
    from .paired import paired_ratio

    def generate():
        engine.generate(encoder_hidden_states=states, max_new_tokens=n, min_new_tokens=n, num_beams=beams)

    measured = paired_ratio(engine, generate, probe, calls)
    return Measurement(row, PAIRED, measured.step_ms, float("nan"), None, paired_floor_ratio=measured.ratio)


def _rounds(row, calls, short, long, repeats, encoder_s, probes: dict | None = None) -> tuple[dict, dict]:
    """(name -> (Measurement, the long run's sequences or None), probe name -> its best ms): each round runs every
    engine short and long, then every probe's streams, each long - short passes in a row (the steps an engine's
    slope spans) timed as one; a probe's ms per pass is its fastest stream's best round."""
    probes = probes or {}
    probe_best = {name: float("inf") for name in probes}
    first, failed = {}, {}
    for name, call in calls.items():  # warm-up, compilation
        try:
            start = time.perf_counter()
            call(short)
            first[name] = time.perf_counter() - start
            call(long)
        except Exception as error:  # an engine that cannot run a row is reported, not fatal
            failed[name] = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    best = {name: {} for name in first}
    outputs = {}
    for _ in range(repeats):
        for name in first:
            for n in (short, long):
                start = time.perf_counter()
                out, steps = calls[name](n)
                seconds = time.perf_counter() - start
                if seconds < best[name].get(n, (float("inf"),))[0]:
                    best[name][n] = (seconds, steps)
                if n == long:
                    outputs[name] = out
        for name, streams in probes.items():
            for stream in streams:  # as many passes as the slope spans steps: one window of time, as the engines'
                start = time.perf_counter()
                for _ in range(long - short):
                    stream()
                probe_best[name] = min(probe_best[name], (time.perf_counter() - start) / (long - short) * 1000)
    measured = {}
    for name in calls:
        if name in failed:
            measured[name] = (Measurement(row, name, float("nan"), float("nan"), None, error=failed[name]), None)
            continue
        (t_short, n_short), (t_long, n_long) = best[name][short], best[name][long]
        if n_long <= n_short:
            m = Measurement(row, name, float("nan"), float("nan"), None, error="it stopped early")
        else:
            is_ct2 = name.startswith("ctranslate2")
            m = Measurement(row, name, (t_long - t_short) / (n_long - n_short) * 1000,
                            float("nan") if is_ct2 else (encoder_s + t_long) * 1000, None,
                            compile_s=first[name] if "compiled" in name else None)
        measured[name] = (m, outputs.get(name))
    return measured, probe_best


def _compare_tokens(measured: dict) -> None:
    """fp32 engines against transformers' tokens; bf16/int8 against xattn fp32's (share of equal tokens)."""
    reference = measured.get("transformers", (None, None))[1]
    fp32 = measured.get("xattn eager", (None, None))[1]
    for name, (m, out) in measured.items():
        if out is None or name == "transformers":
            continue
        if name in FP32_ENGINES and reference is not None:
            m.tokens_equal_to_transformers = bool(torch.equal(out, reference))
        elif name in ("xattn bf16", "xattn int8", "xattn int8 compiled", INT8_AVX2) and fp32 is not None:
            m.agreement_with_fp32 = _agreement(out, fp32)


def _agreement(out: torch.Tensor, reference: torch.Tensor) -> float:
    if out.shape != reference.shape:
        length = min(out.shape[1], reference.shape[1])
        out, reference = out[:, :length], reference[:, :length]
    return float((out == reference).float().mean())


def _ct2_models(threads: int) -> dict:
    """Both precisions, loaded into memory; the converted files (~1 GB with transformers' copy) are removed."""
    from . import ct2

    with tempfile.TemporaryDirectory(prefix="xattn-ct2-") as scratch:
        directory = ct2.build_whisper_like(os.path.join(scratch, "whisper-like"))
        return {f"ctranslate2 {kind}": ct2.CT2Decoder(directory, kind, threads) for kind in ("float32", "int8")}


def _report(progress, m: Measurement) -> None:
    if m.error:
        progress(f"{m.row:12s} {m.engine:20s} could not run: {m.error}")
        return
    tokens = tokens_cell(m.tokens_equal_to_transformers, m.agreement_with_fp32)
    extra = "" if tokens == "-" else f"  tokens: {tokens}"
    if m.compile_s is not None:
        extra += f"  (first call {m.compile_s:.0f} s)"
    progress(f"{m.row:12s} {m.engine:20s} {m.ms_per_step:8.1f} ms/step{extra}")


def floor_probe_ms(decoder, rows: int, repeats: int = 5) -> float:
    """The time to stream one decode step's fp32 weights once: a [rows, in] x [in, out] product over each tensor
    the step reads (self-attention, cross-attention query/output, MLP, LM head), nothing else; the faster of
    torch's matrix product on the tensors as they are and the packed format's products (xattn's kernel up to
    LIMITS.packed_kernel_rows rows, oneDNN's above). A decode step in fp32 cannot beat this on the same machine
    with these kernels; the ratio to it says how much of a step is overhead."""
    with torch.inference_mode():
        return min(_stream_best_ms(stream, repeats) for stream in floor_streams(decoder, rows))


def floor_streams(decoder, rows: int) -> list:
    """floor_probe_ms's streams: functions that each run the products once (torch's matrix product; the packed
    format's where oneDNN is there)."""
    streams = [_stream(decoder, rows, packed=False)]
    if torch.backends.mkldnn.is_available():
        streams.append(_stream(decoder, rows, packed=True))
    return streams


def int8_floor_probe_ms(decoder, repeats: int = 5) -> float:
    """The time to read one decode step's int8 weights once (every projection a step reads and the LM head, one
    byte per weight, as the int8 format holds them): a sum over each as 8-byte words, the least work that touches
    every byte. An int8 step cannot beat it; its ratio to it says how far the int8 products are from the memory."""
    with torch.inference_mode():
        return _stream_best_ms(int8_floor_stream(decoder), repeats)


def int8_floor_stream(decoder):
    """int8_floor_probe_ms's stream: a function that reads the step's int8 weights once."""
    words = int8_step_words(decoder)

    def stream():
        for w in words:
            w.sum()

    return stream


def _stream_best_ms(stream, repeats: int) -> float:
    stream()
    return best_of(stream, repeats)[0] * 1000


def int8_step_words(decoder) -> list[torch.Tensor]:
    """One decode step's weights quantized to int8 as the int8 format holds them, each viewed as 8-byte words (a
    tail of under 8 bytes left out): what the int8 floor probe reads."""
    from ..fast.torch_ops import quantize

    weights, head = _step_weights(decoder)
    copies = [quantize(w.t().contiguous()).int_repr() for w in weights] + [quantize(head).int_repr()]
    return [c.view(-1)[: c.numel() // 8 * 8].view(torch.int64) for c in copies]


def _step_weights(decoder) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The Conv1D weights [in, out] a decode step reads, and the LM head's [vocab, D]."""
    weights = []
    for block in decoder.blocks:
        weights += [block.attn.c_attn.weight, block.attn.c_proj.weight, block.mlp.c_fc.weight, block.mlp.c_proj.weight]
        if hasattr(block, "crossattention"):
            weights += [block.crossattention.q_attn.weight, block.crossattention.c_proj.weight]
    return weights, decoder.lm_head.weight


def _stream(decoder, rows: int, packed: bool):
    weights, head = _step_weights(decoder)  # the head [vocab, D] is read as its transpose
    inputs = [torch.randn(rows, w.shape[0]) for w in weights]
    x_head = torch.randn(rows, head.shape[1])

    if packed:
        from ..fast.formats import PackedLinear

        linears = [PackedLinear(w.t(), None) for w in weights] + [PackedLinear(head, None)]
        xs = inputs + [x_head]

        def stream():
            for x, linear in zip(xs, linears):
                linear(x)
    else:
        def stream():
            for x, w in zip(inputs, weights):
                torch.mm(x, w)
            torch.mm(x_head, head.t())

    return stream


def table(results: list[Measurement]) -> str:
    """Ratios to transformers (dynamic cache) per row, to the floor probe, and to CTranslate2 of the same
    precision; token identity (fp32) or agreement with fp32 (bf16/int8)."""
    header = (f"{'row':12s} {'engine':20s} {'ms/step':>8s} {'x transf.':>9s} {'x floor':>8s} {'x ct2':>6s} "
              f"{'e2e ms':>7s}  tokens")
    lines = [header]
    by_row = {(m.row, m.engine): m.ms_per_step for m in results}
    for m in results:
        base = by_row.get((m.row, "transformers"), float("nan"))
        floor = by_row.get((m.row, "int8 floor probe" if "int8" in m.engine else "floor probe"), float("nan"))
        ct2 = by_row.get((m.row, "ctranslate2 int8" if "int8" in m.engine else "ctranslate2 float32"), float("nan"))
        if m.error:
            lines.append(f"{m.row:12s} {m.engine:20s} could not run: {m.error}")
            continue
        tokens = tokens_cell(m.tokens_equal_to_transformers, m.agreement_with_fp32)
        if m.compile_s is not None:
            tokens += f" (first call {m.compile_s:.0f} s)"
        end_to_end = "-" if m.end_to_end_ms != m.end_to_end_ms else f"{m.end_to_end_ms:.0f}"  # NaN: no run
        to_floor = _ratio(m.ms_per_step, floor) if m.paired_floor_ratio is None else f"{m.paired_floor_ratio:.2f}"
        lines.append(f"{m.row:12s} {m.engine:20s} {m.ms_per_step:8.1f} {_ratio(m.ms_per_step, base):>9s} "
                     f"{to_floor:>8s} {_ratio(m.ms_per_step, ct2):>6s} {end_to_end:>7s}  {tokens}")
    return "\n".join(lines)


def tokens_cell(equal_to_transformers: bool | None, agreement_with_fp32: float | None) -> str:
    """A table's tokens column: identity with transformers (fp32), or the share equal to fp32's (bf16/int8)."""
    if equal_to_transformers is not None:
        return "same" if equal_to_transformers else "DIFFER"
    return "-" if agreement_with_fp32 is None else f"{agreement_with_fp32:.1%} = fp32"


def _ratio(value: float, base: float) -> str:
    return "-" if value != value or base != base else f"{value / base:.2f}"


def save(results: list[Measurement], path: str, **extra) -> None:
    """JSON with the date, machine and versions; extra: more sections (end-to-end, compile cache)."""
    import transformers

    from . import ct2

    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ctranslate2": ct2.version(),
        "results": [asdict(m) for m in results],
        **{name: _plain(value) for name, value in extra.items()},
    }
    save_json(record, path)


def _plain(value):
    if isinstance(value, list):
        return [asdict(v) if hasattr(v, "__dataclass_fields__") else v for v in value]
    return value


def machine() -> str:
    """CPU model, core count and torch threads, for the record."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    isa = "; int8 kernel: " + kernels.int8_kernel() if kernels.available() else "; xattn's kernels unavailable"
    threads = f"{os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return f"{model}, {threads}{isa}; bf16 products: {bf16_units()}"


def bf16_units() -> str:
    """What runs torch's bfloat16 products here (oneDNN picks AMX, then AVX-512 BF16): what a bf16 format's speed
    depends on most."""
    flags = kernels.cpu_flags()
    if flags is None:
        return "unknown"
    return "AMX" if "amx_bf16" in flags else "AVX-512 BF16" if "avx512_bf16" in flags else "no bf16 units"


"""XTTS v2's GPT stage side by side in one run: xattn (exact, packed, int8) vs coqui-tts' own decoding.

Model: coqui-tts' own GPT module (TTS.tts.layers.xtts.gpt.GPT, as Xtts.init_models builds it) at XTTS v2's shape:
30 layers, width 1024, 16 heads, 1026 audio tokens (start 1024, stop 1025), 6681 text tokens, the perceiver
resampler's 32 conditioning latents. Random weights, filled parameter by parameter from the seed and the
parameter's name, so that every transformers version holds the same values (both processes hash them).

coqui's own decoding is transformers' generate on XTTS's GPT2InferenceModel (`GPT.generate`, what
`Xtts.inference()` calls). It fails on transformers 5.x (xattn/integrations/xtts.py says why), so it runs in a
second Python environment with transformers 4.57 (`--tts-venv`, by default `.venv457` where it exists, as .ci/run
makes it), as a subprocess of this bench: `python -m xattn.bench.tts SPEC OUT`. xattn runs in this process, each
engine the integration as a user enables it: `xattn.integrations.xtts.enable(model, weights=engine)`, then
`GPT.generate`.

Every call decodes exactly `tokens` audio codes (min_length and max_length as transformers counts them: coqui's
fake prompt of P + 1 ids, then the codes) from a prefix of the 32 latents + `text_tokens` text ids + the two text
markers. Rows: B=1 greedy, and gpt_batch_size 4 (Xtts.inference()'s num_return_sequences; transformers samples
then, as greedy search refuses num_return_sequences > 1) with inference()'s sampling defaults, seeded. Reported
per call: seconds for the whole GPT stage (prefix + codes), audio codes per second, and the real-time factor:
seconds / seconds of audio the codes make. One code is `gpt_code_stride_len` (1024) samples at the decoder's
`input_sample_rate` (22050 Hz): HifiDecoder stretches the latents by code_stride_len / output_hop_length and
then by output / input sample rate, so XTTS v2 makes 22050 / 1024 = 21.53 codes per second of audio. fp32 engines
are checked token for token against coqui's own; int8 reports the share of its codes equal to xattn exact's.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import asdict, dataclass, field

import torch

ENGINES = ("exact", "packed", "int8")  # xattn's weight formats, each a column of its own
FP32 = ("exact", "packed")
SAMPLING = dict(do_sample=True, temperature=0.75, top_k=50, top_p=0.85)  # Xtts.inference()'s defaults
ROWS = {  # name -> GPT.generate keywords (repetition_penalty 10: inference()'s default)
    "B=1 greedy": dict(do_sample=False, repetition_penalty=10.0, num_beams=1, num_return_sequences=1),
    "gpt_batch_size 4 sampling": dict(SAMPLING, repetition_penalty=10.0, num_beams=1, num_return_sequences=4),
}
WARM_UP_TOKENS = 8
SEED = 0


@dataclass(frozen=True)
class Shape:
    """The GPT's size and the work per call; the defaults are XTTS v2's (its config.json) and a ~12 s utterance."""

    layers: int = 30
    width: int = 1024  # gpt_n_model_channels
    heads: int = 16
    tokens: int = 250  # audio codes decoded per call (at most max_audio_tokens - 3)
    text_tokens: int = 100  # text ids in the prefix (before XTTS's start/stop text markers)
    audio_vocab: int = 1026  # gpt_num_audio_tokens; start = vocab - 2, stop = vocab - 1
    text_vocab: int = 6681  # gpt_number_text_tokens (XTTS v2's tokenizer)
    max_audio_tokens: int = 605  # gpt_max_audio_tokens
    max_text_tokens: int = 402
    max_prompt_tokens: int = 70

    def check(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"--tts-width {self.width} must be a multiple of --tts-heads {self.heads}")
        if not 1 <= self.tokens <= self.max_audio_tokens - 3:
            raise ValueError(f"--tts-tokens must be 1..{self.max_audio_tokens - 3} (XTTS v2's max_gen_mel_tokens)")
        if not 1 <= self.text_tokens <= self.max_text_tokens:
            raise ValueError(f"--tts-text-tokens must be 1..{self.max_text_tokens}")


@dataclass
class Measurement:
    row: str
    engine: str  # "coqui" or an xattn weight format
    seconds: float  # the whole GPT stage of one call, best of the repeats
    rows: int  # sequences per call (gpt_batch_size)
    tokens: int  # codes per sequence
    codes_per_s: float  # rows * tokens / seconds
    real_time_factor: float  # seconds / seconds of audio in one sequence's codes
    tokens_equal_to_coqui: bool | None = None  # fp32 engines (None: no coqui column)
    agreement_with_exact: float | None = None  # int8: share of codes equal to xattn exact's
    error: str | None = None


@dataclass
class Report:
    shape: Shape
    codes_per_second_of_audio: float
    measurements: list[Measurement]
    weights_sha256: str
    coqui: dict = field(default_factory=dict)  # the subprocess's versions, or why there is no coqui column


# ---- the model, the same in both processes ---------------------------------------------------------------------
def _importing():
    from ..integrations import torchaudio_stand_in

    return torchaudio_stand_in()


def build_gpt(shape: Shape, seed: int = SEED):
    """coqui-tts' XTTS GPT at `shape`, ready for inference (GPT2InferenceModel, kv_cache=True), seeded weights."""
    import transformers

    with _importing():
        from TTS.tts.layers.xtts.gpt import GPT
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # coqui's GPT2Configs keep GPT-2's bos/eos ids: a warning per config
    try:
        gpt = _gpt(GPT, shape)
    finally:
        transformers.logging.set_verbosity(verbosity)
    with torch.no_grad():
        for name, p in gpt.named_parameters():
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            if p.ndim == 1 and name.endswith("weight"):  # norms' gains
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.02 * torch.randn(p.shape, generator=generator))
    gpt.max_gen_mel_tokens = shape.tokens  # coqui's max_length = this + its fake prompt; the integration's too
    return gpt.eval()


def _gpt(GPT, shape: Shape):
    """GPT as Xtts.init_models builds it from XTTS v2's config, then init_gpt_for_inference (kv_cache=True)."""
    gpt = GPT(layers=shape.layers, model_dim=shape.width, heads=shape.heads, start_text_token=261, stop_text_token=0,
              max_text_tokens=shape.max_text_tokens, max_mel_tokens=shape.max_audio_tokens,
              max_prompt_tokens=shape.max_prompt_tokens, number_text_tokens=shape.text_vocab,
              num_audio_tokens=shape.audio_vocab, start_audio_token=shape.audio_vocab - 2,
              stop_audio_token=shape.audio_vocab - 1, use_perceiver_resampler=True, code_stride_len=1024)
    gpt.init_gpt_for_inference(kv_cache=True)
    return gpt


def weights_sha256(module: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, p in sorted(module.named_parameters()):
        digest.update(name.encode())
        digest.update(p.detach().contiguous().numpy().data)
    return digest.hexdigest()


def inputs(shape: Shape, seed: int = SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """Conditioning latents [1, 32, width] (the perceiver's output) and text ids [1, text_tokens]."""
    generator = torch.Generator().manual_seed(seed + 1)
    cond = torch.randn(1, 32, shape.width, generator=generator)
    text = torch.randint(1, shape.text_vocab, (1, shape.text_tokens), generator=generator)
    return cond, text


def generate_keywords(gpt, text: torch.Tensor, row: str, tokens: int) -> dict:
    """GPT.generate keywords decoding exactly `tokens` codes: min_length counts coqui's fake prompt, [1] * P +
    [start] with P = 32 latents + text + its 2 markers."""
    prompt = 32 + text.shape[1] + 2 + 1
    gpt.max_gen_mel_tokens = tokens
    return dict(ROWS[row], min_length=prompt + tokens)


def _timed(call, kwargs: dict, repeats: int) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(repeats):
        torch.manual_seed(SEED)  # sampling rows draw from the global RNG, as coqui's generate does
        start = time.perf_counter()
        out = call(**kwargs)
        best = min(best, time.perf_counter() - start)
    return best, out


# ---- coqui's own decoding (the subprocess) ------------------------------------------------------------------
def coqui_rows(shape: Shape, rows: list[str], repeats: int, threads: int, progress=print) -> dict:
    """coqui's GPT.generate per row in this process: {row: {"seconds", "tokens"}}, versions, the weights' hash."""
    import transformers

    torch.set_num_threads(threads)
    gpt = build_gpt(shape)
    cond, text = inputs(shape)
    record = {"transformers": transformers.__version__, "coqui_tts": _version("coqui-tts"),
              "weights_sha256": weights_sha256(gpt), "rows": {}}
    with torch.inference_mode():
        for row in rows:
            try:
                gpt.generate(cond, text, **generate_keywords(gpt, text, row, WARM_UP_TOKENS))
                seconds, codes = _timed(functools.partial(gpt.generate, cond, text),
                                        generate_keywords(gpt, text, row, shape.tokens), repeats)
                _check_length(codes, row, shape)
                record["rows"][row] = {"seconds": seconds, "tokens": codes.tolist()}
                progress(f"{row:26s} coqui (transformers {transformers.__version__}) {seconds:8.2f} s")
            except Exception as error:  # reported in the table, not fatal
                record["rows"][row] = {"error": f"{type(error).__name__}: {_first_line(error)}"}
    return record


def _check_length(codes: torch.Tensor, row: str, shape: Shape) -> None:
    expected = (ROWS[row]["num_return_sequences"], shape.tokens)
    if tuple(codes.shape) != expected:
        raise RuntimeError(f"decoded codes of shape {tuple(codes.shape)}, not {expected}")


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0][:200]


def find_venv(venv: str | None) -> str | None:
    """The environment coqui's own decoding runs in: `venv`, else a `.venv457` in the working folder or beside the
    xattn package (an editable install's checkout); None if there is none."""
    if venv is not None:
        return venv
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for folder in (os.getcwd(), here):
        candidate = os.path.join(folder, ".venv457")
        if os.path.exists(_python(candidate)):
            return candidate
    return None


def _python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def run_coqui(venv: str, shape: Shape, rows: list[str], repeats: int, threads: int, progress=print) -> dict:
    """coqui_rows() in `venv`'s Python (a subprocess); {"error": ...} where it cannot run there."""
    if not os.path.exists(_python(venv)):
        return {"error": f"no Python at {_python(venv)}"}
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory(prefix="xattn-bench-tts-") as scratch:
        spec, out = os.path.join(scratch, "spec.json"), os.path.join(scratch, "out.json")
        with open(spec, "w") as f:
            json.dump({"shape": asdict(shape), "rows": rows, "repeats": repeats, "threads": threads}, f)
        with subprocess.Popen([_python(venv), "-m", "xattn.bench.tts", spec, out], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) as worker:
            last = None
            for line in worker.stdout:
                if line.startswith("  "):  # its progress lines, as they come
                    progress(line.strip())
                last = line.strip() or last
        if worker.returncode != 0 or not os.path.exists(out):
            why = last or f"exit status {worker.returncode}"
            return {"error": f"the subprocess in {venv} failed: {why[:300]}"}
        with open(out) as f:
            return json.load(f)


def _worker(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    record = coqui_rows(Shape(**spec["shape"]), spec["rows"], spec["repeats"], spec["threads"],
                        progress=lambda line: print("  " + line, flush=True))
    with open(out_path, "w") as f:
        json.dump(record, f)


# ---- xattn, and the comparison ----------------------------------------------------------------------------------
def _xattn_calls(gpt, cond: torch.Tensor, text: torch.Tensor) -> dict:
    """engine -> call(keywords) -> codes [rows, T]: GPT.generate as the integration installs it in that weight
    format (its copies made once, here)."""
    import types

    from ..integrations import xtts

    model = types.SimpleNamespace(gpt=gpt)  # what enable() reads of an Xtts
    calls = {}
    for weights in ENGINES:
        xtts.enable(model, weights=weights)  # as a user turns it on
        calls[weights] = functools.partial(gpt.generate, cond, text)  # enable()'s call, which keeps its decoder
    xtts.disable(model)
    return calls


def run(shape: Shape = Shape(), rows=tuple(ROWS), repeats: int = 1, threads: int = 2, venv: str | None = None,
        progress=print) -> Report:
    """coqui's own decoding first (in `venv`, a subprocess), then every xattn engine, each row warmed up and timed
    best of `repeats`; the processes run one after the other, never at once."""
    shape.check()
    rows = list(rows)
    audio_codes_per_s = codes_per_second_of_audio()
    venv = find_venv(venv)
    if venv is None:
        coqui = {"error": "no transformers 4.57 environment (.venv457 not found; pass --tts-venv DIR: a venv "
                          "with coqui-tts and transformers 4.57, as .ci/run makes it): coqui's column is skipped"}
    else:
        progress(f"coqui's own decoding in {venv} (a subprocess) ...")
        coqui = run_coqui(venv, shape, rows, repeats, threads, progress)
    if "error" in coqui:
        progress(f"coqui's own decoding: {coqui['error']}")
    own_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _run_xattn(shape, rows, repeats, audio_codes_per_s, coqui, progress)
    finally:
        torch.set_num_threads(own_threads)


def _run_xattn(shape: Shape, rows: list[str], repeats: int, audio_codes_per_s: float, coqui: dict,
               progress) -> Report:
    import transformers

    progress(f"xattn (transformers {transformers.__version__}) ...")
    gpt = build_gpt(shape)
    cond, text = inputs(shape)
    digest = weights_sha256(gpt)
    if "weights_sha256" in coqui and coqui["weights_sha256"] != digest:
        coqui["error"] = "the subprocess built other weights (their hashes differ): its codes are not compared"
        progress(f"coqui's own decoding: {coqui['error']}")
    calls = _xattn_calls(gpt, cond, text)
    measurements = []
    with torch.inference_mode():
        for row in rows:
            own = coqui.get("rows", {}).get(row, {"error": coqui.get("error", "not run")})
            reference = torch.tensor(own["tokens"]) if "tokens" in own and "error" not in coqui else None
            if "seconds" in own:
                measurements.append(_measurement(row, "coqui", own["seconds"], shape, audio_codes_per_s))
            else:
                nan = float("nan")
                measurements.append(Measurement(row, "coqui", nan, ROWS[row]["num_return_sequences"], shape.tokens,
                                                nan, nan, error=own["error"]))
            exact = None
            for engine, call in calls.items():
                call(**generate_keywords(gpt, text, row, WARM_UP_TOKENS))  # warm-up, and the format's copies
                seconds, codes = _timed(call, generate_keywords(gpt, text, row, shape.tokens), repeats)
                _check_length(codes, row, shape)
                m = _measurement(row, engine, seconds, shape, audio_codes_per_s)
                if engine == "exact":
                    exact = codes
                if engine in FP32 and reference is not None:
                    m.tokens_equal_to_coqui = bool(torch.equal(codes, reference))
                elif engine not in FP32 and exact is not None:
                    m.agreement_with_exact = float((codes == exact).float().mean())
                progress(f"{row:26s} xattn {engine:7s} {seconds:8.2f} s  {_tokens_cell(m)}")
                measurements.append(m)
    return Report(shape, audio_codes_per_s, measurements, digest,
                  {k: v for k, v in coqui.items() if k not in ("rows", "weights_sha256")})


def _measurement(row: str, engine: str, seconds: float, shape: Shape, audio_codes_per_s: float) -> Measurement:
    rows = ROWS[row]["num_return_sequences"]
    return Measurement(row, engine, seconds, rows, shape.tokens, rows * shape.tokens / seconds,
                       seconds / (shape.tokens / audio_codes_per_s))


def codes_per_second_of_audio() -> float:
    """Audio codes per second of XTTS's audio, from coqui's own config (see the module docstring)."""
    with _importing():
        from TTS.tts.models.xtts import XttsArgs
    args = XttsArgs()
    return args.input_sample_rate / args.gpt_code_stride_len


def _tokens_cell(m: Measurement) -> str:
    if m.tokens_equal_to_coqui is not None:
        return "same as coqui" if m.tokens_equal_to_coqui else "DIFFER from coqui"
    if m.agreement_with_exact is not None:
        return f"{m.agreement_with_exact:.1%} = exact"
    return "-"


def table(report: Report) -> str:
    """Per row: seconds per call, codes/s, real-time factor, speed-up over coqui's own, token identity."""
    lines = [f"{'row':26s} {'engine':12s} {'s/call':>7s} {'codes/s':>8s} {'RTF':>6s} {'x coqui':>8s}  tokens"]
    coqui = {m.row: m.seconds for m in report.measurements if m.engine == "coqui"}
    for m in report.measurements:
        name = m.engine if m.engine == "coqui" else f"xattn {m.engine}"
        if m.error:
            lines.append(f"{m.row:26s} {name:12s} could not run: {m.error}")
            continue
        base = coqui.get(m.row, float("nan"))
        speedup = "-" if base != base else f"{base / m.seconds:.2f}"
        tokens = "reference" if m.engine == "coqui" else _tokens_cell(m)
        lines.append(f"{m.row:26s} {name:12s} {m.seconds:7.2f} {m.codes_per_s:8.1f} {m.real_time_factor:6.2f} "
                     f"{speedup:>8s}  {tokens}")
    s = report.shape
    lines.append(f"(XTTS v2-shaped GPT: {s.layers} layers x {s.width}, {s.heads} heads, {s.tokens} codes per call = "
                 f"{s.tokens / report.codes_per_second_of_audio:.2f} s of audio at "
                 f"{report.codes_per_second_of_audio:.2f} codes/s; RTF = s/call / s of audio)")
    return "\n".join(lines)


def identical(report: Report) -> bool:
    """No fp32 engine's codes differ from coqui's own."""
    return all(m.tokens_equal_to_coqui is not False for m in report.measurements)


def save(report: Report, path: str, **extra) -> None:
    import transformers

    from ..files import save_json
    from .decode import machine

    record = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "cuda": torch.cuda.is_available(),
        "load_average": os.getloadavg(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "coqui_tts": _version("coqui-tts"),
        "shape": asdict(report.shape),
        "codes_per_second_of_audio": report.codes_per_second_of_audio,
        "weights_sha256": report.weights_sha256,
        "coqui_subprocess": report.coqui,
        "results": [asdict(m) for m in report.measurements],
        **extra,
    }
    save_json(record, path)


if __name__ == "__main__":
    _worker(*sys.argv[1:3])

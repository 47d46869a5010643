"""The `xattn` command."""

from __future__ import annotations

import argparse
import os
import sys

from . import __version__
from .argtypes import POSITIVE, SEED, THREADS, integer, number


def _bench(args) -> int:
    import time

    from .bench import chart, compile_cache, end_to_end, memory
    from .bench import decode as bench
    from .files import check_output

    if args.json:  # checked before a run of many minutes, not after it
        check_output(args.json, "--json", (".json",))
    if args.chart:
        check_output(args.chart, "--chart", (".png",))
    if args.tts:
        return _bench_tts(args)
    if args.serve:
        return _bench_serve(args)

    rows = list(bench.ROWS)[:1] if args.quick else list(bench.ROWS)
    if args.rows:
        unknown = [row for row in args.rows if row not in bench.ROWS]
        if unknown:
            print(f"xattn bench: unknown --rows {unknown}; choose from {list(bench.ROWS)}", file=sys.stderr)
            return 2
        rows = args.rows
    short, long = (4, 8) if args.quick else (args.short, args.long)
    results = bench.run(rows=rows, short=short, long=long, repeats=args.repeats, compiled=args.compile,
                        threads=args.threads, ctranslate2=not args.no_ctranslate2)
    print()
    print(bench.table(results))
    extra = {}
    if args.end_to_end:
        print()
        e2e = end_to_end.run(threads=args.threads)
        print()
        print(end_to_end.table(e2e))
        print(end_to_end.stages_table(e2e))
        extra["end_to_end"] = e2e
    if args.memory:
        print("\nmemory (RSS; each format in a fresh process)")
        footprints = memory.run(threads=args.threads)
        extra["memory"] = memory.as_json(footprints)
    if args.compile:
        print("\ncompile cache: the compiled decode step's first call in a fresh process, then in a second one")
        extra["compile_cache"] = reuse = compile_cache.first_calls(threads=args.threads)
        for name in ("fresh_process", "second_process"):
            print(f"  {name.replace('_', ' '):15s} first call {reuse[name]['first_call_s']:6.1f} s, "
                  f"next call {reuse[name]['next_call_s']:.2f} s")
    if args.json:
        bench.save(results, args.json, **extra)
        print(f"\nwrote {args.json}")
    if args.chart:
        chart.draw(results, extra.get("end_to_end"), args.chart, title=f"{bench.machine()}, {time.strftime('%F')}")
        print(f"wrote {args.chart}")
    fp32_same = all(m.tokens_equal_to_transformers is not False for m in results)
    return 0 if fp32_same else 1


def _bench_tts(args) -> int:
    import importlib.util

    from .bench import tts

    if importlib.util.find_spec("TTS") is None:
        print("xattn bench: --tts builds coqui-tts' XTTS GPT: pip install -e '.[tts-pipelines]'", file=sys.stderr)
        return 2
    mixed = [option for option, value in (("--quick", args.quick), ("--rows", args.rows), ("--compile", args.compile),
                                          ("--end-to-end", args.end_to_end), ("--chart", args.chart),
                                          ("--serve", args.serve), ("--memory", args.memory)) if value]
    if mixed:
        print(f"xattn bench: --tts runs alone; drop {' '.join(mixed)}", file=sys.stderr)
        return 2
    shape = tts.Shape(layers=args.tts_layers, width=args.tts_width, heads=args.tts_heads, tokens=args.tts_tokens,
                      text_tokens=args.tts_text_tokens)
    shape.check()  # a ValueError: main() prints it in one line
    report = tts.run(shape, repeats=args.repeats, threads=args.threads, venv=args.tts_venv)
    print()
    print(tts.table(report))
    if args.json:
        tts.save(report, args.json)
        print(f"\nwrote {args.json}")
    return 0 if tts.identical(report) else 1


def _bench_serve(args) -> int:
    import time

    from .bench import serve
    from .bench.decode import machine
    from .fast.formats import KINDS

    mixed = [option for option, value in (("--quick", args.quick), ("--rows", args.rows), ("--compile", args.compile),
                                          ("--end-to-end", args.end_to_end), ("--tts", args.tts),
                                          ("--memory", args.memory)) if value]
    if mixed:
        print(f"xattn bench: --serve runs alone; drop {' '.join(mixed)}", file=sys.stderr)
        return 2
    for weights in args.serve_weights:
        decoder, _, encoder = weights.partition("+")
        if decoder not in KINDS or (encoder and encoder not in KINDS):
            print(f"xattn bench: --serve-weights {weights!r}: a format ({', '.join(KINDS)}), or decoder+encoder "
                  "formats such as int8+int8", file=sys.stderr)
            return 2
    for path in args.serve_images or []:
        if not os.path.isfile(path):
            print(f"xattn bench: --serve-images: no such file {path}", file=sys.stderr)
            return 2
    report = serve.run(weights=args.serve_weights, clients=args.serve_clients, seconds=args.serve_seconds,
                       soak_s=args.serve_soak_s, max_new_tokens=args.serve_tokens,
                       max_batch_size=args.serve_max_batch_size, threads=args.threads,
                       image_paths=args.serve_images, checkpoint=args.serve_captioner)
    print()
    print(serve.table(report))
    if args.json:
        serve.save(report, args.json)
        print(f"\nwrote {args.json}")
    if args.chart:
        serve.draw(report, args.chart, title=f"{machine()}, {time.strftime('%F')}")
        print(f"wrote {args.chart}")
    same = all(share == 1.0 for name, share in serve.parity(report).items() if "(exact)" in name)
    return 0 if serve.failed(report) == 0 and same else 1


def _generation_kwargs(args) -> dict:
    names = ("max_new_tokens", "num_beams", "num_return_sequences", "do_sample", "temperature", "top_k", "top_p",
             "repetition_penalty", "length_penalty")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _add_generation_flags(parser) -> None:
    group = parser.add_argument_group("generation (as in transformers' generate; unset = the model's default)")
    group.add_argument("--max-new-tokens", type=POSITIVE, help="tokens to generate at most")
    group.add_argument("--num-beams", type=POSITIVE, help="beam search with this many beams (1: no beam search)")
    group.add_argument("--num-return-sequences", type=POSITIVE, help="results per input (at most --num-beams "
                       "with beam search)")
    group.add_argument("--do-sample", action=argparse.BooleanOptionalAction, help="sample instead of picking the "
                       "likeliest token (--no-do-sample: don't, where the model's default samples)")
    group.add_argument("--temperature", type=number(0, low_open=True), help="sampling temperature (> 0)")
    group.add_argument("--top-k", type=integer(0), help="sample among the k likeliest tokens (0: all)")
    group.add_argument("--top-p", type=number(0, 1, low_open=True), help="nucleus sampling: the likeliest tokens "
                       "whose probabilities sum to p, 0 < p <= 1")
    group.add_argument("--repetition-penalty", type=number(0, low_open=True), help="> 1 discourages repeats")
    group.add_argument("--length-penalty", type=number(), help="beam search: exponent of the length "
                       "normalisation")
    group.add_argument("--seed", type=SEED, help="seed for sampling (0 to 2**63 - 1)")


def _caption(args) -> int:
    import torch

    from .files import check_output
    from .tasks.captioning import Captioner, image_files
    from .tasks.vision import load_image

    if args.attention_map:
        if len(args.images) != 1 or os.path.isdir(args.images[0]):
            raise ValueError("--attention-map draws one image: pass exactly one image file")
        check_output(args.attention_map, "--attention-map", (".png",))
        image = load_image(args.images[0])
    files, output = _claim_job(args, image_files(args.images))
    try:
        if args.seed is not None:
            torch.manual_seed(args.seed)
        captioner = Captioner(args.model, compile=args.compile, allow_pickle=args.allow_pickle, weights=args.weights,
                              revision=args.revision, encoder_weights=args.encoder_weights)
        if args.attention_map:
            print(captioner.attention_map(image, args.attention_map, **_generation_kwargs(args)))
            print(f"wrote {args.attention_map}", file=sys.stderr)
            return 0
        return _run_files(args, files, output, captioner.load, captioner.caption_results)
    finally:
        if output is not None:
            output.close()


def _transcribe(args) -> int:
    import torch

    from .tasks.transcription import Transcriber, audio_files

    files, output = _claim_job(args, audio_files(args.audio))
    try:
        if args.seed is not None:
            torch.manual_seed(args.seed)
        transcriber = Transcriber(args.model, max_seconds=args.max_seconds, compile=args.compile,
                                  allow_pickle=args.allow_pickle, weights=args.weights, revision=args.revision,
                                  pad_to_stride=args.pad_to_stride, encoder_weights=args.encoder_weights)
        return _run_files(args, files, output, transcriber.load, transcriber.transcribe_results)
    finally:
        if output is not None:
            output.close()


def _speak(args) -> int:
    import time

    import numpy as np
    import soundfile
    import torch

    from .files import cannot_write, check_output, replaced_atomically
    from .tasks.audio_codes import SAMPLE_RATE
    from .tasks.speech_synthesis import Speaker, check_text

    check_text(args.text)
    if (args.num_return_sequences or 1) > 1:  # candidates past the first would be computed and thrown away
        raise ValueError("--num-return-sequences: speak writes one audio; leave it at 1")
    check_output(args.output, "-o", (".wav", ".flac", ".aiff", ".aif"))
    if args.spectrogram:
        check_output(args.spectrogram, "--spectrogram", (".png",))
    speaker = Speaker(args.model, revision=args.revision)
    speaker.check_voice(args.voice)
    kwargs = _generation_kwargs(args)
    if args.seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    # written beside the target and renamed when complete: a refusal or a kill leaves an existing file as it was
    try:
        with replaced_atomically(args.output) as tmp, \
                soundfile.SoundFile(tmp, "w", samplerate=SAMPLE_RATE, channels=1, subtype="PCM_16") as out:
            if args.stream:
                pieces = []
                for i, piece in enumerate(speaker.stream(args.text, args.voice, **kwargs)):
                    if i == 0:
                        print(f"first audio after {time.perf_counter() - start:.2f} s", file=sys.stderr)
                    out.write(piece)
                    out.flush()
                    pieces.append(piece)
                audio = np.concatenate(pieces) if pieces else np.zeros(0, np.float32)
            else:
                audio = speaker.speak(args.text, args.voice, **kwargs)
                out.write(audio)
    except (OSError, soundfile.SoundFileRuntimeError) as error:
        raise cannot_write("-o", args.output, error) from None
    seconds = len(audio) / SAMPLE_RATE
    print(f"wrote {args.output}: {seconds:.2f} s of audio in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    if args.spectrogram:
        from .tasks.audio_codes import draw_spectrogram, log_mel

        draw_spectrogram(log_mel(audio), args.spectrogram, title=f"{args.voice or speaker.voices[0]}: {args.text}")
        print(f"wrote {args.spectrogram}", file=sys.stderr)
    return 0


def _serve(args) -> int:
    """The HTTP service (xattn/serve/): FastAPI + uvicorn, one process or --workers processes sharing the port."""
    import dataclasses
    import json
    import tempfile

    import uvicorn

    from .serve.app import API_KEY_ENV, SETTINGS_ENV, Models, Settings, create_app

    threads = args.threads or max(1, (os.cpu_count() or 1) // args.workers)
    settings = Settings(captioner=args.captioner, recognizer=args.recognizer, speaker=args.speaker,
                        max_batch_size=args.max_batch_size, max_queue=args.max_queue,
                        max_upload_mb=args.max_upload_mb, timeout_s=args.timeout_s,
                        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                        batching=not args.no_batching, inflight=not args.no_inflight, max_seconds=args.max_seconds,
                        threads=threads, weights=args.weights,
                        encoder_weights=args.encoder_weights)
    common = dict(host=args.host, port=args.port, timeout_graceful_shutdown=args.graceful_shutdown_s,
                  log_level="warning" if args.quiet else "info")
    if args.workers == 1:  # models load here, so a bad --captioner is a one-line error before the port opens
        uvicorn.run(create_app(settings), **common)
        return 0
    # each worker loads the models itself; check them once here first (one line, before any process starts)
    Models(settings)
    os.environ[SETTINGS_ENV] = json.dumps(dataclasses.asdict(dataclasses.replace(settings, api_key=None)))
    if settings.api_key:
        os.environ[API_KEY_ENV] = settings.api_key
    with tempfile.TemporaryDirectory(prefix="xattn-metrics-") as folder:
        os.environ.setdefault("PROMETHEUS_MULTIPROC_DIR", folder)  # /metrics sums the workers' counts
        uvicorn.run("xattn.serve.app:app_from_env", factory=True, workers=args.workers, **common)
    return 0


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes I/N, e.g. 0/4, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return index, count


def _claim_job(args, files: list[str]):
    """The job's files (this shard's) and its claimed JSONL output (None: one file printed), before any work."""
    from .jobs import JobOutput

    if not files:
        raise ValueError("no input files found in the given paths")
    if args.shard:  # every file, sorted paths included, lands in exactly one shard
        index, count = args.shard
        files = files[index::count]
    if getattr(args, "attention_map", None) or (args.output is None and len(files) == 1):
        return files, None
    return files, JobOutput(args.output)


def _run_files(args, files: list[str], output, load, infer) -> int:
    """One file without --output: print its result. Otherwise a batched, resumable JSONL job with a progress
    bar; infer(items, **generation kwargs) -> num_return_sequences result records per item (tasks/confidence).
    A low-confidence result also gets one line on stderr."""
    from .jobs import run_batches

    kwargs = _generation_kwargs(args)
    per_file = kwargs.get("num_return_sequences", 1)

    def process(items):
        out = infer(items, **kwargs)
        if per_file == 1:
            return out
        names = [n for n in out[0] if n != "low_confidence_reason"] + ["low_confidence_reason"]
        return [{n + "s": [r.get(n) for r in out[i * per_file: (i + 1) * per_file]] for n in names}
                for i in range(len(items))]

    def warn(record):
        for reason in filter(None, record.get("low_confidence_reasons", [record.get("low_confidence_reason")])):
            print(f"xattn {args.command}: low confidence: {record['file']}: {reason}", file=sys.stderr)

    if output is None:
        result = process([load(files[0])])[0]
        print(next(v for v in result.values()))
        warn({"file": files[0], **result})
        return 0
    failed = run_batches(files, load, process, output, args.batch_size, progress=not args.quiet,
                         desc={"caption": "captioning", "transcribe": "transcribing"}.get(args.command, args.command),
                         on_record=warn)
    if failed:
        where = "see their 'error' lines" + (f" in {output.path}" if output.path else "")
        print(f"{failed} of {len(files)} files failed ({where})", file=sys.stderr)
    return 1 if failed else 0


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block), exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _bench_parser(commands) -> argparse.ArgumentParser:
    bench = commands.add_parser("bench", help="decode speed side by side with transformers and CTranslate2 "
                                "(ViT-B/16 + GPT-2 small)")
    bench.add_argument("--quick", action="store_true", help="one row (B=1 greedy), short runs")
    bench.add_argument("--rows", nargs="+", metavar="ROW", help="only these rows, e.g. --rows 'B=8 beam 4'")
    bench.add_argument("--compile", action="store_true", help="add the torch.compile'd decode step, its compile "
                       "time, and a second process reusing the compile cache")
    bench.add_argument("--end-to-end", action="store_true", help="add images/s captioning 64 images in batches of 16")
    bench.add_argument("--memory", action="store_true", help="add each weight format's memory: the model alone, "
                       "+ the format's copies, the peak while generating (a fresh process per format)")
    bench.add_argument("--no-ctranslate2", action="store_true", help="leave CTranslate2 out even when installed")
    bench.add_argument("--chart", metavar="PNG", help="draw the results")
    bench.add_argument("--short", type=POSITIVE, default=8, help="generation length of the short run")
    bench.add_argument("--long", type=POSITIVE, default=24, help="generation length of the long run")
    bench.add_argument("--repeats", type=POSITIVE, default=2, help="best of this many runs per measurement")
    bench.add_argument("--threads", type=THREADS, default=2, help="torch threads")
    bench.add_argument("--json", help="also write the results here (JSON)")
    tts = bench.add_argument_group("--tts: XTTS v2's GPT stage, xattn vs coqui-tts' own decoding (transformers 4.57)")
    tts.add_argument("--tts", action="store_true", help="run this bench instead (coqui-tts' GPT module, random "
                     "weights; needs the tts-pipelines extra)")
    tts.add_argument("--tts-venv", metavar="DIR", help="the venv with coqui-tts and transformers 4.57 that runs "
                     "coqui's own decoding (default: .venv457 where it exists; without one that column is skipped)")
    tts.add_argument("--tts-layers", type=POSITIVE, default=30, help="GPT layers (XTTS v2: 30)")
    tts.add_argument("--tts-width", type=POSITIVE, default=1024, help="GPT width (XTTS v2: 1024)")
    tts.add_argument("--tts-heads", type=POSITIVE, default=16, help="attention heads (XTTS v2: 16)")
    tts.add_argument("--tts-tokens", type=POSITIVE, default=250, help="audio codes per call (250: 11.6 s of audio)")
    tts.add_argument("--tts-text-tokens", type=POSITIVE, default=100, help="text ids in the prefix")
    load = bench.add_argument_group("--serve: HTTP load on /v1/caption, xattn serve (in-flight, one at a time) vs "
                                    "transformers' generate behind the same API")
    load.add_argument("--serve", action="store_true", help="run this bench instead (loopback, one server at a time)")
    load.add_argument("--serve-clients", type=POSITIVE, nargs="+", default=[1, 8, 32, 128], metavar="N",
                      help="concurrent clients of each level")
    load.add_argument("--serve-seconds", type=number(0, low_open=True), default=60.0, help="seconds per level")
    load.add_argument("--serve-soak-s", type=number(0), default=600.0, help="then this many seconds at 32 clients "
                      "on the first server, its RSS sampled each second (0: no soak)")
    load.add_argument("--serve-weights", nargs="+", default=["exact"], metavar="FORMAT", help="xattn's servers in "
                      "each of these weight formats: exact, packed, bf16, int8, or decoder+encoder as int8+int8")
    load.add_argument("--serve-tokens", type=POSITIVE, default=16, help="max_new_tokens of each request")
    load.add_argument("--serve-max-batch-size", type=POSITIVE, default=32, help="the batching servers' "
                      "--max-batch-size")
    load.add_argument("--serve-images", nargs="+", metavar="FILE", help="images to post (default: the shipped "
                      "samples, data/samples/scene-*)")
    load.add_argument("--serve-captioner", metavar="DIR", help="this checkpoint instead of the benchmark model")
    bench.set_defaults(run=_bench)
    return bench


def _job_parser(commands, name: str, run, inputs: str, inputs_help: str, what: str) -> argparse.ArgumentParser:
    """caption / transcribe: files or folders in, JSON lines out, batched and resumable."""
    from .fast.formats import KINDS

    job = commands.add_parser(name, help=f"{name} {inputs} (files or folders) with a {what} model")
    job.add_argument(inputs, nargs="+", help=inputs_help)
    _add_model_flags(job, "checkpoint directory or hub id (default: the shipped model)")
    job.add_argument("--output", "-o", help="JSON lines output (- for standard output); re-running resumes after "
                     "what is done")
    job.add_argument("--batch-size", type=POSITIVE, default=16, help="files per batch")
    job.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    job.add_argument("--quiet", action="store_true", help="no progress bar")
    job.add_argument("--weights", default="exact", choices=KINDS, help="the decoder's weight format: exact "
                     "(transformers' own tensors, identical tokens), packed (fp32 copies), bf16 or int8 "
                     "(faster, small differences; see the README's Performance section)")
    job.add_argument("--encoder-weights", choices=KINDS, help="the encoder's weight format too (with the decoder's "
                     "cross K/V projection): bf16 runs a ViT's products on AMX or AVX-512 BF16 where the CPU has them, "
                     "int8 through fbgemm; default: transformers' own encoder in fp32")
    job.add_argument("--allow-pickle", action="store_true", help="also load pickle-based weights "
                     "(pytorch_model.bin), through torch.load(weights_only=True); only for checkpoints you trust")
    job.add_argument("--shard", type=_shard, metavar="I/N", help="process only the I-th of N equal shares of "
                     "the files (I from 0); run N such jobs on N processes or machines, each resumable")
    _add_generation_flags(job)
    job.set_defaults(run=run)
    return job


def _add_model_flags(command, model_help: str) -> None:
    command.add_argument("--model", help=model_help)
    command.add_argument("--revision", help="with a hub id: the branch, tag or commit to load (as from_pretrained's "
                         "revision; default: main)")


def _speak_parser(commands) -> argparse.ArgumentParser:
    speak = commands.add_parser("speak", help="text to speech with the shipped TTS (or a TTS checkpoint)")
    speak.add_argument("text", help="what to say: letters a-z, spaces, apostrophes (digits as words)")
    speak.add_argument("--output", "-o", default="speech.wav", help="audio file to write (.wav, .flac, .aiff)")
    speak.add_argument("--voice", help="one of the model's voices (default: its first)")
    _add_model_flags(speak, "TTS checkpoint directory or hub id (default: the shipped one)")
    speak.add_argument("--stream", action="store_true", help="write audio chunk by chunk while it is generated "
                       "and report the time to the first chunk")
    speak.add_argument("--spectrogram", metavar="PNG", help="also draw the output's mel spectrogram")
    _add_generation_flags(speak)
    speak.set_defaults(run=_speak)
    return speak


def _serve_parser(commands) -> argparse.ArgumentParser:
    from .fast.formats import KINDS

    serve = commands.add_parser("serve", help="HTTP service: /v1/caption, /v1/audio/transcriptions, /v1/audio/speech "
                                "(FastAPI + uvicorn; API docs at /docs)")
    for name, kind in (("captioner", "VisionEncoderDecoder"), ("recognizer", "SpeechEncoderDecoder"),
                       ("speaker", "TTS")):
        serve.add_argument(f"--{name}", help=f"{kind} checkpoint directory or hub id (default: the shipped one; "
                           f"none: no {name})")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=integer(0, 65535), default=8000, help="port to listen on")
    serve.add_argument("--workers", type=POSITIVE, default=1, help="processes sharing the port, each with its own "
                       "models and batches")
    serve.add_argument("--threads", type=THREADS, help="torch threads per worker (default: the cores / --workers)")
    serve.add_argument("--max-batch-size", type=POSITIVE, default=16, help="requests run together at most")
    serve.add_argument("--max-queue", type=POSITIVE, default=64, help="requests waiting per task beyond which new "
                       "ones get 429 with Retry-After")
    serve.add_argument("--max-upload-mb", type=number(0, low_open=True), default=20.0, help="largest request body "
                       "(413 beyond it)")
    serve.add_argument("--timeout-s", type=number(0, low_open=True), default=60.0, help="per-request deadline "
                       "(504 beyond it; a request still waiting is dropped)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ (401 without it); default: "
                       "the XATTN_API_KEY environment variable, else open")
    serve.add_argument("--weights", default="exact", choices=KINDS, help="the captioner's and recognizer's decoder "
                       "weight format (as xattn caption --weights)")
    serve.add_argument("--encoder-weights", choices=KINDS, help="their encoders' weight format too, with the "
                       "decoder's cross K/V projection (as xattn caption --encoder-weights); default: transformers' "
                       "own encoder in fp32")
    serve.add_argument("--no-batching", action="store_true", help="run one request at a time")
    serve.add_argument("--no-inflight", action="store_true", help="caption in micro-batches of the requests that "
                       "wait together, instead of joining each request to the running decode batch")
    serve.add_argument("--max-seconds", type=number(0, low_open=True), default=20.0,
                       help="the recognizer refuses longer audio (as xattn transcribe)")
    serve.add_argument("--graceful-shutdown-s", type=number(0, low_open=True), default=30.0,
                       help="on SIGTERM, how long requests in flight may take to finish")
    serve.add_argument("--quiet", action="store_true", help="log warnings only, not each request")
    serve.set_defaults(run=_serve)
    return serve


def parser() -> argparse.ArgumentParser:
    """The `xattn` command line: bench, caption, transcribe, speak, train, serve."""
    from .train import command as train_command

    top = _Parser(prog="xattn", description=__doc__)
    top.add_argument("--version", action="version", version=f"xattn {__version__}")
    commands = top.add_subparsers(dest="command", required=True)
    subs = [_bench_parser(commands)]
    caption = _job_parser(commands, "caption", _caption, "images", "image files or folders of images",
                          "VisionEncoderDecoder")
    caption.add_argument("--attention-map", metavar="PNG", help="draw each word's attention over the image")
    transcribe = _job_parser(commands, "transcribe", _transcribe, "audio", "audio files (wav, flac, ogg, ...; "
                             "any rate, mono or stereo) or folders of them", "SpeechEncoderDecoder")
    transcribe.add_argument("--max-seconds", type=number(0, low_open=True), default=20.0,
                            help="refuse longer audio (the shipped model heard at most ~4 s in training)")
    transcribe.add_argument("--pad-to-stride", action="store_true",
                            help="pad each clip to whole stacks of the feature extractor's frames, as the training "
                            "batches do (SeamlessM4T / Wav2Vec2-BERT extractors), instead of transformers' own call "
                            "(its ASR pipeline's), which drops the last frames that fill no stack")
    train = commands.add_parser("train", help="fine-tune or train a captioner, recognizer or speaker "
                                "(= recipes/finetune.py)")
    train_command.add_arguments(train)
    train.set_defaults(run=train_command.main)
    subs += [caption, transcribe, _speak_parser(commands), train, _serve_parser(commands)]
    for sub in subs:
        sub.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    return top


def main(argv: list[str] | None = None) -> int:
    from .jobs import one_line

    try:
        args = parser().parse_args(argv)
    except SystemExit as done:  # --help, or a usage error already printed in one line
        return int(done.code or 0)
    if not args.debug:  # transformers' per-file loading bars are noise around our one-line answers
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return args.run(args)
    except (ValueError, OSError, RuntimeError, MemoryError) as error:
        if args.debug:
            raise
        print(f"xattn {args.command}: error: {one_line(error)}", file=sys.stderr)
        return 2
    except Exception as error:  # safetensors' SafetensorError and the like: still one line
        if args.debug or type(error).__module__.split(".")[0] not in ("safetensors", "tokenizers", "PIL"):
            raise
        print(f"xattn {args.command}: error: {one_line(error)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: one line (what was written stays: checkpoints, a job's finished lines)
        if args.debug:
            raise
        after = f"; rerun with --resume to continue from the last checkpoint in {args.out}" \
            if args.command == "train" else ""
        print(f"\nxattn {args.command}: interrupted{after}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

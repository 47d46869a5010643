"""The `xattn` command."""

from __future__ import annotations

import argparse
import os
import sys


def _bench(args) -> int:
    import time

    from .bench import chart, compile_cache, end_to_end
    from .bench import decode as bench

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
        extra["end_to_end"] = e2e
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


def _generation_kwargs(args) -> dict:
    names = ("max_new_tokens", "num_beams", "num_return_sequences", "do_sample", "temperature", "top_k", "top_p",
             "repetition_penalty", "length_penalty")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None and getattr(args, n) is not False}


def _add_generation_flags(parser) -> None:
    group = parser.add_argument_group("generation (as in transformers' generate; unset = the model's default)")
    group.add_argument("--max-new-tokens", type=int)
    group.add_argument("--num-beams", type=int)
    group.add_argument("--num-return-sequences", type=int)
    group.add_argument("--do-sample", action="store_true")
    group.add_argument("--temperature", type=float)
    group.add_argument("--top-k", type=int)
    group.add_argument("--top-p", type=float)
    group.add_argument("--repetition-penalty", type=float)
    group.add_argument("--length-penalty", type=float)
    group.add_argument("--seed", type=int, help="seed for sampling")


def _caption(args) -> int:
    import torch

    from .captioning import Captioner, image_files
    from .vision import load_image

    if args.seed is not None:
        torch.manual_seed(args.seed)
    captioner = Captioner(args.model, compile=args.compile, allow_pickle=args.allow_pickle, weights=args.weights)
    kwargs = _generation_kwargs(args)
    if args.attention_map:
        if len(args.images) != 1 or os.path.isdir(args.images[0]):
            raise ValueError("--attention-map draws one image: pass exactly one image file")
        caption = captioner.attention_map(load_image(args.images[0]), args.attention_map, **kwargs)
        print(caption)
        print(f"wrote {args.attention_map}", file=sys.stderr)
        return 0
    return _run_files(args, image_files(args.images), load_image, captioner.caption, "caption")


def _transcribe(args) -> int:
    from .speech import Transcriber, audio_files

    if args.seed is not None:
        import torch

        torch.manual_seed(args.seed)
    transcriber = Transcriber(args.model, max_seconds=args.max_seconds, compile=args.compile,
                              allow_pickle=args.allow_pickle, weights=args.weights)
    return _run_files(args, audio_files(args.audio), transcriber.load, transcriber.transcribe, "text")


def _speak(args) -> int:
    import time

    import numpy as np
    import soundfile
    import torch

    from .codes import SAMPLE_RATE
    from .speak import Speaker

    speaker = Speaker(args.model)
    kwargs = _generation_kwargs(args)
    if args.seed is not None:
        kwargs["generator"] = torch.Generator().manual_seed(args.seed)
    start = time.perf_counter()
    with soundfile.SoundFile(args.output, "w", samplerate=SAMPLE_RATE, channels=1, subtype="PCM_16") as out:
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
    seconds = len(audio) / SAMPLE_RATE
    print(f"wrote {args.output}: {seconds:.2f} s of audio in {time.perf_counter() - start:.2f} s", file=sys.stderr)
    if args.spectrogram:
        from .codes import draw_spectrogram, log_mel

        draw_spectrogram(log_mel(audio), args.spectrogram, title=f"{args.voice or speaker.voices[0]}: {args.text}")
        print(f"wrote {args.spectrogram}", file=sys.stderr)
    return 0


def _shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes I/N, e.g. 0/4, got {text!r}") from None
    if not 0 <= index < count:
        raise argparse.ArgumentTypeError(f"--shard I/N needs 0 <= I < N, got {text!r}")
    return index, count


def _run_files(args, files: list[str], load, infer, key: str) -> int:
    """One file without --output: print its result. Otherwise a batched, resumable JSONL job with a progress
    bar; infer(items, **generation kwargs) -> num_return_sequences strings per item."""
    from .jobs import run_batches

    if not files:
        raise ValueError("no input files found in the given paths")
    if args.shard:  # every file, sorted paths included, lands in exactly one shard
        index, count = args.shard
        files = files[index::count]
    kwargs = _generation_kwargs(args)
    per_file = kwargs.get("num_return_sequences", 1)

    def process(items):
        out = infer(items, **kwargs)
        if per_file == 1:
            return [{key: text} for text in out]
        return [{key + "s": out[i * per_file : (i + 1) * per_file]} for i in range(len(items))]

    if args.output is None and len(files) == 1:
        result = process([load(files[0])])[0]
        print(result.get(key, result.get(key + "s")))
        return 0
    failed = run_batches(files, load, process, args.output, args.batch_size, progress=not args.quiet,
                         desc={"caption": "captioning", "transcribe": "transcribing"}.get(args.command, args.command))
    if failed:
        print(f"{failed} of {len(files)} files failed (see their 'error' in the output)", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    from .weights import KINDS

    parser = argparse.ArgumentParser(prog="xattn", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="decode speed side by side with transformers and CTranslate2 "
                                "(ViT-B/16 + GPT-2 small)")
    bench.add_argument("--quick", action="store_true", help="one row (B=1 greedy), short runs")
    bench.add_argument("--rows", nargs="+", metavar="ROW", help="only these rows, e.g. --rows 'B=8 beam 4'")
    bench.add_argument("--compile", action="store_true", help="add the torch.compile'd decode step, its compile "
                       "time, and a second process reusing the compile cache")
    bench.add_argument("--end-to-end", action="store_true", help="add images/s captioning 64 images in batches of 16")
    bench.add_argument("--no-ctranslate2", action="store_true", help="leave CTranslate2 out even when installed")
    bench.add_argument("--chart", metavar="PNG", help="draw the results")
    bench.add_argument("--short", type=int, default=8, help="generation length of the short run")
    bench.add_argument("--long", type=int, default=24, help="generation length of the long run")
    bench.add_argument("--repeats", type=int, default=2, help="best of this many runs per measurement")
    bench.add_argument("--threads", type=int, default=2, help="torch threads")
    bench.add_argument("--json", help="also write the results here (JSON)")
    bench.set_defaults(run=_bench)

    caption = commands.add_parser("caption", help="caption images (files or folders) with a VisionEncoderDecoder model")
    caption.add_argument("images", nargs="+", help="image files or folders of images")
    caption.add_argument("--model", help="checkpoint directory or hub id (default: the shipped scene captioner)")
    caption.add_argument("--output", "-o", help="JSON lines output; re-running resumes after what is done")
    caption.add_argument("--batch-size", type=int, default=16)
    caption.add_argument("--attention-map", metavar="PNG", help="draw each word's attention over the image")
    caption.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    caption.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_generation_flags(caption)
    caption.set_defaults(run=_caption)

    transcribe = commands.add_parser("transcribe", help="transcribe audio files (or folders) with a "
                                     "SpeechEncoderDecoder model")
    transcribe.add_argument("audio", nargs="+", help="audio files (wav, flac, ogg, ...; any rate, mono or stereo) "
                            "or folders of them")
    transcribe.add_argument("--model", help="checkpoint directory or hub id (default: the shipped digit recognizer)")
    transcribe.add_argument("--output", "-o", help="JSON lines output; re-running resumes after what is done")
    transcribe.add_argument("--batch-size", type=int, default=16)
    transcribe.add_argument("--max-seconds", type=float, default=20.0,
                            help="refuse longer audio (the shipped model heard at most ~4 s in training)")
    transcribe.add_argument("--compile", action="store_true", help="torch.compile the decode step")
    transcribe.add_argument("--quiet", action="store_true", help="no progress bar")
    _add_generation_flags(transcribe)
    transcribe.set_defaults(run=_transcribe)

    speak = commands.add_parser("speak", help="text to speech with the shipped TTS (or a TTS checkpoint)")
    speak.add_argument("text", help="what to say: letters a-z, spaces, apostrophes (digits as words)")
    speak.add_argument("--output", "-o", default="speech.wav", help="wav file to write")
    speak.add_argument("--voice", help="one of the model's voices (default: its first)")
    speak.add_argument("--model", help="TTS checkpoint directory (default: the shipped one)")
    speak.add_argument("--stream", action="store_true", help="write audio chunk by chunk while it is generated "
                       "and report the time to the first chunk")
    speak.add_argument("--spectrogram", metavar="PNG", help="also draw the output's mel spectrogram")
    _add_generation_flags(speak)
    speak.set_defaults(run=_speak)

    train = commands.add_parser("train", help="fine-tune or train a captioner or recognizer (= recipes/finetune.py)")
    from . import finetune

    finetune.add_arguments(train)
    train.set_defaults(run=finetune.main)

    for sub in (caption, transcribe):
        sub.add_argument("--weights", default="exact", choices=KINDS, help="the decoder's weight format: exact "
                         "(transformers' own tensors, identical tokens), packed (fp32 copies), bf16 or int8 "
                         "(faster, small differences; see the README's Performance section)")
        sub.add_argument("--allow-pickle", action="store_true", help="also load pickle-based weights "
                         "(pytorch_model.bin), through torch.load(weights_only=True); only for checkpoints you trust")
        sub.add_argument("--shard", type=_shard, metavar="I/N", help="process only the I-th of N equal shares of "
                         "the files (I from 0); run N such jobs on N processes or machines, each resumable")
    for sub in (bench, caption, transcribe, speak, train):
        sub.add_argument("--debug", action="store_true", help="show tracebacks instead of one-line errors")
    args = parser.parse_args(argv)
    if not args.debug:  # transformers' per-file loading bars are noise around our one-line answers
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        return args.run(args)
    except ValueError as error:
        if args.debug:
            raise
        print(f"xattn {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

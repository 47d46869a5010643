"""The FastAPI app: /v1/caption, /v1/audio/transcriptions (OpenAI's form fields), /v1/audio/speech (streamed wav),
/health, /metrics, FastAPI's /docs. Each task has its own batcher and worker thread; uploads are read with the
CLI's loaders in a small thread pool, before they join any queue, so a bad file never reaches a batch."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, FastAPI, File, Form, Request, UploadFile
from fastapi.responses import PlainTextResponse, RedirectResponse, Response, StreamingResponse
from fastapi.security import HTTPBearer

from .. import __version__
from .batcher import Batcher, QueueFull
from .fields import SpeechRequest, flag, openai_temperature, request_options, with_generation_fields
from .inflight import InflightBatcher
from .limits import ApiError, LimitsMiddleware, add_error_handlers, deadline_left, file_error
from .metrics import MeasuredMiddleware, Metrics
from .options import FIELDS, Generation, shown
from .runners import (
    ATTENTION,
    CaptionItem,
    CaptionRequests,
    SpeechItem,
    Uploads,
    attention_map_png,
    caption_batch,
    pcm16,
    speech_batch,
    transcribe_batch,
    wav_header,
)

SETTINGS_ENV = "XATTN_SERVE_SETTINGS"  # how `xattn serve --workers N` hands its settings to each worker process
API_KEY_ENV = "XATTN_API_KEY"
STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")  # the web page, when there is one
OFF = "none"  # --captioner none: this server does not caption


@dataclass(frozen=True)
class Settings:
    captioner: str | None = None  # checkpoint folder or hub id; None: the shipped one; "none": no /v1/caption
    recognizer: str | None = None  # the same for /v1/audio/transcriptions
    speaker: str | None = None  # the same for /v1/audio/speech
    max_batch_size: int = 16  # requests run together at most (per task)
    max_queue: int = 64  # requests waiting per task beyond which new ones get 429
    max_upload_mb: float = 20.0  # request body limit (413)
    timeout_s: float = 60.0  # per-request deadline from its first byte (504)
    api_key: str | None = None  # bearer token required on /v1/ (401); None: open
    batching: bool = True  # False: one request at a time (max_batch_size 1)
    inflight: bool = True  # captions join the running decode batch (serve/inflight.py); False: micro-batches
    max_seconds: float = 20.0  # the recognizer refuses longer audio, as `xattn transcribe --max-seconds`
    threads: int | None = None  # torch threads in this process; None: torch's default
    weights: str = "exact"  # the captioner's and recognizer's decoder weight format, as `xattn caption --weights`
    encoder_weights: str | None = None  # their encoders' format too (XattnModel.with_weights); None: transformers'


class Models:
    """The task objects the app serves (each None when off): the CLI's Captioner, Transcriber and Speaker, or
    anything with their methods (tests wrap them)."""

    def __init__(self, settings: Settings, captioner=None, transcriber=None, speaker=None):
        self.captioner = captioner if captioner is not None else _load("captioner", settings)
        self.transcriber = transcriber if transcriber is not None else _load("recognizer", settings)
        self.speaker = speaker if speaker is not None else _load("speaker", settings)


def _load(kind: str, settings: Settings):
    name = getattr(settings, kind)
    if name == OFF:
        return None
    formats = dict(weights=settings.weights, encoder_weights=settings.encoder_weights)
    if kind == "captioner":
        from ..tasks.captioning import Captioner

        return Captioner(name, **formats)
    if kind == "recognizer":
        from ..tasks.transcription import Transcriber

        return Transcriber(name, max_seconds=settings.max_seconds, **formats)
    from ..tasks.speech_synthesis import Speaker

    return Speaker(name)


def create_app(settings: Settings | None = None, *, captioner=None, transcriber=None, speaker=None) -> FastAPI:
    """The app; models are loaded here (the shipped ones unless settings say otherwise) unless given."""
    settings = settings or Settings()
    if settings.api_key is not None and not (settings.api_key.isascii() and settings.api_key.isprintable()):
        raise ValueError("--api-key: use printable ASCII characters (an HTTP header carries the key as bytes)")
    if settings.threads:
        import torch

        torch.set_num_threads(settings.threads)
    models = Models(settings, captioner, transcriber, speaker)
    metrics = Metrics()
    uploads = Uploads()
    loading = ThreadPoolExecutor(max_workers=2, thread_name_prefix="xattn-load")  # decode + preprocess uploads
    batch_size = settings.max_batch_size if settings.batching else 1
    batchers: dict[str, Batcher] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # the models' Python objects (hundreds of thousands with transformers' modules) moved out of the collector's
        # reach: otherwise each full collection walks them all while every decoding request waits
        gc.collect()
        gc.freeze()
        runs = {"caption": (models.captioner, caption_batch), "transcribe": (models.transcriber, transcribe_batch),
                "speech": (models.speaker, speech_batch)}
        for task, (model, batch) in runs.items():
            if model is None:
                continue
            if task == "caption" and settings.batching and settings.inflight:  # max_batch_size: decoding rows
                batchers[task] = InflightBatcher(task, CaptionRequests(model, metrics), batch_size, settings.max_queue,
                                                 metrics)
            else:
                batchers[task] = Batcher(task, batch(model, metrics), batch_size, settings.max_queue, metrics)
            batchers[task].start()
        try:
            yield
        finally:
            for batcher in batchers.values():
                await batcher.stop()
            loading.shutdown(wait=False, cancel_futures=True)
            uploads.close()
            gc.unfreeze()  # an app made again in this process (tests) freezes its own

    app = FastAPI(title="xattn", version=__version__, lifespan=lifespan,
                  description="Captioning, transcription and speech with xattn's GPT-2 cross-attention decoders. "
                  "Generation options are the CLI's flags (`xattn caption --help`) with underscores.")
    app.state.settings, app.state.models, app.state.metrics, app.state.batchers = settings, models, metrics, batchers
    bearer = [] if not settings.api_key else [Depends(_security)]  # checked by LimitsMiddleware; here for the docs
    add_error_handlers(app)

    def batcher(task: str) -> Batcher:
        if task not in batchers:
            raise ApiError(404, f"this server runs no {_NAMES[task]} (see xattn serve --help)")
        return batchers[task]

    async def run(request: Request, work) -> Any:
        """work()'s result within the request's deadline; the work is cancelled (its queued request dropped) when
        the deadline passes (504) or the client leaves."""
        left = deadline_left(request, settings.timeout_s)
        task = asyncio.ensure_future(work())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({task, gone}, timeout=max(left, 0), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if task in done:
            return task.result()
        task.cancel()
        if gone in done:
            raise ApiError(499, "the client closed the request")
        raise ApiError(504, f"no answer within {settings.timeout_s:g} s (--timeout-s); the request was dropped")

    async def load(request: Request, task: str, upload: UploadFile, loader, extensions):
        if batcher(task).full:  # refuse before spending time on the upload
            _busy(batcher(task))
        if upload is None or not hasattr(upload, "file"):
            raise ApiError(400, "no file: send the upload as the multipart field 'file'")
        try:
            return await asyncio.get_running_loop().run_in_executor(
                loading, uploads.load, upload.file, upload.filename, extensions, loader)
        except ValueError as error:
            raise file_error(str(error)) from None

    def check_rows(options: Generation) -> Generation:
        """Refused at once: a request needing more decoding rows than --max-batch-size (its beams or samples)."""
        if options.rows > settings.max_batch_size:
            name = "num_beams" if dict(options.kwargs).get("num_beams", 1) == options.rows else "num_return_sequences"
            raise ApiError(422, f"{name}: this request needs {options.rows} decoding rows; this server runs at most "
                           f"{settings.max_batch_size} per request (--max-batch-size)")
        return options

    async def submit(task: str, key, item):
        try:
            return await batcher(task).submit(key, item)
        except QueueFull:
            _busy(batcher(task))
        except ValueError as error:  # the model refused this request's options (max_new_tokens over n_positions)
            raise ApiError(422, str(error).strip().splitlines()[0]) from None

    # ---- captioning ----
    @app.post("/v1/caption", tags=["captioning"], dependencies=bearer, summary="Caption an image")
    @with_generation_fields()
    async def caption(request: Request, file: Annotated[UploadFile, File(description="the image")],
                      attention_map: Annotated[str | None, Form(description="true: also return each word's "
                                               "cross-attention over the image as a base64 PNG")] = None,
                      generation_fields: dict | None = None) -> dict:
        captioner = _model(models.captioner, "caption")
        from ..tasks.captioning import IMAGE_EXTENSIONS
        from ..tasks.vision import load_image

        with_map = flag("attention_map", attention_map)
        options = check_rows(request_options(generation_fields, captioner.engine.generation_config))

        def loader(path: str) -> CaptionItem:
            return CaptionItem(captioner.load(path), load_image(path) if with_map else None)

        async def work():
            item = await load(request, "caption", file, loader, IMAGE_EXTENSIONS)
            alone = object() if options.seed is not None or with_map else None  # unequal to every other key
            record = await submit("caption", (options, with_map, alone), item)
            if with_map:
                attention = record.pop(ATTENTION)
                record["attention_map_png"] = await asyncio.get_running_loop().run_in_executor(
                    loading, attention_map_png, item.image, attention)
            return record

        return await run(request, work)

    # ---- transcription (OpenAI's /v1/audio/transcriptions) ----
    @app.post("/v1/audio/transcriptions", tags=["audio"], dependencies=bearer, summary="Transcribe audio",
              response_model=None)
    @with_generation_fields(exclude=("temperature",))
    async def transcriptions(
            request: Request, file: Annotated[UploadFile, File(description="the audio (wav, flac, ogg, mp3, ...)")],
            model: Annotated[str | None, Form(description="accepted for OpenAI clients; this server runs one "
                                                          "recognizer")] = None,
            language: Annotated[str | None, Form(description="accepted for OpenAI clients; not used")] = None,
            prompt: Annotated[str | None, Form(description="not supported: leave empty")] = None,
            response_format: Annotated[str, Form(description="json, text or verbose_json")] = "json",
            temperature: Annotated[str | None, Form(description="as OpenAI's: 0 (default) decodes greedily, > 0 "
                                                    "samples at this temperature")] = None,
            generation_fields: dict | None = None) -> Any:
        transcriber = _model(models.transcriber, "transcribe")
        from ..tasks.transcription import AUDIO_EXTENSIONS

        if response_format not in ("json", "text", "verbose_json"):
            raise ApiError(422, f"response_format: {shown(response_format)} is not supported; use json, text or "
                           "verbose_json")
        if prompt:
            raise ApiError(422, "prompt: this recognizer takes no prompt; leave it empty")
        fields = dict(generation_fields or {})
        heat = openai_temperature(temperature)
        if heat:
            fields.update(do_sample="true", temperature=str(heat))
        options = check_rows(request_options(fields, transcriber.engine.generation_config))

        async def work():
            waveform = await load(request, "transcribe", file, transcriber.load, AUDIO_EXTENSIONS)
            alone = object() if options.seed is not None else None
            return waveform, await submit("transcribe", (options, alone), waveform)

        waveform, result = await run(request, work)
        if response_format == "text":
            return PlainTextResponse(result["text"] + "\n")
        if response_format == "json":
            return result
        duration = round(len(waveform) / transcriber.sampling_rate, 3)
        segment = {"id": 0, "seek": 0, "start": 0.0, "end": duration, "text": result["text"], "temperature": heat,
                   "avg_logprob": result["avg_logprob"]}
        return {"task": "transcribe", "language": language, "duration": duration, **result, "segments": [segment]}

    # ---- speech (OpenAI's /v1/audio/speech) ----
    @app.post("/v1/audio/speech", tags=["audio"], dependencies=bearer, summary="Speak text (streamed audio)",
              response_class=StreamingResponse,
              responses={200: {"content": {"audio/wav": {}, "audio/pcm": {}}, "description": "the audio, sent "
                               "chunk by chunk as it is generated"}})
    async def speech(request: Request, body: SpeechRequest) -> StreamingResponse:
        speaker = _model(models.speaker, "speech")
        from ..tasks.audio_codes import SAMPLE_RATE
        from ..tasks.speech_synthesis import check_text

        if body.response_format not in ("wav", "pcm"):
            raise ApiError(422, f"response_format: {shown(body.response_format)} is not supported; use wav or pcm "
                           f"(16-bit mono at {SAMPLE_RATE} Hz)")
        if body.speed != 1.0:
            raise ApiError(422, "speed: this speaker speaks at one speed; leave it at 1.0")
        try:
            text = check_text(body.input)
            voice = speaker.check_voice(body.voice)
        except ValueError as error:
            raise ApiError(422, str(error)) from None
        options = check_rows(request_options({n: getattr(body, n) for n in FIELDS}, speaker.engine.generation_config))
        if options.num_return_sequences > 1:
            raise ApiError(422, "num_return_sequences: speech streams one audio; leave it at 1")
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        item = SpeechItem(text, voice, options, lambda piece: loop.call_soon_threadsafe(chunks.put_nowait, piece))
        job = asyncio.ensure_future(submit("speech", None, item))
        job.add_done_callback(lambda j: j.cancelled() or j.exception())  # retrieved: never "never retrieved"

        def stop(*_):
            item.stop.set()  # the speaker stops before its next chunk
            job.cancel()

        async def first_chunk():
            getting = asyncio.ensure_future(chunks.get())
            await asyncio.wait({getting, job}, return_when=asyncio.FIRST_COMPLETED)
            if getting.done():
                return getting.result()
            getting.cancel()
            job.result()  # its error (429, 422, ...)
            return None

        try:
            first = await run(request, first_chunk)
        except BaseException:
            stop()
            raise

        async def audio():
            # the listener leaving ends the speech: watched here, since a streaming response may only notice it
            # at its next write (ASGI 2.4), and closes its generator later still
            gone = asyncio.ensure_future(_disconnected(request))
            gone.add_done_callback(lambda watch: watch.cancelled() or stop())
            try:
                if body.response_format == "wav":
                    yield wav_header(SAMPLE_RATE)
                piece = first
                while piece is not None:
                    yield pcm16(piece, SAMPLE_RATE)
                    left = deadline_left(request, settings.timeout_s)
                    try:
                        piece = await asyncio.wait_for(chunks.get(), timeout=max(left, 0))
                    except asyncio.TimeoutError:
                        break  # the deadline passed mid-stream: the audio so far, then the end
            finally:
                gone.cancel()
                stop()

        media = "audio/wav" if body.response_format == "wav" else "audio/pcm"
        return StreamingResponse(audio(), media_type=media)

    # ---- service ----
    @app.get("/health", tags=["service"], summary="Liveness, the models served and the queues")
    async def health() -> dict:
        served = {"caption": settings.captioner, "transcribe": settings.recognizer, "speech": settings.speaker}
        return {"status": "ok", "version": __version__, "pid": os.getpid(),
                "models": {t: (served[t] or "shipped") for t in batchers},
                "queue": {t: b.pending for t, b in batchers.items()},
                "max_batch_size": batch_size, "max_queue": settings.max_queue,
                "voices": list(getattr(models.speaker, "voices", None) or [])}  # the page's voice menu

    @app.get("/metrics", tags=["service"], summary="Prometheus metrics", response_class=PlainTextResponse)
    async def prometheus() -> Response:
        for task, b in batchers.items():
            metrics.queue_length(task, b.pending)
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    if os.path.isfile(os.path.join(STATIC, "index.html")):
        from fastapi.staticfiles import StaticFiles

        app.mount("/", StaticFiles(directory=STATIC, html=True), name="page")
    else:
        @app.get("/", include_in_schema=False)
        async def index() -> RedirectResponse:
            return RedirectResponse("/docs")

    app.add_middleware(LimitsMiddleware, max_body=int(settings.max_upload_mb * 2**20), api_key=settings.api_key,
                       timeout_s=settings.timeout_s)
    app.add_middleware(MeasuredMiddleware, metrics=metrics)  # the outer one: refusals (401, 413, 408) counted too
    return app


def app_from_env() -> FastAPI:
    """uvicorn's factory for `xattn serve --workers N`: each worker builds its app from the settings the command
    put in the environment."""
    settings = Settings(**json.loads(os.environ[SETTINGS_ENV]))
    return create_app(dataclasses.replace(settings, api_key=os.environ.get(API_KEY_ENV) or settings.api_key))


# ---- request parts ------------------------------------------------------------------------------------------------
_NAMES = {"caption": "captioner", "transcribe": "recognizer", "speech": "speaker"}
_security = HTTPBearer(auto_error=False, description="--api-key / XATTN_API_KEY")


def _model(model, task: str):
    if model is None:
        raise ApiError(404, f"this server runs no {_NAMES[task]} (see xattn serve --help)")
    return model


def _busy(batcher: Batcher):
    error = QueueFull(batcher.pending, batcher.retry_after())
    raise ApiError(429, f"{error} (--max-queue {batcher.max_queue})", {"Retry-After": str(error.retry_after)})


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is read by then: the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return

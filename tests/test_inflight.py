"""In-flight batching (xattn/inflight.py): requests join and leave one decode batch, and each gets the tokens generate
gives it alone, in every weight format; with packed and int8 (xattn's kernels) each request's search even sees the
logits it sees alone, bit for bit. The decoders get random biases and layer norms: GPT-2's initial zero biases hide
rounding differences (fma(a, b, 0) rounds as a * b), a trained model's do not."""

import asyncio
import threading

import pytest
import torch

import xattn
import xattn.generate as generate_module
import xattn.inflight as inflight
from conftest import frequent_token, tiny_captioner, tiny_gpt2, tiny_recognizer, with_eos

# (arrival step, generate kwargs): greedy, beams, samples (each seeded with its own generator), mixed lengths
REQUESTS = [
    (0, dict(max_new_tokens=14, repetition_penalty=1.2)),
    (0, dict(max_new_tokens=9, num_beams=3, num_return_sequences=2)),
    (2, dict(max_new_tokens=12, do_sample=True, top_k=20, num_return_sequences=2)),
    (2, dict(max_new_tokens=5)),
    (3, dict(max_new_tokens=14, num_beams=4, length_penalty=2.0, early_stopping="never")),
    (5, dict(max_new_tokens=14, min_new_tokens=6, repetition_penalty=1.5)),
    (5, dict(max_new_tokens=11, num_beams=2, early_stopping=True)),
    (5, dict(max_new_tokens=13, do_sample=True, temperature=1.3, top_p=0.9)),
    (9, dict(max_new_tokens=8, num_beams=5, num_return_sequences=3)),
    (9, dict(max_new_tokens=10, do_sample=True, num_return_sequences=4, top_k=0)),
]


def _trained_like(model, seed: int = 0):
    """Random biases and layer norms in the decoder, as a trained model has."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.decoder.named_parameters() if hasattr(model, "decoder") else \
                model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    return model


@pytest.fixture(scope="module")
def captioner():
    model = _trained_like(tiny_captioner(seed=3))
    pixels = torch.randn(len(REQUESTS), 3, 32, 32, generator=torch.Generator().manual_seed(5))
    return with_eos(model, frequent_token(model, {"pixel_values": pixels})), pixels


def _kwargs(spec: dict, seed: int) -> dict:
    """The request's options; sampling with a generator of its own, fresh for each run."""
    return dict(spec, generator=torch.Generator().manual_seed(seed)) if spec.get("do_sample") else dict(spec)


def _serve(engine, scheduler, pixels, requests, watch=None) -> list:
    """Submit each request at its arrival step and step until all are done; watch(scheduler) after every step."""
    handles = [None] * len(requests)
    step = 0
    while any(h is None or not h.done for h in handles):
        for i, (arrival, spec) in enumerate(requests):
            if arrival == step:
                handles[i] = scheduler.submit(engine.request(pixel_values=pixels[i:i + 1], **_kwargs(spec, i)))
        scheduler.step()
        if watch is not None:
            watch(scheduler)
        step += 1
        assert step < 200, "the scheduler never finished"
    return handles


class FedLogits:
    """Every logits tensor each search (GreedyDecoder, SamplingDecoder, BeamSearchDecoder) is fed: a request's in the
    scheduler (of_request), and those of the generate() call that ran last (last_alone)."""

    def __init__(self, monkeypatch):
        self.fed, self.search_of = {}, {}
        for cls, position in ((generate_module.GreedyDecoder, 1), (generate_module.BeamSearchDecoder, 0)):
            def update(search, *args, _real=cls.update, _at=position, **kwargs):
                if args[_at] is not None:
                    self.fed.setdefault(search, []).append(args[_at].clone())
                return _real(search, *args, **kwargs)
            monkeypatch.setattr(cls, "update", update)
        real_init = inflight._Search.__init__

        def remember(search, opts, prompt, *rest):
            real_init(search, opts, prompt, *rest)
            self.search_of[id(opts)] = search.beams if search.beams is not None else search.decoder
        monkeypatch.setattr(inflight._Search, "__init__", remember)

    def of_request(self, handle) -> list:
        return self.fed[self.search_of[id(handle.request.options)]]

    def alone(self, generate, **kwargs) -> tuple:
        """generate(**kwargs) and the logits fed to the one search it ran (a greedy step's fused argmax feeds none)."""
        before = set(self.fed)
        out = generate(**kwargs)
        (search,) = set(self.fed) - before
        return out, self.fed[search]


@pytest.fixture()
def fed_logits(monkeypatch):
    return FedLogits(monkeypatch)


@pytest.mark.parametrize("weights", ["exact", "packed", "int8"])
def test_staggered_requests_get_the_tokens_they_get_alone(captioner, weights, fed_logits):
    model, pixels = captioner
    engine = xattn.from_hf(model, weights=weights)
    seen = {"most": 0, "mixed": False}

    def watch(s):
        seen["most"] = max(seen["most"], len(s.running))
        seen["mixed"] |= len({run.position for run in s.running}) > 1  # rows at different positions in one step

    handles = _serve(engine, engine.inflight(max_rows=24), pixels, REQUESTS, watch)
    assert seen["most"] >= 4 and seen["mixed"], "the requests never shared the decode batch"
    for i, (handle, (_, spec)) in enumerate(zip(handles, REQUESTS)):
        assert handle.error is None
        alone, theirs = fed_logits.alone(engine.generate, pixel_values=pixels[i:i + 1], return_dict_in_generate=True,
                                         **_kwargs(spec, i))
        got = handle.result
        assert torch.equal(got.sequences, alone.sequences), f"request {i}: {spec}"
        assert (got.scores is None) == (alone.sequences_scores is None)
        if got.scores is not None:
            torch.testing.assert_close(got.scores, alone.sequences_scores, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.avg_logprob, alone.avg_logprob, rtol=0, atol=1e-5)
        mine = fed_logits.of_request(handle)
        assert len(theirs) >= 1  # the same logits to rounding at every step (exact's batched products sum otherwise)
        for a, b in zip(mine, theirs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.kernels
@pytest.mark.parametrize("weights", ["packed", "int8"])
def test_each_search_sees_its_lone_logits_bit_for_bit(captioner, weights, fed_logits):
    """With xattn's kernels every row is computed as alone: rows of int8 requests through xattn's own products (not
    fbgemm's, which quantize all rows with one scale), a 4- and a 5-beam int8 request apart. Each newcomer is encoded
    alone here: torch's encoder on several threads sums in an order that depends on the batch."""
    model, pixels = captioner
    engine = xattn.from_hf(model, weights=weights)
    handles = _serve(engine, engine.inflight(max_rows=24, encode_together=False), pixels, REQUESTS)
    for i, (handle, (_, spec)) in enumerate(zip(handles, REQUESTS)):
        alone, theirs = fed_logits.alone(engine.generate, pixel_values=pixels[i:i + 1], **_kwargs(spec, i))
        assert torch.equal(handle.result.sequences, alone)
        mine = fed_logits.of_request(handle)
        assert len(theirs) >= 1 and all(torch.equal(a, b) for a, b in zip(mine, theirs)), f"request {i}: {spec}"


@pytest.mark.kernels
def test_newcomers_are_encoded_together_where_the_encoder_computes_rows_alone():
    """The bf16 ViT kernel on AMX tiles computes each image as alone: newcomers that arrive together share one
    encoder call, and each request still gets generate's tokens alone."""
    from xattn.fast import kernels

    if not kernels.amx_bf16():
        pytest.skip("needs AMX-BF16: elsewhere the bf16 kernel runs oneDNN's products and encodes each newcomer alone")
    model = _trained_like(tiny_captioner(seed=8, encoder_hidden=64, encoder_inner=64))
    pixels = torch.randn(len(REQUESTS), 3, 32, 32, generator=torch.Generator().manual_seed(9))
    engine = xattn.from_hf(model).with_weights("int8", encoder_weights="bf16")
    assert engine.encoder.rows_independent
    batches = []
    engine.encoder.register_forward_pre_hook(lambda module, args: batches.append(args[0].shape[0]))
    handles = _serve(engine, engine.inflight(max_rows=24), pixels, REQUESTS)
    assert max(batches) > 1 and sum(batches) == len(REQUESTS)  # arrivals at one step were encoded in one call
    for i, (handle, (_, spec)) in enumerate(zip(handles, REQUESTS)):
        alone = engine.generate(pixel_values=pixels[i:i + 1], **_kwargs(spec, i))
        assert torch.equal(handle.result.sequences, alone), f"request {i}: {spec}"


def test_rows_are_reused_and_a_request_that_does_not_fit_waits(captioner):
    model, pixels = captioner
    engine = xattn.from_hf(model)
    scheduler = engine.inflight(max_rows=5)
    requests = [(0, dict(max_new_tokens=12)), (0, dict(max_new_tokens=6, num_beams=3)),
                (0, dict(max_new_tokens=10, num_beams=4)), (1, dict(max_new_tokens=4)), (1, dict(max_new_tokens=14)),
                (2, dict(max_new_tokens=9, do_sample=True, num_return_sequences=2))]
    seen = {"waited": False, "owners": [set() for _ in range(5)]}

    def watch(s):
        assert s.rows_in_use <= 5 and s.cache.batch_size == 5  # allocated once
        seen["waited"] |= bool(s.waiting) and bool(s.running)
        for run in s.running:
            for row in range(run.start, run.stop):
                seen["owners"][row].add(id(run.handle))

    handles = _serve(engine, scheduler, pixels, requests, watch)
    assert seen["waited"] and max(len(owners) for owners in seen["owners"]) >= 3  # a row served three requests
    for i, (handle, (_, spec)) in enumerate(zip(handles, requests)):
        alone = engine.generate(pixel_values=pixels[i:i + 1], **_kwargs(spec, i))
        assert torch.equal(handle.result.sequences, alone)


def test_a_seeded_request_draws_the_same_beside_any_neighbours(captioner):
    model, pixels = captioner
    engine = xattn.from_hf(model)
    spec = dict(max_new_tokens=14, do_sample=True, temperature=1.5, top_k=0, num_return_sequences=2)
    results = []
    for neighbours in ([], [(0, dict(max_new_tokens=14, do_sample=True))],
                       [(0, dict(max_new_tokens=3, do_sample=True)), (1, dict(max_new_tokens=9, num_beams=2))]):
        scheduler = engine.inflight(max_rows=8)
        handles = _serve(engine, scheduler, pixels, [(1 if neighbours else 0, spec)] + neighbours)
        results.append(handles[0].result.sequences)
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.equal(results[0], engine.generate(pixel_values=pixels[:1], **_kwargs(spec, 0)))
    other_seed = engine.generate(pixel_values=pixels[:1], **_kwargs(spec, 1))
    assert not torch.equal(results[0], other_seed)  # the draws are the generator's: another seed, other tokens


def test_cancelling_frees_the_rows_and_a_waiting_request_never_runs(captioner, monkeypatch):
    model, pixels = captioner
    engine = xattn.from_hf(model)
    scheduler = engine.inflight(max_rows=4)
    encoded = []
    real_encode = scheduler.encode
    monkeypatch.setattr(scheduler, "encode", lambda inputs: encoded.append(len(inputs)) or real_encode(inputs))
    long = scheduler.submit(engine.request(pixel_values=pixels[:1], max_new_tokens=30, min_new_tokens=30,
                                           num_beams=3))
    short = scheduler.submit(engine.request(pixel_values=pixels[1:2], max_new_tokens=12, min_new_tokens=12))
    big = scheduler.submit(engine.request(pixel_values=pixels[2:3], max_new_tokens=8, num_beams=2))
    dropped = scheduler.submit(engine.request(pixel_values=pixels[3:4], max_new_tokens=8))
    scheduler.step()
    scheduler.step()
    assert scheduler.rows_in_use == 4 and list(scheduler.waiting) == [big, dropped]
    scheduler.cancel(dropped)
    scheduler.cancel(long)
    assert long.done and long.result is None and scheduler.rows_in_use == 1
    scheduler.run()
    assert dropped.result is None and encoded == [2, 1]  # long + short, then big; the dropped one was never encoded
    for handle, i, kwargs in ((short, 1, dict(max_new_tokens=12, min_new_tokens=12)),
                              (big, 2, dict(max_new_tokens=8, num_beams=2))):
        assert torch.equal(handle.result.sequences, engine.generate(pixel_values=pixels[i:i + 1], **kwargs))


def test_a_failing_input_fails_only_its_request(captioner):
    model, pixels = captioner
    engine = xattn.from_hf(model)
    scheduler = engine.inflight(max_rows=8)
    real_encode = scheduler.encode

    def encode(inputs):
        if any(bool(torch.isnan(values).any()) for _, values, _ in inputs):
            raise RuntimeError("poisoned input")
        return real_encode(inputs)
    scheduler.encode = encode
    poisoned = pixels[1:2].clone()
    poisoned[0, 0, 0, 0] = float("nan")
    inputs = [pixels[:1], poisoned, pixels[2:3]]
    handles = [scheduler.submit(engine.request(pixel_values=p, max_new_tokens=9)) for p in inputs]
    scheduler.run()
    assert isinstance(handles[1].error, RuntimeError) and handles[1].result is None
    for handle, p in ((handles[0], inputs[0]), (handles[2], inputs[2])):
        assert handle.error is None and torch.equal(handle.result.sequences, engine.generate(pixel_values=p,
                                                                                              max_new_tokens=9))
    assert scheduler.rows_in_use == 0


def test_given_encoder_states_of_different_lengths_and_longer_prompts():
    """A GPT-2 decoder given encoder_hidden_states (masked, of different lengths: the shared cross K/V grow and get a
    mask) and prompts of different lengths (prefilled in their own cache, as alone)."""
    model = _trained_like(tiny_gpt2(seed=5))
    engine = xattn.from_hf(model)
    scheduler = engine.inflight(max_rows=10)
    g = torch.Generator().manual_seed(2)
    cases = []
    for positions, real, prompt, spec in [
            (7, 7, [1, 5, 9], dict(max_new_tokens=10)),
            (4, 3, [1, 7], dict(max_new_tokens=12, num_beams=3)),
            (9, 6, [1, 5, 9], dict(max_new_tokens=6, do_sample=True)),
            (7, 7, [1], dict(max_new_tokens=11, num_beams=2, num_return_sequences=2)),
            (11, 11, [1, 4, 4, 2], dict(max_new_tokens=9))]:
        mask = torch.zeros(1, positions, dtype=torch.long)
        mask[:, :real] = 1
        kwargs = dict(input_ids=torch.tensor([prompt]), encoder_hidden_states=torch.randn(1, positions, 32,
                      generator=g), encoder_attention_mask=mask, **spec)
        cases.append(kwargs)
    handles = []
    for i, kwargs in enumerate(cases):
        handles.append(scheduler.submit(engine.request(**_kwargs(kwargs, i))))
        scheduler.step()
    scheduler.run()
    assert scheduler.cache.cross_keys.shape[3] == 11 and scheduler.cache.cross_mask is not None
    for i, (handle, kwargs) in enumerate(zip(handles, cases)):
        assert torch.equal(handle.result.sequences, engine.generate(**_kwargs(kwargs, i))), f"request {i}"


def test_a_request_whose_cross_kv_do_not_fit_float16_widens_the_shared_ones():
    """int8 keeps cross K/V in float16; a request whose values might not fit gets float32 ones, the shared tensors
    become float32 and the requests already running keep their tokens (float16 values read exactly either way)."""
    model = _trained_like(tiny_gpt2(seed=6))
    engine = xattn.from_hf(model, weights="int8")
    scheduler = engine.inflight(max_rows=6)
    g = torch.Generator().manual_seed(3)
    states = [torch.randn(1, 7, 32, generator=g), 1e6 * torch.randn(1, 7, 32, generator=g)]
    cases = [dict(input_ids=torch.tensor([[1, 5]]), encoder_hidden_states=s, max_new_tokens=10) for s in states]
    first = scheduler.submit(engine.request(**cases[0]))
    scheduler.step()
    assert scheduler.cache.cross_keys.dtype == torch.float16
    second = scheduler.submit(engine.request(**cases[1]))
    scheduler.run()
    assert scheduler.cache.cross_keys.dtype == torch.float32
    for handle, kwargs in zip((first, second), cases):
        assert torch.equal(handle.result.sequences, engine.generate(**kwargs))


def test_speech_inputs_of_different_lengths():
    model = _trained_like(tiny_recognizer())
    waves = [torch.randn(1, n, generator=torch.Generator().manual_seed(n)) for n in (1600, 1100, 1600, 700)]
    engine = xattn.from_hf(with_eos(model, frequent_token(model, {"input_values": waves[0]})))
    scheduler = engine.inflight(max_rows=8)
    specs = [dict(max_new_tokens=12), dict(max_new_tokens=10, num_beams=3), dict(max_new_tokens=12),
             dict(max_new_tokens=8)]
    handles = [scheduler.submit(engine.request(input_values=w, **s)) for w, s in zip(waves, specs)]
    scheduler.run()
    for handle, wave, spec in zip(handles, waves, specs):
        assert torch.equal(handle.result.sequences, engine.generate(input_values=wave, **spec))


def test_what_a_scheduler_refuses(captioner):
    model, pixels = captioner
    engine = xattn.from_hf(model)
    scheduler = engine.inflight(max_rows=4)
    with pytest.raises(ValueError, match="needs 5 rows .* max_rows=4"):
        scheduler.submit(engine.request(pixel_values=pixels[:1], num_beams=5, max_new_tokens=4))
    with pytest.raises(ValueError, match="a batch of one"):
        engine.request(pixel_values=pixels[:2], max_new_tokens=4)
    with pytest.raises(ValueError, match="exceeds the decoder's n_positions"):
        engine.request(pixel_values=pixels[:1], max_new_tokens=80)
    with pytest.raises(ValueError, match="pass pixel_values"):
        engine.request(max_new_tokens=4)
    with pytest.raises(ValueError, match="max_rows must be a positive int"):
        engine.inflight(max_rows=0)
    assert not scheduler.waiting


def test_decode_step_with_each_row_at_its_own_position():
    """The core change: a cache's row_positions puts each row's step at its own position (K/V written there, keys
    after it masked), as that row's own decode_step at that position gives."""
    model = _trained_like(tiny_gpt2(seed=7))
    decoder = xattn.from_hf(model).decoder
    states = torch.randn(3, 5, 32, generator=torch.Generator().manual_seed(0))
    prompts = [torch.tensor([[1, 4, 6, 8, 3]]), torch.tensor([[1, 9]]), torch.tensor([[1, 2, 3]])]
    alone, caches = [], []
    for i, prompt in enumerate(prompts):
        cache = decoder.new_cache(1, 8, states[i:i + 1])
        decoder.prefill(cache, input_ids=prompt)
        caches.append(cache)
        alone.append(decoder.step_logits(torch.tensor([7]), cache))
    shared = decoder.new_cache(3, 8, states)
    for i, cache in enumerate(caches):
        shared.keys[:, i], shared.values[:, i] = cache.keys[:, 0], cache.values[:, 0]
        shared.keys[:, i, :, cache.length:] = 100.0  # stale K/V past each row's position must not be read
    shared.row_positions = torch.tensor([p.shape[1] for p in prompts])
    logits = decoder.step_logits(torch.tensor([7, 7, 7]), shared)
    for i, cache in enumerate(caches):
        torch.testing.assert_close(logits[i:i + 1], alone[i], rtol=0, atol=1e-5)
        position = cache.length
        torch.testing.assert_close(shared.keys[:, i, :, position], cache.keys[:, 0, :, position], rtol=0, atol=1e-6)


# ---- the server: a caption request joins the running decode batch ---------------------------------------------------
class _GatedRuns:
    """CaptionRequests whose scheduler's steps wait for `gate` and record each step's running positions."""

    def __init__(self, captioner):
        from xattn.serve.runners import CaptionRequests

        self.runs = CaptionRequests(captioner)
        self.captioner, self.request, self.record = captioner, self.runs.request, self.runs.record
        self.gate, self.stepping, self.steps, self.schedulers = threading.Event(), threading.Event(), [], []

    def scheduler(self, max_rows):
        scheduler = self.runs.scheduler(max_rows)
        real_step = scheduler.step

        def step():
            self.stepping.set()
            assert self.gate.wait(60), "the test never opened the gate"
            finished = real_step()
            self.steps.append([run.position for run in scheduler.running])
            return finished
        scheduler.step = step
        self.schedulers.append(scheduler)
        return scheduler


@pytest.fixture(scope="module")
def shipped():
    pytest.importorskip("fastapi")
    from xattn.tasks.captioning import Captioner

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as tests/test_serve*.py: on one thread torch's encoder is row-independent too
    yield Captioner()
    torch.set_num_threads(threads)


def _inflight_app(monkeypatch, runs, **settings):
    """The app with its caption batcher an InflightBatcher over `runs`."""
    import xattn.serve.app as app_module
    from xattn.serve import Settings, create_app
    from xattn.serve.inflight import InflightBatcher

    real = app_module.Batcher

    def batcher(task, run, max_batch_size, max_queue, metrics):
        if task == "caption":
            return InflightBatcher(task, runs, max_batch_size, max_queue, metrics)
        return real(task, run, max_batch_size, max_queue, metrics)
    monkeypatch.setattr(app_module, "Batcher", batcher)  # an app that builds every batcher as a Batcher
    # an app that builds the caption batcher as an InflightBatcher over CaptionRequests (Settings.inflight)
    monkeypatch.setattr(app_module, "CaptionRequests", lambda captioner, metrics=None: runs, raising=False)
    off = type("Off", (), {})()
    return create_app(Settings(**settings), captioner=runs.captioner, transcriber=off, speaker=off)


def _alone(captioner, path, fields: dict) -> dict:
    """The answer for this image and these form fields alone: the CLI's path (caption_results on one image)."""
    from xattn.serve.options import generation

    options = generation(fields, captioner.engine.generation_config)
    record = captioner.caption_results([captioner.load(path)], **options.generate_kwargs())[0]
    return {"text": record.pop("caption"), **record}


def test_server_requests_join_the_running_batch_and_get_their_own_answers(shipped, monkeypatch):
    from test_serve_faults import IMAGES, _caption, _scenario, _until

    runs = _GatedRuns(shipped)
    app = _inflight_app(monkeypatch, runs, max_batch_size=8)
    later = [(IMAGES[1], {"num_beams": "2"}), (IMAGES[2], {"do_sample": "true", "seed": "5", "top_k": "4"}),
             (IMAGES[3], {}), (IMAGES[4], {"max_new_tokens": "3"}), (IMAGES[5], {"num_beams": "3"})]

    async def body(client):
        first = asyncio.ensure_future(_caption(client, IMAGES[0]))
        await asyncio.get_running_loop().run_in_executor(None, runs.stepping.wait, 30)
        rest = [asyncio.ensure_future(_caption(client, path, **fields)) for path, fields in later]
        # the first request counts as waiting until its first step (held at the gate) is done
        await _until(lambda: app.state.batchers["caption"].pending == len(later) + 1, "the rest waiting")
        runs.gate.set()
        return [await r for r in [first, *rest]]

    answers = _scenario(app, body)
    assert [a.status_code for a in answers] == [200] * 6
    for answer, (path, fields) in zip(answers, [(IMAGES[0], {}), *later]):
        assert answer.json() == _alone(shipped, path, fields)
    assert runs.steps[0] == [1]  # the first request alone: its one-token prompt was its first step's input
    assert any(len(set(positions)) > 1 for positions in runs.steps), "nobody joined the running batch"


def test_server_deadline_frees_the_rows_of_a_running_request(shipped, monkeypatch):
    from test_serve_faults import IMAGES, _caption, _scenario, _until

    runs = _GatedRuns(shipped)
    app = _inflight_app(monkeypatch, runs, timeout_s=1.0)

    async def body(client):
        late = asyncio.ensure_future(_caption(client, IMAGES[0], max_new_tokens="30"))
        await asyncio.get_running_loop().run_in_executor(None, runs.stepping.wait, 30)
        late = await late  # its step waits on the gate past the deadline
        runs.gate.set()
        scheduler = runs.schedulers[0]
        await _until(lambda: not scheduler.running and not scheduler.waiting, "its rows freed")
        return late, await _caption(client, IMAGES[1])

    late, after = _scenario(app, body)
    assert late.status_code == 504 and after.status_code == 200
    assert after.json() == _alone(shipped, IMAGES[1], {})
    # it joined and ran one step (its start token's); the next step is the later request's first: the rest of its
    # tokens never ran
    assert runs.steps[:2] == [[1], [1]]

"""In-flight batching: one decode batch that requests join and leave while it runs.

A Scheduler owns one static cache of max_rows rows. submit() queues a request; each step() first admits the waiting
requests that fit (in arrival order: encoded together, their prompts prefilled together), then advances every running
row by one token in one decode step, each row at its own position, and returns the requests that finished: their
rows are free for the next ones. A request of k rows (beams, or samples) takes k adjacent rows; its cross K/V are
stored once (in its first row, read by all k) for xattn's fused step, and in each of its rows for torch's attention,
which would otherwise gather them at every step.

The specification: every request gets the tokens `generate` gives it alone, with the same options. Its search is the
object generate runs (GreedyDecoder, SamplingDecoder with the request's own generator, BeamSearchDecoder), fed its own
rows' logits; its cross K/V and its prefill are computed as alone (one encoder row, its own prompt); and the decode
step computes each row independently of the rows beside it (DecoderSteps.rowwise where a format's products would
quantize rows together). A request whose own run already couples its rows (int8 with more rows than its kernels take)
runs its step apart, as alone. With xattn's kernels (packed, int8) a request's search then sees its lone run's logits
bit for bit; torch's products ("exact", and a batched encoder on several threads) sum in an order that depends on the
batch, so there they agree to rounding (~1e-7), and the tokens agreed in every test.

The core of it is synchronous (submit, step, cancel; not thread-safe): xattn/serve/inflight.py runs it in a thread
for the server.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from .cache import CrossAttentionCache
from .decoder import GPT2CrossAttentionDecoder
from .generate import Argmax, BeamCandidates, BeamSearchDecoder, GenerationOptions, GreedyDecoder, SamplingDecoder
from .logprobs import ChosenLogprobs

# inputs of one encoder call (Request.encoder_input of requests with equal encoder_key) ->
# (encoder_hidden_states [n, S, D], encoder_attention_mask [n, S] or None)
Encode = Callable[[list], tuple[torch.Tensor, torch.Tensor | None]]
# (a cache holding the request's cross K/V, sequences [n, P + L], P, eos ids) -> avg_logprob [n] (xattn.hf.scores)
Score = Callable[[CrossAttentionCache, torch.Tensor, int, list[int]], torch.Tensor]


@dataclass(eq=False)
class Request:
    options: GenerationOptions  # checked; options.generator: this request's own RNG, so its draws depend on no other
    prompt: torch.Tensor  # [P] long: the decoder prompt (an encoder-decoder's starts with decoder_start_token_id)
    encoder_input: Any = None  # one input, as the scheduler's `encode` takes it in a list (xattn.hf: pixel values...)
    encoder_key: Hashable | None = None  # newcomers with equal keys are encoded in one call (None: alone)
    encoder_hidden_states: torch.Tensor | None = None  # [S, D], given instead of an encoder_input
    encoder_attention_mask: torch.Tensor | None = None  # [S], 1 where a position is real


@dataclass
class Result:
    sequences: torch.Tensor  # [num_return_sequences, P + L]: what generate returns for this input alone
    scores: torch.Tensor | None  # beam search: each sequence's score (generate's sequences_scores)
    avg_logprob: torch.Tensor | None  # [num_return_sequences], where the scheduler was given `score`


class Handle:
    """A submitted request: done once it finished (result), failed (error) or was cancelled."""

    def __init__(self, request: Request):
        self.request = request
        self.result: Result | None = None
        self.error: BaseException | None = None
        self.cancelled = False

    @property
    def done(self) -> bool:
        return self.result is not None or self.error is not None or self.cancelled


class _Search:
    """generate's search for one request (its k rows): update(logits [k, V]) -> (source rows [k] or None, next
    tokens [k]), or None when it is over; result() -> (sequences, scores)."""

    def __init__(self, opts: GenerationOptions, prompt: torch.Tensor,  # prompt [k, P]
                 candidates: BeamCandidates | None = None, argmax: Argmax | None = None):
        self.prompt_length, self.max_new = prompt.shape[1], opts.max_new_tokens
        if opts.num_beams > 1:
            self.beams = BeamSearchDecoder(opts, prompt, candidates)
            return
        self.beams, self.steps = None, 0
        self.decoder = (SamplingDecoder if opts.do_sample else GreedyDecoder)(
            opts, self.prompt_length, prompt.shape[0], prompt.device, argmax)
        self.sequences = prompt.new_full((prompt.shape[0], self.prompt_length + self.max_new), opts.pad_token_id or 0)
        self.sequences[:, :self.prompt_length] = prompt
        self.logprobs = ChosenLogprobs(prompt.shape[0], self.max_new, prompt.device)  # beams: hf/scores.py replays

    def update(self, logits: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor] | None:
        if self.beams is not None:
            return self.beams.update(logits)
        cur = self.prompt_length + self.steps  # as generate's sample_stream
        own = logits.float().log_softmax(-1)  # before the search's processors, which may change logits in place
        tokens, done = self.decoder.update(self.sequences[:, :cur], logits)
        self.sequences[:, cur] = tokens
        self.logprobs.add(own, tokens)
        self.steps += 1
        return None if done or self.steps == self.max_new else (None, tokens)

    def result(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.beams is not None:
            return self.beams.finalize()
        return self.sequences[:, :self.prompt_length + self.steps], None

    def avg_logprob(self, eos_token_ids: list[int]) -> torch.Tensor | None:
        """[k] the mean log-probability of each row's tokens up to and including its first EOS (None for beams)."""
        if self.beams is not None:
            return None
        return self.logprobs.average(self.sequences[:, self.prompt_length:], eos_token_ids)


@dataclass(eq=False)
class _Running:
    handle: Handle
    start: int  # its rows are start .. stop - 1 (row `start` holds its cross K/V)
    stop: int
    position: int  # where its next token goes (= positions written)
    search: _Search
    tokens: torch.Tensor | None = None  # [k]: what its next step feeds
    encoder_positions: int = 0  # S of its own cross K/V (the shared ones may be longer, masked)
    encoder_mask: torch.Tensor | None = None  # [1, S] its own mask, or None
    apart: bool = False  # steps on its own (its rows are coupled alone too)


class Scheduler:
    """One decode batch of up to max_rows rows over `decoder`; see the module's docstring."""

    def __init__(self, decoder: GPT2CrossAttentionDecoder, max_rows: int = 16, *, encode: Encode | None = None,
                 score: Score | None = None, encode_together: bool = True):
        if decoder.embed_fn is not None:
            raise ValueError("in-flight batching needs a decoder with GPT-2's own embeddings (embed=None): an embed "
                             "function takes one position for every row")
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
        self.decoder, self.max_rows, self.encode, self.score = decoder, max_rows, encode, score
        # newcomers with equal encoder_key in one encoder call (faster; False: each alone, bit for bit its lone run's
        # encoder output, where the encoder's products are not row-independent: torch's on several threads)
        self.encode_together = encode_together
        steps = decoder.steps
        # rows of different requests go through steps that keep each row independent of the others
        self.shared = decoder if steps.rowwise is None else GPT2CrossAttentionDecoder(
            decoder.transformer, decoder.lm_head, head=decoder.output_fn, steps=steps.rowwise)
        self.chunk = self.shared.steps.independent_rows  # rows per call of the shared step (None: all at once)
        self.coupled_above = steps.independent_rows  # a request with more rows than this steps apart
        self.cache = CrossAttentionCache.allocate(
            decoder.num_layers, max_rows, decoder.num_heads, 16, decoder.head_dim, dtype=decoder.dtype,
            device=decoder.device)
        # Cross K/V: xattn's fused step reads each row's encoder row through enc_index (a request's first row holds
        # them, read by all its rows); torch's attention would gather them every step, so there each row holds a copy
        self.cross_per_row = decoder.fused is None
        if decoder.has_cross_attention and not self.cross_per_row:  # row -> the row holding its cross K/V
            self.cache.enc_index = torch.zeros(max_rows, dtype=torch.long, device=decoder.device)
        self.cache.row_positions = torch.zeros(max_rows, dtype=torch.long, device=decoder.device)
        self.waiting: deque[Handle] = deque()
        self.running: list[_Running] = []
        self._owner: list[_Running | None] = [None] * max_rows

    # ---- the interface ------------------------------------------------------------------------------------------
    def submit(self, request: Request) -> Handle:
        """Queue a request; it joins the decode batch at a coming step()."""
        opts, rows = request.options, request.options.group_size
        if rows > self.max_rows:
            raise ValueError(f"this request needs {rows} rows (num_beams / num_return_sequences) but the scheduler has "
                             f"max_rows={self.max_rows}; lower them or build the scheduler with more rows")
        if request.prompt.dim() != 1 or not request.prompt.numel():
            raise ValueError(f"prompt must be one non-empty row of token ids [P], got {tuple(request.prompt.shape)}")
        positions = request.prompt.numel() + opts.max_new_tokens - 1
        if positions > self.decoder.max_positions:
            raise ValueError(f"prompt ({request.prompt.numel()}) + max_new_tokens ({opts.max_new_tokens}) needs "
                             f"{positions} positions, more than the decoder's n_positions "
                             f"({self.decoder.max_positions}); lower max_new_tokens")
        given = request.encoder_input is not None or request.encoder_hidden_states is not None
        if self.decoder.has_cross_attention and not given:
            raise ValueError("this decoder has cross-attention: pass an encoder input (or encoder_hidden_states) with "
                             "every request")
        if given and not self.decoder.has_cross_attention:
            raise ValueError("this decoder has no cross-attention layers: pass no encoder input")
        if request.encoder_input is not None and self.encode is None:
            raise ValueError("this scheduler has no encoder (encode=None): pass encoder_hidden_states")
        handle = Handle(request)
        self.waiting.append(handle)
        return handle

    def step(self) -> list[Handle]:
        """Admit what fits, then one token for every running row; returns the requests finished in this step."""
        finished = self._admit()
        if self.running:
            finished += self._decode()
        return finished

    def cancel(self, handle: Handle) -> None:
        """Drop a request: waiting, it never runs; running, its rows are freed at once."""
        if handle.done:
            return
        handle.cancelled = True
        if handle in self.waiting:
            self.waiting.remove(handle)
        for run in [run for run in self.running if run.handle is handle]:
            self._release(run)

    def run(self) -> None:
        """step() until nothing waits or runs."""
        while self.waiting or self.running:
            self.step()

    @property
    def rows_in_use(self) -> int:
        return sum(run.stop - run.start for run in self.running)

    # ---- admission ------------------------------------------------------------------------------------------------
    def _admit(self) -> list[Handle]:
        """Newcomers in arrival order while their rows fit (the first that does not fit waits, and all behind it)."""
        newcomers: list[_Running] = []
        while self.waiting:
            handle = self.waiting[0]
            rows = handle.request.options.group_size
            apart = self.coupled_above is not None and rows > self.coupled_above
            start = self._free_rows(rows, from_top=apart)
            if start is None:
                break
            self.waiting.popleft()
            run = _Running(handle, start, start + rows, 0, None, apart=apart)
            self._owner[start:start + rows] = [run] * rows
            newcomers.append(run)
        groups: dict[Hashable, list[_Running]] = {}
        for run in newcomers:
            key = run.handle.request.encoder_key if self.encode_together else None
            groups.setdefault(object() if key is None else key, []).append(run)
        finished = []
        for group in groups.values():
            finished += self._start_isolated(group)
        return finished

    def _start_isolated(self, group: list[_Running]) -> list[Handle]:
        """_start, retried request by request where a group fails, so that only a request that breaks it fails.
        Nothing is drawn or decided before the whole group's prefill succeeded."""
        try:
            first_logits = self._start(group)
        except Exception as error:
            if len(group) == 1:
                group[0].handle.error = error
                self._release(group[0])
                return [group[0].handle]
            return [handle for run in group for handle in self._start_isolated([run])]
        finished = []
        for run, logits in zip(group, first_logits):
            rows = run.stop - run.start
            prompt = run.handle.request.prompt[None].repeat_interleave(rows, dim=0)
            # prompt [rows, P], as generate expands it
            run.search = _Search(run.handle.request.options, prompt, self.decoder.steps.beam_candidates,
                                 self.decoder.steps.argmax_rows)
            self.running.append(run)
            if logits is not None and self._update(run, logits.repeat_interleave(rows, dim=0)):
                finished.append(run.handle)
        return finished

    def _start(self, group: list[_Running]) -> list[torch.Tensor]:
        """Encode the group's inputs in one call, then each request's cross K/V (one input, as alone) and its prompt's
        K/V into its rows; returns each request's prefill logits [1, V], or None for a one-token prompt that the shared
        steps take as a step's input (a one-token prefill is that step: GPT2CrossAttentionDecoder.prefill)."""
        requests = [run.handle.request for run in group]
        states = masks = None
        if self.decoder.has_cross_attention:
            if requests[0].encoder_input is not None:
                states, masks = self.encode([r.encoder_input for r in requests])
            else:
                states = torch.stack([r.encoder_hidden_states for r in requests])
                given = [r.encoder_attention_mask for r in requests]
                masks = None if given[0] is None else torch.stack(given)
        prefills: dict[tuple, list[int]] = {}
        for i, (run, request) in enumerate(zip(group, requests)):
            positions = request.prompt.numel() + request.options.max_new_tokens - 1
            self._fit_length(positions)
            if states is not None:
                self._place_cross(run, *self.decoder.cross_key_values(states[i:i + 1]),
                                  None if masks is None else masks[i:i + 1])
            length = request.prompt.numel()
            # prompts that are computed row-independently alone are prefilled together through the shared steps;
            # a one-token prompt attends to itself only, whatever the cache's length, a longer one in alone's length
            coupled = run.apart or (self.coupled_above is not None and length > self.coupled_above)
            if length == 1 and not coupled:  # its token is the next shared step's input at position 0: no prefill
                run.tokens = request.prompt.repeat(run.stop - run.start)
                continue
            key = (length, 1 if length == 1 else positions, coupled)
            prefills.setdefault(key, []).append(i)
        logits: dict[int, torch.Tensor | None] = dict.fromkeys(range(len(group)))
        for (length, cache_length, coupled), members in prefills.items():
            # coupled: through the decoder's own steps, one at a time, as alone
            together = not coupled and self.chunk is None
            for chunk in [members] if together else [[i] for i in members]:
                out = self._prefill(self.decoder if coupled else self.shared, [group[i] for i in chunk], length,
                                    cache_length)
                logits.update({i: out[j:j + 1] for j, i in enumerate(chunk)})
        return [logits[i] for i in range(len(group))]

    def _prefill(self, decoder: GPT2CrossAttentionDecoder, runs: list[_Running], length: int, cache_length: int
                 ) -> torch.Tensor:
        """Prefill the runs' prompts (one row each) in a cache of their own and copy the K/V to each run's rows;
        returns the logits [n, V]."""
        prefill = decoder.new_cache(len(runs), cache_length)
        if self.decoder.has_cross_attention:  # each run's own cross K/V, as placed in its rows
            own = [self._own_cross(run) for run in runs]
            prefill.set_cross(torch.cat([k for k, _ in own], dim=1), torch.cat([v for _, v in own], dim=1),
                              None if runs[0].encoder_mask is None else torch.cat([r.encoder_mask for r in runs]))
        logits = decoder.prefill(prefill, input_ids=torch.stack([run.handle.request.prompt for run in runs]))
        for i, run in enumerate(runs):
            for store, source in ((self.cache.keys, prefill.keys), (self.cache.values, prefill.values)):
                store[:, run.start:run.stop, :, :length] = source[:, i:i + 1, :, :length]
            run.position = length
        return logits

    # ---- the decode step ------------------------------------------------------------------------------------------
    def _decode(self) -> list[Handle]:
        """One token for every running row: the rows of requests that share the step in one call of the shared
        steps (free rows among them compute nothing anyone reads), then each apart request in a call of its own."""
        logits: dict[int, torch.Tensor] = {}
        shared = [run for run in self.running if not run.apart]
        if shared:
            top = max(run.stop for run in shared)
            tokens = torch.zeros(top, dtype=torch.long, device=self.decoder.device)
            positions = torch.zeros(top, dtype=torch.long)
            for run in self.running:  # an apart run's rows below `top` too: the junk lands where its own step writes
                stop = min(run.stop, top)
                if run.start < stop:
                    tokens[run.start:stop] = run.tokens[:stop - run.start]
                    positions[run.start:stop] = run.position
            self.cache.row_positions[:top] = positions
            chunk = self.chunk or top
            out = torch.cat([self.shared.step_logits(tokens[a:a + chunk], self.cache.rows(a, min(a + chunk, top)))
                             for a in range(0, top, chunk)])
            logits.update({id(run): out[run.start:run.stop] for run in shared})
        for run in self.running:
            if run.apart:  # every row at one position, through the decoder's own steps, as alone
                rows = self.cache.rows(run.start, run.stop, run.position)
                rows.row_positions = None
                logits[id(run)] = self.decoder.step_logits(run.tokens, rows)
        finished = []
        for run in list(self.running):
            run.position += 1
            if self._update(run, logits[id(run)]):
                finished.append(run.handle)
        return finished

    def _update(self, run: _Running, logits: torch.Tensor) -> bool:
        """Feed a run's logits to its search: its next tokens (its rows reordered for beams), or its result. True
        when it finished."""
        chosen = run.search.update(logits)
        if chosen is not None:
            source_rows, run.tokens = chosen
            if source_rows is not None:
                self.decoder.reorder(self.cache.rows(run.start, run.stop, run.position), source_rows)
            return False
        sequences, scores = run.search.result()
        request = run.handle.request
        avg_logprob = None
        if self.score is not None:
            eos = list(request.options.eos_token_id)
            avg_logprob = run.search.avg_logprob(eos)
            if avg_logprob is None:
                avg_logprob = self.score(self._own_cache(run), sequences, request.prompt.numel(), eos)
        run.handle.result = Result(sequences, scores, avg_logprob)
        self._release(run)
        return True

    # ---- rows and storage -----------------------------------------------------------------------------------------
    def _free_rows(self, rows: int, from_top: bool) -> int | None:
        """The first (or last) start of `rows` adjacent free rows; None if there is none."""
        starts = range(self.max_rows - rows, -1, -1) if from_top else range(self.max_rows - rows + 1)
        return next((s for s in starts if all(owner is None for owner in self._owner[s:s + rows])), None)

    def _release(self, run: _Running) -> None:
        self._owner[run.start:run.stop] = [None] * (run.stop - run.start)
        if run in self.running:
            self.running.remove(run)

    def _fit_length(self, positions: int) -> None:
        """Room for `positions` positions in every row (the cache grows, to twice its length at least)."""
        old = self.cache.max_length
        if positions <= old:
            return
        length = min(max(positions, 2 * old), max(self.decoder.max_positions, positions))
        for name in ("keys", "values"):
            held = getattr(self.cache, name)
            grown = held.new_zeros(*held.shape[:3], length, held.shape[4])
            grown[:, :, :, :old] = held
            setattr(self.cache, name, grown)

    def _place_cross(self, run: _Running, cross_keys: torch.Tensor, cross_values: torch.Tensor,
                     mask: torch.Tensor | None) -> None:
        """Store one request's cross K/V [layers, 1, H, S, hd] (and mask [1, S]) in its rows; the shared tensors grow
        to the longest S so far, shorter ones masked past their end."""
        cache, positions = self.cache, cross_keys.shape[3]
        if cache.cross_keys is None:
            shape = list(cross_keys.shape)
            shape[1] = self.max_rows
            cache.cross_keys, cache.cross_values = cross_keys.new_zeros(shape), cross_keys.new_zeros(shape)
        if cross_keys.element_size() > cache.cross_keys.element_size():
            # K/V that might not fit the steps' narrower dtype (DecoderSteps.cross_kv_dtype) came in their own: every
            # request's are held in it from now on (the narrower values convert exactly)
            dtype = cross_keys.dtype
            cache.cross_keys, cache.cross_values = cache.cross_keys.to(dtype), cache.cross_values.to(dtype)
        held = cache.cross_keys.shape[3]
        if positions > held or (positions < held or mask is not None) and cache.cross_mask is None:
            self._grow_cross(max(positions, held))
        rows = self._cross_rows(run)
        cache.cross_keys[:, rows, :, :positions] = cross_keys
        cache.cross_values[:, rows, :, :positions] = cross_values
        if cache.cross_mask is not None:
            cache.cross_mask[rows] = False
            cache.cross_mask[rows, :positions] = True if mask is None else mask.to(torch.bool)
        if cache.enc_index is not None:
            cache.enc_index[run.start:run.stop] = run.start
        run.encoder_positions, run.encoder_mask = positions, None if mask is None else mask.to(torch.bool)

    def _cross_rows(self, run: _Running) -> slice:
        """The rows of the shared cross K/V holding a run's: each of its rows, or its first."""
        return slice(run.start, run.stop if self.cross_per_row else run.start + 1)

    def _grow_cross(self, positions: int) -> None:
        """Shared cross K/V with room for `positions` encoder positions, and a mask (the held ones all real)."""
        cache = self.cache
        held = cache.cross_keys.shape[3]
        if cache.cross_mask is None:
            cache.cross_mask = torch.zeros(self.max_rows, held, dtype=torch.bool, device=self.decoder.device)
            for run in {id(run): run for run in self._owner if run is not None}.values():  # newcomers placed too
                cache.cross_mask[self._cross_rows(run), :run.encoder_positions] = True
        if positions > held:
            for name in ("cross_keys", "cross_values"):
                old = getattr(cache, name)
                grown = old.new_zeros(*old.shape[:3], positions, old.shape[4])
                grown[:, :, :, :held] = old
                setattr(cache, name, grown)
            mask = cache.cross_mask.new_zeros(self.max_rows, positions)
            mask[:, :held] = cache.cross_mask
            cache.cross_mask = mask

    def _own_cross(self, run: _Running) -> tuple[torch.Tensor, torch.Tensor]:
        """A run's cross K/V as it computed them, [layers, 1, H, S, hd] (views of its first row's)."""
        s, row = run.encoder_positions, run.start
        return self.cache.cross_keys[:, row:row + 1, :, :s], self.cache.cross_values[:, row:row + 1, :, :s]

    def _own_cache(self, run: _Running) -> CrossAttentionCache:
        """A cache over a run's rows holding only its own cross K/V (one encoder row, its S, its mask): what its
        scores are replayed with, as generate's are."""
        cache = self.cache.rows(run.start, run.stop, run.position)
        cache.row_positions, cache.enc_index = None, None
        if self.decoder.has_cross_attention:
            cache.set_cross(*self._own_cross(run), run.encoder_mask)
        else:
            cache.cross_keys = cache.cross_values = cache.cross_mask = None
        return cache

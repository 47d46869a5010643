"""generate.py's parts one at a time: each logit filter equals transformers' processor of the same meaning, the
fused argmax is told exactly what the min-length filter forbids, and the strategies (greedy, sampling, beam
search) give transformers' tokens and scores when driven by a plain GPT-2 without any cache."""

from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from xattn.generate import BeamSearchDecoder, GenerationOptions, sample_stream, top_candidates
from xattn.logit_filters import MinNewTokens, RepetitionPenalty, Temperature, TopK, TopP

VOCAB = 16  # small, so EOS comes up often and beams finish at different lengths


def random_scores(seed: int, rows: int = 5, vocab: int = 40, ties: bool = False) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    if ties:  # few distinct values: top-k and top-p must keep ties as transformers does
        return torch.randint(-3, 3, (rows, vocab), generator=generator).float()
    return torch.randn(rows, vocab, generator=generator) * 3


def random_ids(seed: int, rows: int = 5, length: int = 7, vocab: int = 40) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize(
    "ours, theirs",
    [
        (RepetitionPenalty(1.3), RepetitionPenaltyLogitsProcessor(1.3)),
        (RepetitionPenalty(0.7), RepetitionPenaltyLogitsProcessor(0.7)),
        (Temperature(0.6), TemperatureLogitsWarper(0.6)),
        (Temperature(1.7), TemperatureLogitsWarper(1.7)),
        (TopK(1), TopKLogitsWarper(1)),
        (TopK(7), TopKLogitsWarper(7)),
        (TopK(1000), TopKLogitsWarper(1000)),
        (TopP(0.0), TopPLogitsWarper(0.0)),
        (TopP(0.3), TopPLogitsWarper(0.3)),
        (TopP(0.9), TopPLogitsWarper(0.9)),
    ],
    ids=repr,
)
@pytest.mark.parametrize("ties", [False, True])
def test_filter_equals_transformers(ours, theirs, seed, ties):
    scores, ids = random_scores(seed, ties=ties), random_ids(seed)
    before = scores.clone()
    assert torch.equal(ours.apply(scores, ids), theirs(ids, scores.clone()))
    assert torch.equal(scores, before)  # filters never write into their input


@pytest.mark.parametrize("eos", [[3], [3, 17, 3]])
def test_min_new_tokens_equals_transformers(eos):
    prompt_length, min_new = 4, 3
    ours = MinNewTokens(prompt_length, min_new, torch.tensor(eos))
    new_tokens_rule = MinNewTokensLengthLogitsProcessor(prompt_length, min_new, eos)
    length_rule = MinLengthLogitsProcessor(prompt_length + min_new, eos)
    for length in range(prompt_length, prompt_length + min_new + 3):
        scores, ids = random_scores(length), random_ids(length, length=length)
        expected = new_tokens_rule(ids, scores)
        assert torch.equal(ours.apply(scores, ids), expected), length
        assert torch.equal(length_rule(ids, scores), expected), length


def test_forbidden_ids_are_what_the_filter_forbids():
    """The fused argmax is handed forbidden(n); the filter sets exactly those ids to -inf, and only while n < min."""
    prompt_length, min_new = 2, 4
    ours = MinNewTokens(prompt_length, min_new, torch.tensor([5, 9]))
    for new_tokens in range(min_new + 3):
        scores = random_scores(new_tokens)
        filtered = ours.apply(scores, random_ids(new_tokens, length=prompt_length + new_tokens))
        masked = torch.isinf(filtered).all(0).nonzero().flatten()
        assert torch.equal(masked, ours.forbidden(new_tokens).sort()[0]), new_tokens
        assert bool(masked.numel()) == (new_tokens < min_new), new_tokens
        assert torch.equal(filtered.argmax(-1), scores.index_fill(1, ours.forbidden(new_tokens), -torch.inf).argmax(-1))


# ---- strategies against transformers' generate on a plain GPT-2 (no cache on either side) --------------------
@pytest.fixture(scope="module")
def gpt2():
    torch.manual_seed(0)
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64, bos_token_id=1,
                        eos_token_id=2, pad_token_id=0)
    return GPT2LMHeadModel(config).eval()


def prompt(rows: int = 3, length: int = 4) -> torch.Tensor:
    return random_ids(7, rows=rows, length=length, vocab=VOCAB)


def transformers_generate(model, input_ids, **kwargs):
    torch.manual_seed(1234)
    with torch.no_grad():
        return model.generate(input_ids, attention_mask=torch.ones_like(input_ids), use_cache=False,
                              return_dict_in_generate=True, output_scores=True, **kwargs)


def stream(model, input_ids, opts, fused_argmax=None):
    """sample_stream with a step that recomputes everything: the sequence so far is what sample_stream wrote."""
    sequences = torch.zeros(input_ids.shape[0], input_ids.shape[1] + opts.max_new_tokens, dtype=torch.long)
    sequences[:, : input_ids.shape[1]] = input_ids

    def step(tokens, cache):  # writes at the cache's position and advances it, as the decoder's steps do
        position = cache.length
        cache.length += 1
        assert torch.equal(sequences[:, position], tokens)
        return model(sequences[:, : position + 1]).logits[:, -1]

    def greedy_step(tokens, cache, forbidden):
        fused_argmax.append(forbidden.tolist())
        return step(tokens, cache).float().index_fill(1, forbidden, -torch.inf).argmax(-1)

    torch.manual_seed(1234)
    with torch.no_grad():
        logits = model(input_ids).logits[:, -1]
        cache = SimpleNamespace(length=input_ids.shape[1])  # after the prompt's prefill
        steps = list(sample_stream(step, cache, sequences, input_ids.shape[1], logits, opts,
                                   greedy_step=None if fused_argmax is None else greedy_step))
    return sequences[:, : input_ids.shape[1] + len(steps)]


def options(model, input_ids, **kwargs) -> GenerationOptions:
    return GenerationOptions.from_kwargs(model.generation_config, input_ids.shape[1], **kwargs)


GREEDY_AND_SAMPLING = [
    dict(do_sample=False, max_new_tokens=12, eos_token_id=[2, 5], min_new_tokens=3),
    dict(do_sample=False, max_new_tokens=12, eos_token_id=[2, 5], repetition_penalty=1.5),
    dict(do_sample=True, max_new_tokens=12, eos_token_id=[2], top_k=0, top_p=1.0),
    dict(do_sample=True, max_new_tokens=12, eos_token_id=[2, 5], min_new_tokens=4, repetition_penalty=1.2,
         temperature=0.7, top_k=6, top_p=0.8),
    dict(do_sample=True, max_new_tokens=12, eos_token_id=[2], num_return_sequences=2, temperature=1.5, top_p=0.5),
]


@pytest.mark.parametrize("kwargs", GREEDY_AND_SAMPLING, ids=str)
def test_greedy_and_sampling_equal_transformers(gpt2, kwargs):
    """Same filters in the same order, same multinomial draws from the same RNG: the same tokens."""
    input_ids = prompt().repeat_interleave(kwargs.get("num_return_sequences", 1), 0)
    expected = transformers_generate(gpt2, prompt(), **kwargs).sequences
    assert torch.equal(stream(gpt2, input_ids, options(gpt2, input_ids, **kwargs)), expected)


def test_fused_argmax_gets_the_min_length_rule(gpt2):
    """Make EOS the token greedy would pick at once, then ask for 4 tokens first: the fused argmax must forbid it
    for exactly the first steps, and the tokens must be those of the filtered argmax."""
    input_ids = prompt()
    free = stream(gpt2, input_ids, options(gpt2, input_ids, max_new_tokens=6, eos_token_id=[]))
    eos = sorted({int(free[0, 4]), int(free[1, 4])})
    opts = options(gpt2, input_ids, max_new_tokens=10, eos_token_id=eos, min_new_tokens=4)
    forbidden = []
    fused = stream(gpt2, input_ids, opts, fused_argmax=forbidden)
    assert torch.equal(fused, stream(gpt2, input_ids, opts))
    assert torch.equal(fused, transformers_generate(gpt2, input_ids, max_new_tokens=10, eos_token_id=eos,
                                                    min_new_tokens=4).sequences)
    assert not torch.isin(fused[:, 4:8], torch.tensor(eos)).any()
    # the prefill's logits go through the filters; each later step's argmax is fused and told the rule
    assert forbidden[:3] == [eos] * 3 and all(ids == [] for ids in forbidden[3:])


def beam_search_without_cache(model, input_ids, opts):
    """BeamSearchDecoder's loop with the cache replaced by rows of tokens that are reordered and recomputed."""
    rows = input_ids.repeat_interleave(opts.num_beams, 0)
    beams = BeamSearchDecoder(opts, rows)
    with torch.no_grad():
        logits = model(rows).logits[:, -1]
        while (chosen := beams.update(logits)) is not None:
            source_rows, tokens = chosen
            rows = torch.cat((rows[source_rows], tokens[:, None]), dim=1)
            assert rows.shape[1] == beams.length
            logits = model(rows).logits[:, -1]
    return beams.finalize()


BEAMS = [
    dict(num_beams=3, max_new_tokens=10, eos_token_id=[2]),
    dict(num_beams=4, max_new_tokens=10, eos_token_id=[2, 5], num_return_sequences=3, length_penalty=0.5),
    dict(num_beams=3, max_new_tokens=10, eos_token_id=[2, 5], early_stopping=True, min_new_tokens=3),
    dict(num_beams=3, max_new_tokens=8, eos_token_id=[2, 5], early_stopping="never", length_penalty=2.0,
         repetition_penalty=1.4, num_return_sequences=2),
    dict(num_beams=2, max_new_tokens=6, eos_token_id=[], pad_token_id=3),  # no EOS: every beam runs to the end
]


@pytest.mark.parametrize("kwargs", BEAMS, ids=str)
def test_beam_search_decoder_equals_transformers(gpt2, kwargs):
    input_ids = prompt()
    expected = transformers_generate(gpt2, input_ids, **kwargs)
    sequences, scores = beam_search_without_cache(gpt2, input_ids, options(gpt2, input_ids, **kwargs))
    assert torch.equal(sequences, expected.sequences)
    torch.testing.assert_close(scores, expected.sequences_scores, rtol=1e-5, atol=1e-6)


def _totals(kind: str, seed: int) -> torch.Tensor:
    """[B, beams, V] beam totals: distinct values, or with the equal values, -inf and NaN real searches meet."""
    generator = torch.Generator().manual_seed(seed)
    totals = torch.randn(3, 4, 50, generator=generator) - 5
    if kind == "coarse":  # many equal values, some among the best
        totals = (totals * 2).round() / 2
    elif kind == "masked":  # filters leave few finite tokens: -inf ties at the boundary
        totals[:, :, 2:] = float("-inf")
    elif kind == "nan":
        totals[1, 2, 7] = float("nan")
    elif kind == "first step":  # beams past the first start at _NEG: one beam's best are the candidates
        totals[:, 1:] -= 1e9
    elif kind == "equal beams":  # two beams whose best values are equal
        totals[:, 1] = totals[:, 0]
    return totals


@pytest.mark.parametrize("kind", ["distinct", "coarse", "masked", "nan", "first step", "equal beams"])
@pytest.mark.parametrize("keep", [1, 8, 49, 50])
def test_top_candidates_are_torch_topk_over_all_beams(kind, keep, monkeypatch):
    totals = _totals(kind, seed=keep)
    flat = totals.view(3, -1)
    expected_values, expected_index = torch.topk(flat, keep)
    shapes = []
    real = torch.topk
    monkeypatch.setattr(torch, "topk", lambda x, k, *a, **kw: shapes.append(tuple(x.shape)) or real(x, k, *a, **kw))
    values, index = top_candidates(totals, keep)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(index, expected_index)
    if kind in ("distinct", "first step") and keep < 50:  # no ties: the per-beam path answered alone
        assert shapes == [(3, 4, 50), (3, 4 * (keep + 1))]

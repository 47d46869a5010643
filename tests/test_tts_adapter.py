"""The Tortoise/XTTS adapter: a GPT2Model with wte removed and wpe returning zeros, prefix embeddings from the
caller, the model's own audio-token/position embeddings, final norm and head — decoded by xattn exactly as
transformers' own forward decodes it step by step."""

import functools
import inspect

import pytest
import torch
from transformers import GPT2Config, GPT2Model

from xattn.tasks.tts_adapter import PrefixConditionedGPT2

D, AUDIO_VOCAB, START = 32, 40, 38


def null_position_embeddings(range_ids, dim):  # what Tortoise puts in place of wpe
    return torch.zeros((range_ids.shape[0], range_ids.shape[1], dim), device=range_ids.device)


def tortoise_like(seed: int = 0):
    torch.manual_seed(seed)
    gpt = GPT2Model(GPT2Config(n_embd=D, n_layer=2, n_head=4, vocab_size=8, n_positions=64)).eval()
    del gpt.wte
    del gpt.wpe
    gpt.wpe = functools.partial(null_position_embeddings, dim=D)
    mel_embedding, mel_pos_embedding = torch.nn.Embedding(AUDIO_VOCAB, D), torch.nn.Embedding(30, D)
    final_norm, mel_head = torch.nn.LayerNorm(D), torch.nn.Linear(D, AUDIO_VOCAB)
    with torch.no_grad():  # a fresh LayerNorm is the identity on GPT-2's normalised output: make it count
        final_norm.weight.uniform_(0.5, 1.5)
        final_norm.bias.normal_(0, 0.3)
    return gpt, mel_embedding, mel_pos_embedding, final_norm, mel_head


def transformers_step_by_step(parts, prefix, steps, stop=None):
    """transformers' GPT2Model forward with its own KV cache, one audio token at a time (greedy)."""
    gpt, mel_embedding, mel_pos_embedding, final_norm, mel_head = parts
    cache_kw = "cache" if "cache" in inspect.signature(gpt.forward).parameters else "past_key_values"
    batch = prefix.shape[0]
    tokens = torch.full((batch,), START)
    emb = mel_embedding(tokens)[:, None] + mel_pos_embedding(torch.tensor([0]))
    out = gpt(inputs_embeds=torch.cat([prefix, emb], 1), use_cache=True)
    done = torch.zeros(batch, dtype=torch.bool)
    generated, latents = [], []
    for i in range(1, steps + 1):
        hidden = final_norm(out.last_hidden_state[:, -1])
        nxt = mel_head(hidden).argmax(-1)
        if stop is not None:
            nxt = torch.where(done, stop, nxt)
            done |= nxt == stop
        generated.append(nxt)
        latents.append(hidden)
        emb = mel_embedding(nxt)[:, None] + mel_pos_embedding(torch.tensor([i]))
        out = gpt(inputs_embeds=emb, use_cache=True, **{cache_kw: out.past_key_values})
    return torch.stack(generated, 1), torch.stack(latents, 1)


@pytest.mark.parametrize("batch", [1, 4])
def test_greedy_tokens_and_latents_equal_transformers_step_by_step(batch):
    parts = tortoise_like()
    gpt, mel_embedding, mel_pos_embedding, final_norm, mel_head = parts
    prefix = torch.randn(batch, 7, D, generator=torch.Generator().manual_seed(batch))
    adapter = PrefixConditionedGPT2(gpt, mel_embedding, mel_pos_embedding, mel_head, final_norm=final_norm)
    with torch.no_grad():
        expected, expected_latents = transformers_step_by_step(parts, prefix, 12)
        out = adapter.generate(prefix, start_token=START, max_new_tokens=12)
        assert torch.equal(out.sequences, expected)
        torch.testing.assert_close(out.latents, expected_latents, atol=1e-5, rtol=1e-5)
        # a stop token the model really emits mid-way: rows stop at different steps, then repeat it
        stop = int(expected[0, 3])
        expected, _ = transformers_step_by_step(parts, prefix, 12, stop=stop)
        out = adapter.generate(prefix, start_token=START, stop_token=stop, max_new_tokens=12)
    assert torch.equal(out.sequences, expected[:, : out.sequences.shape[1]])
    assert out.lengths[0] == 4 and bool((out.sequences[0, 3:] == stop).all())


def test_candidates_from_one_prefill_equal_separate_prefills():
    gpt, mel_embedding, mel_pos_embedding, final_norm, mel_head = tortoise_like(1)
    adapter = PrefixConditionedGPT2(gpt, mel_embedding, mel_pos_embedding, mel_head, final_norm=final_norm)
    prefix = torch.randn(2, 5, D, generator=torch.Generator().manual_seed(3))
    kwargs = dict(start_token=START, max_new_tokens=10, do_sample=True, temperature=0.9, top_p=0.9, top_k=20,
                  repetition_penalty=1.3)
    shared = adapter.generate(prefix, num_return_sequences=3, generator=torch.Generator().manual_seed(7), **kwargs)
    separate = adapter.generate(prefix.repeat_interleave(3, 0), generator=torch.Generator().manual_seed(7), **kwargs)
    assert torch.equal(shared.sequences, separate.sequences)
    torch.testing.assert_close(shared.latents, separate.latents)
    assert len({tuple(row.tolist()) for row in shared.sequences}) > 1  # candidates really differ


def test_streamed_tokens_and_latents_equal_the_whole_run():
    gpt, mel_embedding, mel_pos_embedding, final_norm, mel_head = tortoise_like(2)
    adapter = PrefixConditionedGPT2(gpt, mel_embedding, mel_pos_embedding, mel_head, final_norm=final_norm)
    prefix = torch.randn(3, 4, D, generator=torch.Generator().manual_seed(4))
    whole = adapter.generate(prefix, start_token=START, max_new_tokens=8)
    stream = adapter.stream(prefix, start_token=START, max_new_tokens=8)
    first = next(stream)  # the first tokens come before the rest is generated
    assert torch.equal(first.tokens, whole.sequences[:, 0])
    rest = list(stream)
    assert torch.equal(torch.stack([first.tokens] + [s.tokens for s in rest], 1), whole.sequences)
    torch.testing.assert_close(torch.stack([first.latents] + [s.latents for s in rest], 1), whole.latents)


def test_bad_prefix_and_options_are_refused():
    gpt, mel_embedding, mel_pos_embedding, final_norm, mel_head = tortoise_like()
    adapter = PrefixConditionedGPT2(gpt, mel_embedding, mel_pos_embedding, mel_head, final_norm=final_norm)
    with pytest.raises(ValueError, match="prefix_embeds must be"):
        adapter.generate(torch.randn(2, 5, D + 1), start_token=START)
    for empty in (torch.randn(2, 0, D), torch.randn(0, 5, D)):
        with pytest.raises(ValueError, match=r"^prefix_embeds is empty"):
            adapter.generate(empty, start_token=START)
    with pytest.raises(ValueError, match=r"^prefix_embeds is float64, the model is float32: pass "):
        adapter.generate(torch.randn(2, 5, D, dtype=torch.float64), start_token=START)
    with pytest.raises(ValueError, match=r"^prefix_embeds is float64"):
        next(adapter.stream(torch.randn(2, 5, D, dtype=torch.float64), start_token=START))
    with pytest.raises(ValueError, match=r"^prefix_embeds must be a tensor, got list$"):
        adapter.generate([[0.0] * D], start_token=START)
    with pytest.raises(ValueError, match="num_beams"):
        next(adapter.stream(torch.randn(2, 5, D), start_token=START, num_beams=2))
    with pytest.raises(ValueError, match="top_p"):
        adapter.generate(torch.randn(2, 5, D), start_token=START, do_sample=True, top_p=2.0)
    with pytest.raises(ValueError, match=r"^weights='fp32': choose one of exact, packed, bf16, int8$"):
        PrefixConditionedGPT2(gpt, mel_embedding, mel_pos_embedding, mel_head, weights="fp32")


@pytest.mark.parametrize("batch", [1, 4])
def test_packed_weights_give_transformers_tokens(batch):
    """The GPT's projections as fp32 copies (xattn.fast.formats' "packed"): the same tokens, latents to rounding."""
    parts = tortoise_like(4)
    gpt, mel_embedding, mel_pos_embedding, final_norm, mel_head = parts
    prefix = torch.randn(batch, 7, D, generator=torch.Generator().manual_seed(6))
    adapter = PrefixConditionedGPT2(gpt, mel_embedding, mel_pos_embedding, mel_head, final_norm=final_norm,
                                    weights="packed")
    with torch.no_grad():
        expected, expected_latents = transformers_step_by_step(parts, prefix, 12)
        out = adapter.generate(prefix, start_token=START, max_new_tokens=12)
    assert torch.equal(out.sequences, expected)
    torch.testing.assert_close(out.latents, expected_latents, atol=1e-5, rtol=1e-5)


def test_beam_search_latents_are_the_hidden_states_of_the_returned_codes():
    """Beams are reordered while they grow: generate() gives each returned sequence the latents transformers' own
    forward computes over it (teacher forcing)."""
    parts = tortoise_like(3)
    gpt, mel_embedding, mel_pos_embedding, final_norm, mel_head = parts
    adapter = PrefixConditionedGPT2(gpt, mel_embedding, mel_pos_embedding, mel_head, final_norm=final_norm)
    prefix = torch.randn(2, 6, D, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = adapter.generate(prefix, start_token=START, max_new_tokens=10, num_beams=3, num_return_sequences=2,
                               repetition_penalty=1.5)
        assert out.sequences.shape[0] == 4
        audio = torch.cat([torch.full((4, 1), START), out.sequences[:, :-1]], 1)
        emb = mel_embedding(audio) + mel_pos_embedding(torch.arange(audio.shape[1]))
        hidden = gpt(inputs_embeds=torch.cat([prefix.repeat_interleave(2, 0), emb], 1)).last_hidden_state
        torch.testing.assert_close(out.latents, final_norm(hidden[:, prefix.shape[1]:]), atol=1e-5, rtol=1e-5)

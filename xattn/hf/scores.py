"""How sure the model was of what it generated: each sequence's average token log-probability, as faster-whisper's
avg_logprob (the generated tokens up to and including the first EOS, each scored by the model's own distribution,
before temperature, top-k/top-p or penalties). Greedy and sampling add them up as each token is chosen
(xattn/logprobs.py, in generate and in in-flight batching); here the finished sequences are replayed once through the
decoder, for beam search (whose rows are reordered) and for steps that never gave full logits (the packed format's
fused greedy argmax)."""

from __future__ import annotations

import torch

from ..cache import CrossAttentionCache
from ..decoder import GPT2CrossAttentionDecoder
from ..logprobs import mean_up_to_first_eos

_LOGIT_BUDGET = 2**24  # floats of logits per replayed chunk of rows (vocabularies run to 50k+ tokens)


@torch.no_grad()
def average_logprobs(decoder: GPT2CrossAttentionDecoder, cache: CrossAttentionCache, sequences: torch.Tensor,
                     prompt_length: int, eos_token_ids: list[int]) -> torch.Tensor:
    """[rows] float: the mean log-probability of each row's generated tokens (NaN for a row with none).

    cache: the one the sequences were generated with; only its cross K/V are read."""
    rows, length = sequences.shape
    generated = sequences[:, prompt_length:]
    if generated.shape[1] == 0:
        return torch.full((rows,), float("nan"))
    enc_rows = _encoder_rows(cache, rows)
    chunk = max(1, _LOGIT_BUDGET // (length * decoder.transformer.config.vocab_size))
    token_logprobs = []
    for start in range(0, rows, chunk):
        ids = sequences[start: start + chunk]
        replay = decoder.new_cache(ids.shape[0], length)
        if cache.has_cross:  # the chunk's rows read their encoder rows through enc_index (set first)
            replay.enc_index = enc_rows[start: start + chunk]
            replay.set_cross(cache.cross_keys, cache.cross_values, cache.cross_mask)
        logits = decoder.prefill(replay, input_ids=ids[:, :-1], all_logits=True)[:, prompt_length - 1:]
        token_logprobs.append(logits.float().log_softmax(-1).gather(-1, ids[:, prompt_length:, None])[..., 0])
    return mean_up_to_first_eos(torch.cat(token_logprobs), generated, eos_token_ids)


def _encoder_rows(cache: CrossAttentionCache, rows: int) -> torch.Tensor | None:
    """The encoder row each output row was generated from: the cache's own map when it has one row per output
    row; else output rows come in equal groups per encoder row (beams reduced to num_return_sequences)."""
    if not cache.has_cross:
        return None
    if cache.batch_size == rows:
        return cache.encoder_rows()
    per_input = rows // cache.encoder_batch_size
    return torch.arange(rows, device=cache.keys.device) // per_input

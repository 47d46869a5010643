"""A small byte-level BPE tokenizer trained on a caption corpus, saved as a transformers fast tokenizer."""

from __future__ import annotations

from collections.abc import Iterable

BOS_EOS = "<|endoftext|>"  # GPT-2's convention: one token starts and ends every caption
PAD = "<pad>"


def train_caption_tokenizer(texts: Iterable[str], vocab_size: int = 320):
    """Train byte-level BPE (GPT-2's scheme) on the captions; returns a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS_EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS_EOS, eos_token=BOS_EOS, pad_token=PAD)

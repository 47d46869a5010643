"""The small encoder-decoder models xattn trains and ships: any transformers encoder config + a small GPT-2
with cross-attention, special tokens taken from the tokenizer (GPT-2's convention: bos = eos =
decoder_start)."""

from __future__ import annotations


def new_encoder_decoder(model_class, config_class, encoder_config, tokenizer, *, n_positions: int, n_layer: int,
                        max_new_tokens: int):
    """model_class(config_class.from_encoder_decoder_configs(encoder_config, GPT-2)), random weights.

    The GPT-2: hidden 128, 4 heads, no dropout, vocabulary = the tokenizer's."""
    from transformers import GPT2Config

    special = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                   pad_token_id=tokenizer.pad_token_id)
    decoder = GPT2Config(vocab_size=len(tokenizer), n_positions=n_positions, n_embd=128, n_layer=n_layer, n_head=4,
                         add_cross_attention=True, is_decoder=True, resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0, **special)
    config = config_class.from_encoder_decoder_configs(encoder_config, decoder)
    config.decoder_start_token_id = tokenizer.bos_token_id
    config.pad_token_id, config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    model = model_class(config)
    model.generation_config.update(decoder_start_token_id=tokenizer.bos_token_id, max_new_tokens=max_new_tokens,
                                   **special)
    return model

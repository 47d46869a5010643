"""A GPT-2 decoder with cross-attention that runs over the weights of a transformers GPT2Model.

No parameter is copied: every projection reads the module's own tensors. The forward pass writes
self-attention K/V into a CrossAttentionCache in place and reads cross-attention K/V computed once.
`prefill()` takes a prompt of any length and `decode_step()` one token per row, each at the cache's position,
which it advances; `step_logits()` is the step without the advance (static shapes, no host state), what
torch.compile(fullgraph=True) compiles. Where the cache has row_positions, each row steps at its own position
(in-flight batching, xattn/inflight.py, which moves them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .cache import CrossAttentionCache
from .steps import DecoderSteps, exact_steps


def _layer_norm(x: torch.Tensor, ln: nn.LayerNorm) -> torch.Tensor:
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


class GPT2CrossAttentionDecoder(nn.Module):
    """Runs a transformers GPT2Model (optionally with cross-attention) with a static cache.

    transformer: a `GPT2Model` (e.g. `GPT2LMHeadModel.transformer`).
    lm_head: the output projection (e.g. `GPT2LMHeadModel.lm_head`); None returns final hidden states.
    embed: optional `(input_ids [B, T], positions [T]) -> [B, T, D]` replacing wte + wpe, for models whose
        token and position embeddings live outside the GPT2Model (Tortoise/XTTS-style TTS).
    head: optional `hidden [B, T, D] -> logits` replacing lm_head, applied after ln_f (those models' own
        final norm + head).
    steps: how the products are computed (DecoderSteps); default transformers' own ("exact"). Other formats
        and fast paths come from xattn.fast.accelerate(decoder, weights).
    """

    def __init__(
        self,
        transformer: nn.Module,
        lm_head: nn.Module | None = None,
        *,
        embed: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
        head: Callable[[torch.Tensor], torch.Tensor] | None = None,
        steps: DecoderSteps | None = None,
    ):
        super().__init__()
        config = transformer.config
        self.transformer = transformer
        self.lm_head = lm_head
        self.embed_fn = embed
        self.output_fn = head
        self.num_layers = config.n_layer
        self.num_heads = config.n_head
        self.hidden_size = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.max_positions = config.n_positions
        self.has_cross_attention = bool(config.add_cross_attention)
        self.scalings = []
        for layer_idx in range(self.num_layers):
            scaling = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
            if config.scale_attn_by_inverse_layer_idx:
                scaling /= float(layer_idx + 1)
            self.scalings.append(scaling)
        self.steps = steps if steps is not None else exact_steps(transformer, lm_head)
        self.projections = self.steps.projections
        self.attention = self.steps.attention
        self.activation = _tanh_gelu if self.steps.tanh_gelu else _module_activation
        self.fused = self.steps.fused
        self.greedy_head = None if head is not None else self.steps.greedy_head

    @property
    def weights(self) -> str:
        return self.steps.name

    @property
    def cross_weights(self) -> str:
        return self.steps.cross_name

    @property
    def blocks(self) -> nn.ModuleList:
        return self.transformer.h

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.ln_f.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.transformer.ln_f.weight.device

    # ---- the cache --------------------------------------------------------------------------------------
    def new_cache(
        self,
        batch_size: int,
        max_length: int,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
    ) -> CrossAttentionCache:
        """Allocate a cache for batch_size decoding rows and fill its cross-attention K/V once.

        encoder_hidden_states: [B_enc, S, D] with batch_size a multiple of B_enc (rows r*g .. r*g+g-1 read
        encoder row r); encoder_attention_mask: [B_enc, S], 1 for real positions, 0 for padding.
        """
        cache = CrossAttentionCache.allocate(
            self.num_layers, batch_size, self.num_heads, max_length, self.head_dim, dtype=self.dtype,
            device=self.device,
        )
        if encoder_hidden_states is not None:
            cross_k, cross_v = self.cross_key_values(encoder_hidden_states)
            cache.set_cross(cross_k, cross_v, encoder_attention_mask)
        return cache

    @torch.no_grad()
    def cross_key_values(self, encoder_hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross-attention K/V of every layer, [layers, B_enc, H, S, D] each, in the dtype the steps keep them in
        (DecoderSteps.cross_kv_dtype; else the states' own), converted as they are written."""
        if not self.has_cross_attention:
            raise ValueError("this GPT-2 decoder has no cross-attention layers (config.add_cross_attention=False); "
                             "pass no encoder_hidden_states, or use a model built with add_cross_attention=True")
        dtype = None if self.steps.cross_kv_dtype is None else self.steps.cross_kv_dtype(encoder_hidden_states)
        b, s, _ = encoder_hidden_states.shape
        shape = (self.num_layers, b, self.num_heads, s, self.head_dim)
        keys, values = (encoder_hidden_states.new_empty(shape, dtype=dtype) for _ in range(2))
        # "exact" projects the batch at once, as transformers does; a format may take a few rows at a time
        group = b if self.steps.cross_rows is None else self.steps.cross_rows(s)
        if self.steps.cross_name == "bf16":  # every layer's product rounds its input so: once for all
            encoder_hidden_states = encoder_hidden_states.to(torch.bfloat16)
        for layer_idx, projection in enumerate(self.steps.cross_kv):
            for start in range(0, b, group):
                rows, part = encoder_hidden_states[start: start + group], slice(start, start + group)
                if getattr(projection, "into_heads", None) and projection.into_heads(rows, keys[layer_idx, part],
                                                                                     values[layer_idx, part]):
                    continue  # the format wrote its heads itself
                kv = projection(rows)  # (n, S, 2*D)
                k, v = kv.view(rows.shape[0], s, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
                keys[layer_idx, part], values[layer_idx, part] = k, v  # (n, H, S, hd)
        return keys, values

    # ---- forward ------------------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[B, T] ids at positions [T] -> [B, T, D]."""
        if self.embed_fn is not None:
            return self.embed_fn(input_ids, positions)
        return self.transformer.wte(input_ids) + self.transformer.wpe(positions)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = _layer_norm(hidden, self.transformer.ln_f)
        if self.output_fn is not None:
            return self.output_fn(hidden)
        return hidden if self.steps.lm_head is None else self.steps.lm_head(hidden)

    @torch.no_grad()
    def prefill(self, cache: CrossAttentionCache, input_ids: torch.Tensor | None = None,
                inputs_embeds: torch.Tensor | None = None, all_logits: bool = False) -> torch.Tensor:
        """Run a prompt ([B, T] ids, or [B, T, D] embeddings to which wpe is added as transformers does)
        from cache.length on; returns the last position's logits [B, V] (all [B, T, V] with all_logits)."""
        start = cache.length
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if start + length > cache.max_length:
            raise ValueError(f"prompt of {length} tokens does not fit the cache ({cache.max_length - start} free)")
        if length == 1 and input_ids is not None and not all_logits and cache.row_positions is None and \
                self.fused is not None and self.fused.applies(len(input_ids), cache):
            return self.decode_step(input_ids[:, 0], cache)  # one token is a step: the fused one reads weights once
        positions = torch.arange(start, start + length, device=self.device)
        if inputs_embeds is not None:
            hidden = inputs_embeds + self.transformer.wpe(positions) if self.embed_fn is None else inputs_embeds
        else:
            hidden = self.embed(input_ids, positions)
        hidden = self.forward_hidden(hidden, cache, positions)
        cache.advance(length)
        if not all_logits:
            hidden = hidden[:, -1:]
        logits = self.logits(hidden)
        return logits if all_logits else logits[:, 0]

    def reorder(self, cache: CrossAttentionCache, row_index: torch.Tensor) -> None:
        """Beam reorder of the cache's self K/V (row i takes row row_index[i]'s), through the steps' kernel where
        they have one."""
        cache.reorder(row_index, self.steps.reorder_rows)

    @torch.no_grad()
    def decode_step(self, input_ids: torch.Tensor, cache: CrossAttentionCache) -> torch.Tensor:
        """One token per row at cache.position: input_ids [B] -> logits [B, V]; writes its K/V, advances the cache."""
        return advancing(self.step_logits)(input_ids, cache)

    @torch.no_grad()
    def step_logits(self, input_ids: torch.Tensor, cache: CrossAttentionCache) -> torch.Tensor:
        """decode_step without the advance: static shapes, no data-dependent branching, no host state (the
        position is the cache's tensor), so torch.compile(fullgraph=True) compiles it once."""
        return self.logits(self._step_hidden(input_ids, cache))[:, 0]

    @torch.no_grad()
    def decode_greedy(self, input_ids: torch.Tensor, cache: CrossAttentionCache, forbidden: torch.Tensor
                      ) -> torch.Tensor:
        """decode_step's argmax with the ids in forbidden [F] left out: the next greedy tokens [B]."""
        return advancing(self.step_greedy)(input_ids, cache, forbidden)

    @torch.no_grad()
    def step_greedy(self, input_ids: torch.Tensor, cache: CrossAttentionCache, forbidden: torch.Tensor
                    ) -> torch.Tensor:
        """decode_greedy without the advance (compiles like step_logits). With a greedy_head (xattn.fast: the packed
        format's) the whole head product is not computed; the tokens are the same."""
        hidden = self._step_hidden(input_ids, cache)
        if self.greedy_head is not None and self.greedy_head.applies(hidden.shape[0]):
            return self.greedy_head(_layer_norm(hidden[:, 0], self.transformer.ln_f), forbidden)
        logits = self.logits(hidden)[:, 0].float()
        # scatter, not index_fill: compiles for a forbidden length left symbolic (xattn.hf's compile())
        return torch.argmax(logits.scatter(1, forbidden.expand(logits.shape[0], -1), float("-inf")), dim=-1)

    def _step_hidden(self, input_ids: torch.Tensor, cache: CrossAttentionCache):
        """input_ids [B] at cache.position (or each row at cache.row_positions) -> the last block's output [B, 1, D]
        (before ln_f); writes the step's K/V."""
        position = cache.position if cache.row_positions is None else cache.row_positions  # [] or [B]
        positions = position.view(-1, 1) if position.dim() else position.view(1)  # [B, 1] per row, or [1]
        hidden = self.embed(input_ids[:, None], positions)
        if self.fused is not None and self.fused.applies(input_ids.shape[0], cache):
            return self.fused(hidden[:, 0], cache, position)[:, None]
        return self.forward_hidden(hidden, cache, positions)

    @torch.no_grad()
    def cross_attention_probs(self, cache: CrossAttentionCache, input_ids: torch.Tensor) -> torch.Tensor:
        """Run input_ids [B, T] from cache.length on and return the cross-attention probabilities of every
        layer, [layers, B, H, T, S] (for attention maps; generation never computes them)."""
        positions = torch.arange(cache.length, cache.length + input_ids.shape[1], device=self.device)
        record: list[torch.Tensor] = []
        self.forward_hidden(self.embed(input_ids, positions), cache, positions, record=record)
        cache.advance(input_ids.shape[1])
        return torch.stack(record)

    def forward_hidden(
        self, hidden: torch.Tensor, cache: CrossAttentionCache, positions: torch.Tensor,
        record: list | None = None,
    ) -> torch.Tensor:
        """hidden [B, T, D] at absolute positions [T] (or [B, T], each row at its own); writes K/V at those positions;
        returns [B, T, D].

        record: if a list, each layer's cross-attention probabilities [B, H, T, S] are appended to it."""
        t_max = cache.max_length
        # (T, T_max), or (B, 1, T, T_max) per row: a query at position p sees keys at positions <= p
        self_mask = torch.arange(t_max, device=hidden.device) <= positions[..., None]
        if positions.dim() == 2:
            self_mask = self_mask[:, None]
        cross_mask = None
        if cache.cross_mask is not None:
            cross_mask = cache.cross_mask[:, None, None, :]  # (B_enc, 1, 1, S)
        enc_index = cache.enc_index
        for layer_idx, block in enumerate(self.blocks):
            hidden = self._block(block, layer_idx, hidden, cache, positions, self_mask, cross_mask, enc_index, record)
        return hidden

    def _block(self, block, layer_idx, hidden, cache, positions, self_mask, cross_mask, enc_index, record=None):
        b, t, _ = hidden.shape
        h, hd = self.num_heads, self.head_dim
        scaling = self.scalings[layer_idx]
        proj = self.projections[layer_idx]

        qkv = proj["qkv"](_layer_norm(hidden, block.ln_1))  # (B, T, 3*D)
        q, k, v = qkv.view(b, t, 3, h, hd).permute(2, 0, 3, 1, 4)  # each (B, H, T, hd)
        keys, values = cache.keys[layer_idx], cache.values[layer_idx]  # (B, H, T_max, hd)
        if positions.dim() == 1:
            keys.index_copy_(2, positions, k)
            values.index_copy_(2, positions, v)
        else:  # each row at its own positions
            at = positions[:, None, :, None].expand(b, h, t, hd)
            keys.scatter_(2, at, k)
            values.scatter_(2, at, v)
        attn = self.attention(q, keys, values, attn_mask=self_mask, scale=scaling)
        hidden = hidden + proj["attn_out"](attn.transpose(1, 2).reshape(b, t, h * hd))

        if cache.cross_keys is not None:
            x = _layer_norm(hidden, block.ln_cross_attn)
            q = proj["cross_q"](x).view(b, t, h, hd).transpose(1, 2)  # (B, H, T, hd)
            ck, cv = cache.cross_keys[layer_idx], cache.cross_values[layer_idx]  # (B_enc, H, S, hd)
            ck, cv = ck.to(q.dtype), cv.to(q.dtype)  # where the steps keep them in another dtype (cross_kv_dtype)
            attn = _shared_cross_attention(q, ck, cv, cross_mask, enc_index, scaling, self.attention)
            if record is not None:
                record.append(_cross_probs(q, ck, cache.encoder_rows(), cache.cross_mask, scaling))
            hidden = hidden + proj["cross_out"](attn.transpose(1, 2).reshape(b, t, h * hd))

        # transformers' GPT2MLP: c_fc, act, c_proj (its dropout is the identity in eval)
        return hidden + proj["mlp_out"](self.activation(block, proj["mlp_in"](_layer_norm(hidden, block.ln_2))))


def advancing(step: Callable) -> Callable:
    """step(tokens, cache, *rest) followed by cache.advance(): a compiled step keeps no host state, so the cache's
    position moves here, outside it."""
    def run(tokens: torch.Tensor, cache: CrossAttentionCache, *rest):
        out = step(tokens, cache, *rest)
        cache.advance(1)
        return out

    return run


def _shared_cross_attention(q, cross_k, cross_v, cross_mask, enc_index, scaling, attention):
    """Attention of q (B, H, T, hd) over cross K/V stored once per encoder row (B_enc, H, S, hd).

    In the regular layout the g = B / B_enc rows of one input become g*T query positions of that input,
    so the shared K/V are read in place; an arbitrary row selection gathers them instead.
    """
    b, h, t, hd = q.shape
    if enc_index is not None:
        mask = None if cross_mask is None else cross_mask.index_select(0, enc_index)
        return attention(
            q, cross_k.index_select(0, enc_index), cross_v.index_select(0, enc_index), attn_mask=mask,
            scale=scaling,
        )
    b_enc = cross_k.shape[0]
    g = b // b_enc
    if g == 1:
        return attention(q, cross_k, cross_v, attn_mask=cross_mask, scale=scaling)
    q = q.view(b_enc, g, h, t, hd).transpose(1, 2).reshape(b_enc, h, g * t, hd)  # (B_enc, H, g*T, hd)
    out = attention(q, cross_k, cross_v, attn_mask=cross_mask, scale=scaling)
    return out.view(b_enc, h, g, t, hd).transpose(1, 2).reshape(b, h, t, hd)  # (B, H, T, hd)


def plain_attention(q, k, v, attn_mask=None, scale=None):
    """softmax(q k^T * scale) v with a boolean mask (True: may attend), as three products-and-softmax ops."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if attn_mask is None:
        return torch.matmul(scores.softmax(dim=-1), v)
    return torch.matmul(_masked_softmax(scores, ~attn_mask), v)


def _masked_softmax(scores: torch.Tensor, blocked: torch.Tensor) -> torch.Tensor:
    """softmax over the positions not blocked; a row with every position blocked (an all-padding input) gets zeros,
    as torch's SDPA gives (and transformers 5), not NaN."""
    return scores.masked_fill(blocked, float("-inf")).softmax(dim=-1).masked_fill(blocked, 0.0)


def _tanh_gelu(block, x):
    return F.gelu(x, approximate="tanh")  # gelu_new's formula in one op


def _module_activation(block, x):
    return block.mlp.act(x)


def _cross_probs(q, cross_k, enc_rows, cross_mask, scaling):
    """Explicit softmax(q k^T) over the encoder positions, (B, H, T, S); only for attention maps."""
    keys = cross_k.index_select(0, enc_rows)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scaling
    if cross_mask is None:
        return scores.softmax(dim=-1)
    return _masked_softmax(scores, ~cross_mask.index_select(0, enc_rows)[:, None, None, :])

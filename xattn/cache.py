"""The static cross-attention cache: preallocated self-attention K/V + cross-attention K/V computed once.

Rows of the cache are decoding rows (batch x beams or candidates). Cross-attention K/V are stored once per
*encoder* row and shared by every decoding row that reads that input: beams never copy them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# (keys, values, row_index, valid) -> None: row i of keys/values takes row row_index[i]'s positions [0, valid)
RowCopy = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], None]


@dataclass
class CrossAttentionCache:
    keys: torch.Tensor  # [layers, B, H, T_max, D] self-attention keys, written in place
    values: torch.Tensor  # [layers, B, H, T_max, D]
    cross_keys: torch.Tensor | None  # [layers, B_enc, H, S, D] computed once from the encoder output
    cross_values: torch.Tensor | None  # [layers, B_enc, H, S, D]
    cross_mask: torch.Tensor | None  # [B_enc, S] bool, True where the encoder position is real (not padding)
    # Encoder row read by each decoding row. None means the regular layout: B = B_enc * group and rows
    # r*group .. r*group+group-1 read encoder row r (beams, candidates), which needs no gather at all.
    enc_index: torch.Tensor | None = None
    # [] long: where the next token goes (= tokens written so far). A tensor, so that a compiled step reads it as
    # an input; the cache alone moves it (advance), keeping it equal to the host-side `length`.
    position: torch.Tensor | None = None
    # [B] long: where each row's next token goes, when rows are at different positions (in-flight batching: requests
    # join and leave one decode batch, xattn/inflight.py); a decode step then reads it instead of `position`
    row_positions: torch.Tensor | None = None

    def __post_init__(self):
        if self.position is None:
            self.position = torch.zeros((), dtype=torch.long, device=self.keys.device)
        self._length = int(self.position)  # the same count on the host: read without a device sync

    @property
    def length(self) -> int:
        """Tokens written so far; positions [0, length) are valid."""
        return self._length

    @length.setter
    def length(self, value: int) -> None:
        if not 0 <= value <= self.max_length:
            raise ValueError(f"cache length {value} is outside [0, {self.max_length}]")
        self._length = int(value)
        self.position.fill_(self._length)

    def advance(self, tokens: int = 1) -> None:
        """The positions just written count as valid: every prefill and decode step calls this once."""
        self.length = self._length + tokens

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        batch_size: int,
        num_heads: int,
        max_length: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> CrossAttentionCache:
        # zeros, not empty: masked positions still enter the attention matmul and NaN * 0 is NaN.
        shape = (num_layers, batch_size, num_heads, max_length, head_dim)
        return cls(
            keys=torch.zeros(shape, dtype=dtype, device=device),
            values=torch.zeros(shape, dtype=dtype, device=device),
            cross_keys=None,
            cross_values=None,
            cross_mask=None,
        )

    # ---- shape facts --------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def max_length(self) -> int:
        return self.keys.shape[3]

    @property
    def has_cross(self) -> bool:
        return self.cross_keys is not None

    @property
    def encoder_batch_size(self) -> int:
        return 0 if self.cross_keys is None else self.cross_keys.shape[1]

    @property
    def group_size(self) -> int:
        """Decoding rows per encoder row in the regular layout."""
        return self.batch_size // max(self.encoder_batch_size, 1)

    def set_cross(self, cross_keys: torch.Tensor, cross_values: torch.Tensor, cross_mask: torch.Tensor | None):
        """Store the cross-attention K/V of all layers; called once per encoder output."""
        b_enc = cross_keys.shape[1]
        if self.enc_index is None and self.batch_size % b_enc:
            raise ValueError(
                f"cache has {self.batch_size} rows, which is not a multiple of the {b_enc} encoder rows; "
                "pass enc_index to map rows to encoder rows"
            )
        # contiguous: the fused step reads them as one block (a slice of another cache's is copied here)
        self.cross_keys, self.cross_values = cross_keys.contiguous(), cross_values.contiguous()
        self.cross_mask = None if cross_mask is None else cross_mask.to(torch.bool)

    def set_row_mask(self, row_mask: torch.Tensor) -> None:
        """Give decoding row i the encoder mask row_mask[i] ([B, S]): rows that shared cross K/V keep sharing them
        only where their masks agree as well."""
        expected = (self.batch_size, self.cross_keys.shape[3])
        if tuple(row_mask.shape) != expected:
            raise ValueError(f"encoder_attention_mask has shape {tuple(row_mask.shape)}, expected {expected} "
                             "(one row per cache row, one column per encoder position)")
        rows = self.encoder_rows()
        cross_keys, cross_values = self.cross_keys.index_select(1, rows), self.cross_values.index_select(1, rows)
        self.enc_index = None
        self._set_folded(cross_keys, cross_values, row_mask, dedupe=True)

    # ---- row selection (beams, dropping finished rows) ----------------------------------------------
    def reorder(self, row_index: torch.Tensor, kernel: RowCopy | None = None) -> None:
        """Beam reorder: row i takes the self-attention K/V of row row_index[i], in place.

        row_index must keep every row within its encoder group (as beam search does), so the cross K/V
        and their layout are untouched. kernel: a CPU op doing the same in one call (the decoder's steps may
        have one: GPT2CrossAttentionDecoder.reorder); without it, torch's index ops.
        """
        valid = self.length
        if kernel is not None and self.keys.device.type == "cpu":
            kernel(self.keys, self.values, row_index, valid)
            return
        # layer by layer, rows on dim 0: torch gathers whole row blocks there (over dim 1 of the 5-d tensor it
        # copies element by element, far slower)
        for layer in range(self.num_layers):
            for tensor in (self.keys[layer, :, :, :valid], self.values[layer, :, :, :valid]):
                tensor.copy_(tensor.index_select(0, row_index))

    def select_rows(self, row_index: torch.Tensor) -> CrossAttentionCache:
        """A cache holding only the given rows (any subset, any order); cross K/V are shared, not copied."""
        enc_index = self.encoder_rows()
        return CrossAttentionCache(
            keys=self.keys.index_select(1, row_index),
            values=self.values.index_select(1, row_index),
            cross_keys=self.cross_keys,
            cross_values=self.cross_values,
            cross_mask=self.cross_mask,
            enc_index=None if enc_index is None else enc_index.index_select(0, row_index),
            position=self.position.clone(),
        )

    def rows(self, start: int, stop: int, length: int = 0) -> CrossAttentionCache:
        """Rows [start, stop) as a cache over the same storage (steps and reorders write through), at `length`.
        Each row reads its own encoder row: with one per decoding row, those rows of the cross K/V; else all of
        them, through enc_index."""
        own = self.enc_index is None and self.has_cross and self.encoder_batch_size == self.batch_size
        enc_index = None if own else self.encoder_rows()
        cross = (lambda t: t if t is None else t[:, start:stop]) if own else (lambda t: t)
        return CrossAttentionCache(
            keys=self.keys[:, start:stop], values=self.values[:, start:stop], cross_keys=cross(self.cross_keys),
            cross_values=cross(self.cross_values),
            cross_mask=self.cross_mask[start:stop] if own and self.cross_mask is not None else self.cross_mask,
            enc_index=None if enc_index is None else enc_index[start:stop],
            position=torch.tensor(length, device=self.keys.device),
            row_positions=None if self.row_positions is None else self.row_positions[start:stop],
        )

    def expand(self, group: int) -> CrossAttentionCache:
        """Each row repeated `group` times (N candidates from one prefill); cross K/V stay shared."""
        rows = torch.arange(self.batch_size, device=self.keys.device).repeat_interleave(group)
        expanded = self.select_rows(rows)
        if self.enc_index is None:
            expanded.enc_index = None  # the regular layout stays regular, with a larger group
        return expanded

    def encoder_rows(self) -> torch.Tensor | None:
        """[B] encoder row of each decoding row, or None without cross-attention."""
        if self.enc_index is not None:
            return self.enc_index
        if self.cross_keys is None:
            return None
        return torch.arange(self.encoder_batch_size, device=self.keys.device).repeat_interleave(self.group_size)

    # ---- legacy tuples --------------------------------------------------------------------------------
    def to_legacy(self, cross: bool = False) -> tuple:
        """GPT-2's old past_key_values: per layer (k, v) [B, H, length, D]; with cross=True (k, v, ck, cv)."""
        n = self.length
        if not cross:
            return tuple((self.keys[i, :, :, :n], self.values[i, :, :, :n]) for i in range(self.num_layers))
        if self.cross_keys is None:
            raise ValueError("this cache has no cross-attention K/V; call to_legacy() without cross=True")
        ck, cv = self._cross_per_row()
        return tuple(
            (self.keys[i, :, :, :n], self.values[i, :, :, :n], ck[i], cv[i]) for i in range(self.num_layers)
        )

    @classmethod
    def from_legacy(
        cls,
        past_key_values,
        max_length: int,
        *,
        cross_mask: torch.Tensor | None = None,
        dedupe_cross: bool = True,
    ) -> CrossAttentionCache:
        """Rebuild a cache from per-layer (k, v) or (k, v, cross_k, cross_v) tuples, with room for max_length."""
        layers = list(past_key_values)
        if not layers or len(layers[0]) not in (2, 4):
            raise ValueError("past_key_values must hold one (k, v) or (k, v, cross_k, cross_v) tuple per layer")
        self_kv = [(layer[0], layer[1]) for layer in layers]
        cross_kv = [(layer[2], layer[3]) for layer in layers] if len(layers[0]) == 4 else None
        return cls._from_layers(self_kv, cross_kv, max_length, cross_mask, dedupe_cross)

    # ---- transformers' EncoderDecoderCache ------------------------------------------------------------
    def to_hf(self):
        """A transformers EncoderDecoderCache (DynamicCache inside) holding the same K/V, per decoding row."""
        from transformers import DynamicCache, EncoderDecoderCache

        self_cache, cross_cache = DynamicCache(), DynamicCache()
        n = self.length
        for i in range(self.num_layers):
            # clone: transformers' DynamicCache grows by concatenation and must not alias our buffers
            self_cache.update(self.keys[i, :, :, :n].clone(), self.values[i, :, :, :n].clone(), i)
        if self.cross_keys is not None:
            ck, cv = self._cross_per_row()
            for i in range(self.num_layers):
                cross_cache.update(ck[i].clone(), cv[i].clone(), i)
        return EncoderDecoderCache(self_cache, cross_cache)

    @classmethod
    def from_hf(
        cls,
        cache,
        max_length: int,
        *,
        cross_mask: torch.Tensor | None = None,
        dedupe_cross: bool = True,
    ) -> CrossAttentionCache:
        """Rebuild from a transformers EncoderDecoderCache or a self-attention cache (Dynamic, Static, sliding
        window). Each layer holds its get_seq_length() positions: a StaticCache's buffer is longer, zeros past them."""
        self_cache = getattr(cache, "self_attention_cache", cache)
        cross_cache = getattr(cache, "cross_attention_cache", None)
        self_kv = _held_positions(self_cache)
        cross_kv = _held_positions(cross_cache) if cross_cache is not None else []
        if not self_kv:
            raise ValueError("the given cache is empty: pass a filled cache, or none")
        return cls._from_layers(self_kv, cross_kv or None, max_length, cross_mask, dedupe_cross)

    # ---- helpers ----------------------------------------------------------------------------------------
    def _cross_per_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Cross K/V laid out per decoding row, [layers, B, H, S, D] (a copy; only for interop)."""
        rows = self.encoder_rows()
        dtype = self.keys.dtype  # some formats keep them narrower (DecoderSteps.cross_kv_dtype): the model's here
        return self.cross_keys.index_select(1, rows).to(dtype), self.cross_values.index_select(1, rows).to(dtype)

    @classmethod
    def _from_layers(cls, self_kv, cross_kv, max_length, cross_mask, dedupe_cross) -> CrossAttentionCache:
        k0 = self_kv[0][0]
        batch, heads, length, head_dim = k0.shape
        if length > max_length:
            raise ValueError(f"the given cache holds {length} positions, more than max_length={max_length}")
        cache = cls.allocate(
            len(self_kv), batch, heads, max_length, head_dim, dtype=k0.dtype, device=k0.device
        )
        for i, (k, v) in enumerate(self_kv):
            cache.keys[i, :, :, :length] = k
            cache.values[i, :, :, :length] = v
        cache.advance(length)
        if cross_kv is not None:
            ck = torch.stack([k for k, _ in cross_kv])  # [layers, B, H, S, D]
            cv = torch.stack([v for _, v in cross_kv])
            if cross_mask is not None and cross_mask.shape[0] != batch and batch % cross_mask.shape[0] == 0:
                cross_mask = cross_mask.repeat_interleave(batch // cross_mask.shape[0], dim=0)  # one per row
            cache._set_folded(ck, cv, cross_mask, dedupe_cross)
        return cache

    def _set_folded(self, cross_keys, cross_values, row_mask, dedupe: bool) -> None:
        """set_cross from per-row cross K/V [layers, B, H, S, D] and mask [B, S], keeping one copy per run of rows
        whose K/V and mask are identical (transformers keeps one copy per beam)."""
        group = _repeated_group(cross_keys, cross_values, row_mask) if dedupe else 1
        row_mask = None if row_mask is None else row_mask[::group]
        self.set_cross(cross_keys[:, ::group].contiguous(), cross_values[:, ::group].contiguous(), row_mask)


def _held_positions(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (keys, values) [B, H, length, D] of a transformers cache, length = its get_seq_length(); [] when
    it holds nothing."""
    lengths = [int(cache.get_seq_length(i)) for i in range(len(cache.layers))]
    if not any(lengths):
        return []
    if len(set(lengths)) > 1:
        raise ValueError(f"the given cache's layers hold different numbers of positions: {lengths}")
    pairs = []
    for layer, length in zip(cache.layers, lengths):
        stored = 0 if layer.keys is None or layer.keys.dim() != 4 else layer.keys.shape[2]
        if stored < length:
            raise ValueError(f"the given {type(cache).__name__} holds {length} positions but keeps only {stored} "
                             "of them (a sliding window or a quantized cache); pass a cache that keeps every "
                             "position (DynamicCache, StaticCache)")
        pairs.append((layer.keys[:, :, :length], layer.values[:, :, :length]))
    return pairs


def _repeated_group(cross_keys: torch.Tensor, cross_values: torch.Tensor, row_mask: torch.Tensor | None) -> int:
    """Largest g such that consecutive runs of g rows hold identical cross K/V and masks (the per-beam copies)."""
    batch = cross_keys.shape[1]
    for group in range(batch, 1, -1):
        if batch % group:
            continue
        runs = [(cross_keys, 1), (cross_values, 1)] + ([] if row_mask is None else [(row_mask, 0)])
        if all(_runs_repeat(tensor.unflatten(dim, (batch // group, group)), dim + 1) for tensor, dim in runs):
            return group
    return 1


def _runs_repeat(blocks: torch.Tensor, dim: int) -> bool:
    return torch.equal(blocks, blocks.narrow(dim, 0, 1).expand_as(blocks))

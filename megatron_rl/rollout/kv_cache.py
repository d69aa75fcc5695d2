"""A preallocated KV cache for the embedded engine's decode loop.

``transformers``' ``DynamicLayer`` appends with ``torch.cat``, copying the whole
cache of every layer at every step (quadratic traffic in the response length).
The engine knows the longest sequence a chunk can reach (prompt width +
``max_new_tokens``), so ``PreallocatedLayer`` allocates that once and writes
each step's keys/values in place, returning views of the filled prefix. It
keeps ``DynamicLayer``'s contract (shape ``[batch, kv_heads, seq, head_dim]``,
``batch_select_indices`` for dropping finished rows and fanning prompts out
to samples), so the model code sees an ordinary cache.
"""

from __future__ import annotations

import types

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """One layer's K/V in a fixed-capacity buffer; ``length`` positions are filled."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, dim = key_states.shape
        self._k = key_states.new_empty(batch, heads, self.capacity, dim)
        self._v = value_states.new_empty(batch, value_states.shape[1], self.capacity, value_states.shape[-1])
        self.device = key_states.device
        self.is_initialized = True

    def _buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._k is not None and self._v is not None, "lazy_initialization allocates both buffers"
        return self._k, self._v

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if end > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded ({end} positions); the engine sized it "
                               "from prompt width + max_new_tokens")
        k, v = self._buffers()
        k[:, :, self.length:end] = key_states
        v[:, :, self.length:end] = value_states
        self.length = end
        self.keys, self.values = k[:, :, :end], v[:, :, :end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (a speculative draft's chain steps, rollout/speculative.py)."""
        if self.is_initialized and length < self.length:
            k, v = self._buffers()
            self.length = length
            self.keys, self.values = k[:, :, :length], v[:, :, :length]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            k, v = self._buffers()
            self._k, self._v = k[indices], v[indices]
            self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]

    def select(self, indices: torch.Tensor, lead: int = 0) -> None:
        """Keep the rows ``indices`` names and drop the ``lead`` leftmost positions (padding every kept row has
        there): one copy of what stays, the capacity left to fill unchanged."""
        if self.is_initialized:
            k, v = self._buffers()
            self._k, self._v = k[indices, :, lead:], v[indices, :, lead:]
            self.capacity -= lead
            self.length -= lead
            self.keys, self.values = self._k[:, :, :self.length], self._v[:, :, :self.length]

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            k, _ = self._buffers()
            self.batch_select_indices(torch.arange(k.shape[0], device=k.device).repeat_interleave(repeats))


def _select_rows(layer, indices: torch.Tensor) -> None:
    layer.reorder_cache(indices)  # transformers' own row gather of the conv and recurrent states


def _repeat_rows(layer, repeats: int) -> None:
    states = [s for s in (*layer.conv_states.values(), *layer.recurrent_states.values()) if isinstance(s, torch.Tensor)]
    if states:
        _select_rows(layer, torch.arange(states[0].shape[0], device=states[0].device).repeat_interleave(repeats))


def _with_row_select(layer):
    """transformers' linear-attention cache layers (Qwen3-Next's gated delta-net conv and recurrent states)
    have ``reorder_cache`` but not the ``batch_select_indices`` / ``batch_repeat_interleave`` the engine
    calls through ``DynamicCache``: give the layer both, as the same row gather along the batch dim."""
    from transformers.cache_utils import LinearAttentionCacheLayerMixin  # lazy: transformers 5's hybrid caches

    if isinstance(layer, LinearAttentionCacheLayerMixin) and not isinstance(layer, DynamicLayer):
        layer.batch_select_indices = types.MethodType(_select_rows, layer)
        layer.batch_repeat_interleave = types.MethodType(_repeat_rows, layer)
    return layer


def make_kv_cache(config, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` whose full-attention layers are preallocated to ``capacity`` positions.

    Models with other layer kinds (sliding window, linear attention) keep
    ``transformers``' own layers, which stay correct, just slower; linear-attention layers get
    the row selection the engine uses (:func:`_with_row_select`).
    """
    cache = DynamicCache(config=config)
    if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
    cache.layers = [_with_row_select(layer) for layer in cache.layers]
    return cache


def joinable(cache: DynamicCache) -> bool:
    """Whether rows of this cache can be merged with another's (``merge_kv_caches``): every layer full
    attention (preallocated). A sliding-window or linear-attention layer keeps state that left-padding would
    not shift, so those models batch statically instead."""
    return bool(cache.layers) and all(isinstance(layer, PreallocatedLayer) for layer in cache.layers)


def compact_kv_cache(cache: DynamicCache, rows: torch.Tensor, lead: int = 0) -> None:
    """Keep the ``rows`` of a ``joinable()`` cache and drop its ``lead`` leftmost positions, padding in every
    kept row (``PreallocatedLayer.select``).

    Why the columns too: a continuous batch that never drains (rows keep joining before the last ones end,
    as under asynchronous RL) would otherwise keep every position it ever had, left padding for the rows
    that joined late, and each decode step attends over all of them: its cost grows with the batch's age
    instead of with its longest live row."""
    for layer in cache.layers:
        assert isinstance(layer, PreallocatedLayer), "compact only joinable() caches"
        layer.select(rows, lead)


def merge_kv_caches(config, parts: list[tuple[DynamicCache, torch.Tensor, int]], width: int,
                    capacity: int) -> DynamicCache:
    """One preallocated cache of ``capacity`` positions holding the rows ``parts`` name (each a cache, the
    indices of its rows to keep, in order, and how many of its leftmost positions to drop: padding in each of
    those rows), every part's filled positions right-aligned at ``width`` (the positions on the left are
    zeros, which the attention mask hides: left padding, as a prefill's)."""
    merged = make_kv_cache(config, capacity)
    for li, layer in enumerate(merged.layers):
        assert isinstance(layer, PreallocatedLayer), "merge only joinable() caches"
        keys, values = [], []
        for cache, rows, lead in parts:
            src = cache.layers[li]
            assert isinstance(src, PreallocatedLayer) and src.keys is not None and src.values is not None, \
                "merge only joinable(), filled caches"
            k, v = src.keys[rows, :, lead:], src.values[rows, :, lead:]
            pad = width - k.shape[-2]
            if pad:
                k = torch.nn.functional.pad(k, (0, 0, pad, 0))
                v = torch.nn.functional.pad(v, (0, 0, pad, 0))
            keys.append(k)
            values.append(v)
        layer.update(torch.cat(keys), torch.cat(values))
    return merged

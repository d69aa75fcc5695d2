"""The embedded engine's speculative draft: the checkpoint's own multi-token-prediction (MTP / NEXTN) layers.

transformers builds no MTP module (it skips a DeepSeek-V3 / GLM-4.5 checkpoint's ``model.layers.{N}.*``,
N = ``num_hidden_layers``), so the engine builds one here from transformers' own pieces: the family's decoder
layer class (layer index N, so a MoE family gets its MoE MLP), its RMSNorm for ``enorm`` / ``hnorm`` /
``shared_head.norm``, and a bias-free ``eh_proj``. Parameter names, relative to :class:`MtpDraft`, are the
checkpoint's (``model.layers.{N}.eh_proj.weight``, ``model.layers.{N}.self_attn.q_proj.weight``, ...), so the
engine's ``HFParamMap`` loads them from the checkpoint and takes them in a weight sync by the names the
trainer's bridge exports (``--mtp-num-layers``). The MTP copies of the embedding and output head
(``embed_tokens``, ``shared_head.head``) are not held twice: they alias the main model's, which the trainer's
bridge also requires them to equal.

The recurrence is megatron-core's ``MultiTokenPredictionLayer`` (what ``--enable-mtp-training`` trains,
``models/mtp.py``) and SGLang's NEXTN draft: at position t, from the hidden state ``h_t`` and the token
``x_{t+1}``::

    out_t  = shared_head.norm(decoder_layer(eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))))
    logits = head(out_t)                      # scores token t + 2

``h_t`` is the target model's last hidden state (after its final norm) for positions the target has seen;
for the next draft step of a chain it is the draft's own ``out`` one position earlier (SGLang's EAGLE chain
with a NEXTN head: depth 0's layer run again). The draft attends over its own KV cache of earlier positions,
one cache per draft layer.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator

import torch

from megatron_rl.errors import ConfigError
from megatron_rl.rollout.hf_layout import DRAFT_PREFIX

DRAFT_MODULE = DRAFT_PREFIX[:-1]  # the draft's attribute on the engine's HF model (its names: the checkpoint's)


def mtp_depths(config) -> int:
    """How many MTP layers a checkpoint's config declares (``num_nextn_predict_layers``; 0: none)."""
    return int(getattr(config.get_text_config(), "num_nextn_predict_layers", 0) or 0)


class MtpDraft(torch.nn.Module):
    """The checkpoint's MTP layers as one draft module; :meth:`forward` runs MTP layer 0 (NEXTN)."""

    def __init__(self, target: Any):
        super().__init__()
        cfg = target.config.get_text_config()
        depths = mtp_depths(target.config)
        base = getattr(target, "model", None)
        if not depths or base is None or not hasattr(base, "layers") or not hasattr(base, "norm"):
            raise ConfigError(f"--speculative-algorithm: {cfg.model_type} checkpoint has no MTP layers "
                              f"(config.json num_nextn_predict_layers={depths}); the draft is the model's own MTP "
                              "head (DeepSeek-V3, GLM-4.5 checkpoints): drop --speculative-algorithm")
        self.first = int(cfg.num_hidden_layers)  # the first MTP layer's checkpoint index
        layer_cfg = copy.deepcopy(cfg)
        layer_cfg.num_hidden_layers = self.first + depths  # layer index N must be a valid decoder layer
        layer_class, norm_class = type(base.layers[-1]), type(base.norm)
        hidden, eps = int(cfg.hidden_size), float(cfg.rms_norm_eps)
        self.model: Any = torch.nn.Module()  # ``model.layers.{N}``: the checkpoint's names below the draft
        self.model.layers = torch.nn.ModuleDict()
        for d in range(depths):
            layer = layer_class(layer_cfg, self.first + d)
            layer.self_attn.layer_idx = 0  # each draft layer has a one-layer KV cache of its own
            layer.enorm = norm_class(hidden, eps=eps)
            layer.hnorm = norm_class(hidden, eps=eps)
            layer.eh_proj = torch.nn.Linear(2 * hidden, hidden, bias=False)
            layer.shared_head = torch.nn.Module()
            layer.shared_head.norm = norm_class(hidden, eps=eps)
            self.model.layers[str(self.first + d)] = layer
        self.config = cfg

    def shared_names(self) -> dict[str, str]:
        """MTP checkpoint name -> the main model's tensor it equals (the MTP copies of embedding and head)."""
        names = {}
        for key in self.model.layers:
            names[f"model.layers.{key}.embed_tokens.weight"] = "model.embed_tokens.weight"
            names[f"model.layers.{key}.shared_head.head.weight"] = "lm_head.weight"
        return names

    def new_cache(self, capacity: int):
        """An empty KV cache of the draft layer, ``capacity`` positions preallocated."""
        from transformers import DynamicCache

        from megatron_rl.rollout.kv_cache import PreallocatedLayer  # lazy: kv_cache imports transformers

        cache = DynamicCache()
        cache.layers = [PreallocatedLayer(capacity)]
        return cache

    def forward(self, hidden: torch.Tensor, next_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor, cache: Any, target: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the draft over ``[b, s]`` positions: ``(out [b, s, H], logits [b, s, V])``.

        ``hidden`` [b, s, H]: ``h_t``; ``next_ids`` [b, s]: ``x_{t+1}``; ``attention_mask`` [b, cached + s]
        (left padding and holes 0, as the target's); ``cache``: the draft's KV cache (None: no cache, the
        positions given are the whole sequence, as when fitting the draft); ``target``: the HF model whose
        embedding, head and RoPE the draft shares."""
        from transformers.masking_utils import create_causal_mask

        layer: Any = self.model.layers[str(self.first)]
        embedded = target.get_input_embeddings()(next_ids)
        x = layer.eh_proj(torch.cat([layer.enorm(embedded), layer.hnorm(hidden.to(embedded.dtype))], dim=-1))
        mask = create_causal_mask(config=self.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                                  position_ids=position_ids)
        rotary = target.model.rotary_emb(x, position_ids)
        out = layer(x, position_embeddings=rotary, attention_mask=mask, position_ids=position_ids, cache=cache,
                    use_cache=cache is not None)
        out = layer.shared_head.norm(out[0] if isinstance(out, tuple) else out)
        return out, target.get_output_embeddings()(out)


@contextlib.contextmanager
def final_hidden_states(target: Any) -> Iterator[list[torch.Tensor]]:
    """Collect the target's last hidden state (its final norm's output, ``[b, s, H]``) of each forward inside."""
    got: list[torch.Tensor] = []
    handle = target.model.norm.register_forward_hook(lambda _m, _i, out: got.append(out))
    try:
        yield got
    finally:
        handle.remove()

"""Reference multi-token-prediction logits of a DeepSeek-V3 / GLM-4.5 checkpoint, built from transformers'
own modules (transformers has no MTP forward; this follows the DeepSeek-V3 report and SGLang's
``deepseek_nextn``): for MTP depth 0 at position t,

    h'  = eh_proj(cat(enorm(embed(x_{t+1})), hnorm(h_t)))     h_t: the HF model's last hidden state (after its norm)
    h'' = the MTP layer's decoder layer (HF's own DeepseekV3DecoderLayer / Glm4MoeDecoderLayer, its weights
          loaded by transformers from the checkpoint's ``model.layers.{num_hidden_layers}.*``) on h'
    logits = shared_head.head(shared_head.norm(h''))

Positions 0 .. L-2 are defined (the last has no next token).
"""

from __future__ import annotations

import json
import os
import tempfile

import torch


class MtpReference:
    """The HF main model plus the checkpoint's first MTP layer, as transformers' modules."""

    def __init__(self, hf_dir: str):
        import transformers
        from safetensors import safe_open

        from megatron_rl.models.hf_module import hf_config
        from megatron_rl.models.parity import load_hf_model

        self.main = load_hf_model(hf_dir)
        cfg = hf_config(hf_dir)
        self.mtp_layer = cfg.num_hidden_layers  # depth 0
        with tempfile.TemporaryDirectory() as tmp:  # the same files, config.json one layer longer
            with open(os.path.join(hf_dir, "config.json")) as f:
                raw = json.load(f)
            raw["num_hidden_layers"] = self.mtp_layer + 1
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(raw, f)
            for name in os.listdir(hf_dir):
                if name.endswith(".safetensors") or name.endswith(".index.json"):
                    os.symlink(os.path.join(hf_dir, name), os.path.join(tmp, name))
            longer = transformers.AutoModelForCausalLM.from_pretrained(tmp, config=hf_config(tmp),
                                                                       dtype=torch.float32).eval()
        # run only the MTP decoder layer through HF's own model plumbing (mask, RoPE), no final norm
        body = longer.model
        body.layers = torch.nn.ModuleList([body.layers[self.mtp_layer]])
        body.norm = torch.nn.Identity()
        body.config.num_hidden_layers = 1
        self.body = body
        p = f"model.layers.{self.mtp_layer}."
        files = [os.path.join(hf_dir, n) for n in os.listdir(hf_dir) if n.endswith(".safetensors")]
        tensors = {}
        for path in files:
            with safe_open(path, "pt") as f:
                tensors.update({k[len(p):]: f.get_tensor(k) for k in f.keys() if k.startswith(p)})
        norm_class, eps = type(self.main.model.norm), cfg.rms_norm_eps
        hidden = cfg.hidden_size

        def norm(weight):
            module = norm_class(hidden, eps=eps)
            module.weight.data.copy_(weight)
            return module.eval()

        self.enorm, self.hnorm = norm(tensors["enorm.weight"]), norm(tensors["hnorm.weight"])
        self.head_norm = norm(tensors["shared_head.norm.weight"])
        self.eh_proj = torch.nn.Parameter(tensors["eh_proj.weight"])
        self.head = tensors["shared_head.head.weight"]
        self.embed = tensors["embed_tokens.weight"]

    @torch.no_grad()
    def logits(self, seq: torch.Tensor) -> torch.Tensor:
        """Depth-0 MTP logits ``[L - 1, V]`` of one sequence (position t scores token t + 2)."""
        ids = seq[None]
        h = self.main.model(ids).last_hidden_state[:, :-1]
        e = torch.nn.functional.embedding(ids[:, 1:], self.embed)
        x = torch.nn.functional.linear(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1), self.eh_proj)
        out = self.body(inputs_embeds=x, position_ids=torch.arange(x.shape[1])[None], use_cache=False).last_hidden_state
        return torch.nn.functional.linear(self.head_norm(out), self.head)[0].float()

    def loss(self, seq: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Depth 0's MTP loss of one sequence, as --enable-mtp-training trains it: position t scores token t + 2
        with the main loss's weight of that token (``weights[t + 1]``); the main model's hidden states, the
        embedding and the head are constants, so only the MTP layer's parameters get its gradient."""
        ids = seq[None]
        with torch.no_grad():
            h = self.main.model(ids).last_hidden_state[:, :-1]
        e = torch.nn.functional.embedding(ids[:, 1:], self.embed)
        x = torch.nn.functional.linear(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1), self.eh_proj)
        out = self.body(inputs_embeds=x, position_ids=torch.arange(x.shape[1])[None], use_cache=False).last_hidden_state
        logp = torch.log_softmax(torch.nn.functional.linear(self.head_norm(out), self.head)[0, :-1].float(), -1)
        return -(logp.gather(-1, seq[2:, None])[:, 0] * weights[1:-1]).sum()

    def zero_grad(self) -> None:
        for p in self.parameters().values():
            p.grad = None

    def parameters(self) -> dict[str, torch.nn.Parameter]:
        """The MTP layer's trainable tensors under the names of transformers' modules (``model.layers.{N}.*``)."""
        p = f"model.layers.{self.mtp_layer}."
        out = {p + "eh_proj.weight": self.eh_proj, p + "enorm.weight": self.enorm.weight,
               p + "hnorm.weight": self.hnorm.weight, p + "shared_head.norm.weight": self.head_norm.weight}
        out.update({p + n: t for n, t in self.body.layers[0].named_parameters()})
        return out

    def grads(self) -> dict[str, torch.Tensor]:
        """The gradients of :meth:`parameters` under the checkpoint's names (one tensor per expert)."""
        from megatron_rl.models.hf_module import hf_checkpoint_names

        return hf_checkpoint_names(self.main, {n: (p.grad if p.grad is not None else torch.zeros_like(p))
                                               for n, p in self.parameters().items()})

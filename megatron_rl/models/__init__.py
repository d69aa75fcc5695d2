"""HF <-> megatron-core bridges (config mapping, layer spec, weight load/export).

Entry point: :func:`get_bridge`. See :mod:`megatron_rl.models.bridge` for the
Bridge API and :mod:`megatron_rl.models.weights` for streaming load/export.
Importing this package does not import megatron-core (hf_tiny stays cheap).
"""

from __future__ import annotations

from megatron_rl.errors import BridgeError


#: multimodal model_type -> the model_type of its text model (which has a bridge)
MULTIMODAL_WRAPPERS = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def get_bridge(hf_dir_or_config, mtp_num_layers: int = 0):
    """Return the Bridge for an HF checkpoint dir, ``config.json`` path, dict or config object.

    ``mtp_num_layers``: build megatron's multi-token-prediction block for the checkpoint's MTP layers
    (0, or exactly config.json's ``num_nextn_predict_layers``). Raises BridgeError for an unknown
    ``model_type``, an unsupported config feature or another MTP count.
    """
    from megatron_rl.models.bridge import read_hf_config  # lazy: imports torch; the package import stays cheap
    from megatron_rl.models.families import BRIDGES_BY_MODEL_TYPE  # lazy: imports torch (via bridge)

    config = read_hf_config(hf_dir_or_config)
    model_type = config.get("model_type")
    if model_type in MULTIMODAL_WRAPPERS:
        raise BridgeError(f"model_type={model_type!r} is a multimodal checkpoint (a text_config, vision weights "
                          "under model.visual.*, the text model under model.language_model.*); megatron_rl trains "
                          "the text model only: write it out with transformers, text = AutoModelForCausalLM."
                          "from_pretrained(dir); plain = type(text)(text.config); "
                          "plain.load_state_dict(text.state_dict()); plain.save_pretrained(text_dir) (model_type "
                          f"{MULTIMODAL_WRAPPERS[model_type]!r}, names model.*, vision weights left out; a model "
                          "saved straight after loading keeps the model.language_model.* names), and pass text_dir")
    if model_type not in BRIDGES_BY_MODEL_TYPE:
        raise BridgeError(f"no bridge for HF model_type={model_type!r}; supported: "
                          f"{', '.join(sorted(BRIDGES_BY_MODEL_TYPE))}")
    return BRIDGES_BY_MODEL_TYPE[model_type](config, mtp_num_layers=mtp_num_layers)


__all__ = ["get_bridge"]

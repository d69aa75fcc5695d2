import json
import os

import pytest
import torch


def test_tiny_model_each_family_loads_back(tiny_hf_models, family):
    import transformers

    path = tiny_hf_models(family)
    assert os.path.exists(os.path.join(path, "config.json"))
    assert any(f.endswith(".safetensors") for f in os.listdir(path))
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["model_type"] == family
    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 250)
    assert logits.std() > 0.05  # wide init: logits are not near-constant


def test_unknown_family_is_refused():
    from megatron_rl.models.hf_tiny import tiny_config

    with pytest.raises(ValueError, match="unknown tiny model family 'gpt9'"):
        tiny_config("gpt9")

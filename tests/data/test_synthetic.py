import json

import torch

from megatron_rl.data import synthetic


def test_score_positions():
    assert synthetic.score("4 2 5 2 <eos>", "4 2 5 2") == 1.0
    assert synthetic.score("4 2 0 2", "4 2 5 2") == 0.75
    assert synthetic.score("4 2", "4 2 5 2") == 0.5
    assert synthetic.score("4 2 5 2 7 7", "4 2 5 2") == 4 / 6
    assert synthetic.score("4252<eos>", "4 2 5 2") == 1.0
    assert synthetic.score("4252=", "4 2 5 2") == 0.8  # a non-digit filler token is a wrong position
    assert synthetic.score("", "4 2 5 2") == 0.0


def test_tokenizer_and_model_round_trip(tmp_path):
    import transformers

    path = synthetic.build_demo_model(str(tmp_path / "m"))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = tok("3 1 4 1 =", add_special_tokens=False)["input_ids"]
    assert ids == [synthetic.VOCAB.index(t) for t in ["3", "1", "4", "1", "="]]
    assert tok.decode(ids).replace(" ", "") == "3141="  # spacing depends on the tokenizer class
    assert tok.eos_token_id == synthetic.VOCAB.index("<eos>")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.config.tie_word_embeddings
    assert model(torch.tensor([ids])).logits.shape == (1, 5, synthetic.VOCAB_SIZE)


def test_prompt_file(tmp_path):
    p = synthetic.write_prompt_file(str(tmp_path / "p.jsonl"), n=5, num_digits=3, seed=1)
    rows = [json.loads(line) for line in open(p)]
    assert len(rows) == 5
    for r in rows:
        digits = r["prompt"].split()[:-1]
        assert r["prompt"].endswith(" =") and len(digits) == 3
        assert r["label"].split() == [str((int(d) + 1) % 10) for d in digits]


def test_moe_demo_model_and_a_run_dir_keeps_its_family(tmp_path):
    import pytest
    import transformers

    paths = synthetic.prepare(str(tmp_path), num_prompts=4, num_eval=2, family="qwen3_moe")
    model = transformers.AutoModelForCausalLM.from_pretrained(paths["model"])
    assert model.config.model_type == "qwen3_moe" and model.config.num_experts == 8
    assert model(torch.tensor([[4, 5, 3]])).logits.shape == (1, 3, synthetic.VOCAB_SIZE)
    assert synthetic.prepare(str(tmp_path), family="qwen3_moe") == paths  # kept: a resumed run's own model
    with pytest.raises(SystemExit, match="holds a qwen3_moe demo model, not qwen2"):
        synthetic.prepare(str(tmp_path), family="qwen2")


def test_deepseek_demo_model_is_one_the_bridge_maps_exactly(tmp_path):
    import transformers

    from megatron_rl.models import get_bridge

    path = synthetic.build_demo_model(str(tmp_path / "m"), family="deepseek_v3")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "deepseek_v3" and model.config.q_lora_rank == 32
    assert model(torch.tensor([[4, 5, 3]])).logits.shape == (1, 3, synthetic.VOCAB_SIZE)
    assert get_bridge(path).unsupported() == []  # MLA, dense first layer, shared expert, sigmoid router


def test_qwen3_next_demo_model_is_one_the_bridge_maps_exactly(tmp_path):
    import transformers

    from megatron_rl.models import get_bridge

    path = synthetic.build_demo_model(str(tmp_path / "m"), family="qwen3_next")
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen3_next" and model.config.layer_types == ["linear_attention",
                                                                                    "full_attention"]
    assert model(torch.tensor([[4, 5, 3]])).logits.shape == (1, 3, synthetic.VOCAB_SIZE)
    assert get_bridge(path).unsupported() == []  # gated delta-net, gated attention, gated shared expert

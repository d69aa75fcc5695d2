"""prompts -> embedded engine -> rewards, with a real tokenizer saved beside the model."""

import json
from dataclasses import replace

from _tokenizer import build_char_tokenizer  # tests/ is on sys.path (conftest)

from megatron_rl.data.prompts import PromptDataset, PromptIterator
from megatron_rl.models.hf_tiny import build_tiny_hf_model
from megatron_rl.rollout import SamplingParams, make_engine
from megatron_rl.rollout.rewards import compute_rewards, get_reward_fn, math_reward


def test_prompt_batch_to_scored_samples(tmp_path):
    model_dir = build_tiny_hf_model("qwen2", tmp_path / "model")
    tokenizer = build_char_tokenizer(model_dir)  # saved into the model dir, as a hub checkpoint has it
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "label": str(a + b)}) + "\n"
                            for a, b in [(1, 2), (3, 4), (5, 6)]))
    batch = next(PromptIterator(PromptDataset(data, tokenizer=tokenizer, apply_chat_template=True),
                                rollout_batch_size=2, n_samples_per_prompt=3))
    engine = make_engine("embedded", hf_checkpoint=str(model_dir))
    assert engine.eos_token_ids == [tokenizer.eos_token_id]  # from the tokenizer found beside the model

    sampling = replace(SamplingParams(temperature=1.0, max_new_tokens=8, seed=0), n=batch.n_samples_per_prompt)
    samples = engine.generate(batch.requests, sampling)
    assert [s.group_index for s in samples] == [0, 0, 0, 1, 1, 1]
    assert [s.label for s in samples] == ["3"] * 3 + ["7"] * 3
    assert samples[0].prompt_text == "<|user|>1+2=\n<|assistant|>"
    for s in samples:
        assert s.response_text == tokenizer.decode(s.response_ids, skip_special_tokens=True)
        assert s.finish_reason == ("stop" if s.response_ids[-1] == tokenizer.eos_token_id else "length")
    # give one sample the right answer to see the reward move
    samples[4].response_text = "so it is 7"
    rewards = compute_rewards(samples, get_reward_fn("math"))
    assert rewards == [math_reward(s) for s in samples] and rewards[4] == 1.0
    assert [s.reward for s in samples] == rewards

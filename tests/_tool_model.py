"""A tiny HF model that calls the calculator: the tool-loop tests' real policy.

A random tiny model never writes a ``<tool_call>`` block, so a loop through a real engine would never see
a tool turn. This builds the char tokenizer (``_tokenizer.py``, chat template included) and a 2-layer Qwen2
that memorised one conversation by a few hundred Adam steps (a few seconds on a CPU core): for ``PROMPT`` it writes
``CALL``, and after the calculator's tool turn, the answer and ``<eos>``. It never saw ``</tool_call>`` as
one token (the char tokenizer spells it), so the loop cuts its first turn after that tag (the model goes on
writing the tool turn it memorised; those tokens are dropped).
"""

from __future__ import annotations

import json

A, B = 12345, 6789
EXPRESSION = f"{A}*{B}"
ANSWER = str(A * B)
QUESTION = f"What is {EXPRESSION}?"
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>' % EXPRESSION


def build_tool_model(path, steps: int = 150, seed: int = 0):
    """``(model_dir, tokenizer, prompt_ids, target_ids)``: the model memorised prompt + target, where
    target = CALL + the tool turn of the calculator's answer (as the loop frames it) + ANSWER + <eos>."""
    import torch
    import transformers

    from _tokenizer import build_char_tokenizer
    from megatron_rl.rollout.agent.framing import tool_turn_text

    config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="float32")
    config.save_pretrained(str(path))  # first: the tokenizer is then loaded as the engine will load it (by model type)
    tokenizer = build_char_tokenizer(path)
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    text = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=False,
                                         add_generation_prompt=True)
    prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])  # as --apply-chat-template does
    target_text = CALL + tool_turn_text(tokenizer, [ANSWER]) + ANSWER
    target_ids = tokenizer.encode(target_text, add_special_tokens=False) + [tokenizer.eos_token_id]
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = torch.tensor([prompt_ids + target_ids])
    labels = ids.clone()
    labels[0, :len(prompt_ids)] = -100
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains several times faster on one thread than on two
    try:
        for _ in range(steps):
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 0.01, f"the tool model did not memorise its conversation (loss {loss.item():.3f})"
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path), tokenizer, prompt_ids, target_ids


def write_prompts(path, count: int) -> None:
    """``count`` lines of the memorised question (labelled with its answer) for --prompt-data."""
    path.write_text("".join(json.dumps({"prompt": QUESTION, "label": ANSWER}) + "\n" for _ in range(count)))

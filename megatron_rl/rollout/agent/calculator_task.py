"""The CPU agent demo's task: add two 6-digit numbers, where the calculator is the only way to the answer.

Prompt ``782915+730466=``; label ``1513381``. The reward is 1 for exactly the right final answer (the text
after the last tool response) and 0 otherwise, nothing for calling the tool. A tiny model cannot do 6-digit
addition in its head, so its way to reward is to copy the two numbers into a ``calculator`` call, wait for
the tool turn, and copy the result into its answer: two model turns around one tool call.

Why it learns on two CPU cores in about a minute (scripts/run_agent_demo_cpu.sh, docs/agentic.md):

* **A vocabulary where a tool call is five tokens plus the expression.** ``build_tokenizer`` has one token
  per character and the tool syntax as whole (non-special) tokens: ``<tool_call>``,
  ``{"name": "calculator", "arguments": {"expression": "``, ``"}}``, ``</tool_call>`` and the tool turn's
  ``<tool_response>`` / ``</tool_response>``. Decoded, a call is the exact Qwen/Hermes text the tool loop
  parses, and ``</tool_call>`` being one token makes it a stop token of the turn, as with Qwen. In a
  real tokenizer's ~20 tokens of JSON a random-init model never writes a call by chance.
* **Fixed lengths**: both operands from 500000 up, so every sum has 7 digits and each number is copied at
  a fixed offset, which a 2-layer model learns in a few hundred steps.
* **A few seconds of supervised warm start** (``warm_start``), standing in for what pretraining gives a
  real model: it knows the call format but not when a call pays. A ``TOOL_FRACTION`` of its conversations
  call the calculator and copy its result; the rest start answering at once, and only that first token is
  trained (the sum's digits are not learnable in seconds and their loss drowns the copying: trained on
  them too, some seeds had not learnt to copy after 600 steps). So the warm-started policy calls the tool
  in about a quarter of its samples and answers the rest with digits it never learnt; GRPO, rewarded only
  for right answers, raises the tool-call rate to ~1 and the reward with it.

The observation tokens the warm start trains around are the tool loop's own framing
(``framing.FALLBACK_OPEN`` / ``FALLBACK_CLOSE``: the tokenizer has no chat template) around the
calculator's own result, each piece tokenised alone, so a warm-start sequence is token for token what the
loop builds at rollout time.
"""

from __future__ import annotations

import json
import os
import random
import string
from typing import Any, Optional

from megatron_rl.rollout.agent.framing import FALLBACK_CLOSE, FALLBACK_OPEN
from megatron_rl.rollout.agent.parse import TOOL_CALL_END, TOOL_CALL_START
from megatron_rl.rollout.agent.tools import calculator

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CALL_HEAD = '{"name": "calculator", "arguments": {"expression": "'
CALL_TAIL = '"}}'
RESPONSE_START, RESPONSE_END = FALLBACK_OPEN.strip(), FALLBACK_CLOSE.strip()
#: the tool syntax as whole tokens (module docstring); plain characters spell everything else
TOOL_TOKENS = [TOOL_CALL_START, CALL_HEAD, CALL_TAIL, TOOL_CALL_END, RESPONSE_START, RESPONSE_END]
#: one token per printable character: digits and operators for the task, letters for ``error:`` observations
CHARS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]


def _byte_symbol(char: str) -> str:
    """The byte-level BPE symbol of an ASCII character (GPT-2's ``bytes_to_unicode``: printable characters
    stand for themselves, the bytes below ``!`` for ``chr(256 + byte)``, e.g. space -> ``Ġ``, newline -> ``Ċ``)."""
    byte = ord(char)
    return char if 33 <= byte <= 126 else chr(256 + byte)


#: the tokenizer's tokens in id order (characters as their byte-level symbols)
VOCAB = [PAD, EOS, UNK, *TOOL_TOKENS, *map(_byte_symbol, CHARS)]
VOCAB_SIZE = 128  # the embedding is padded past the real tokens
NUM_DIGITS = 6
#: the warm start's share of conversations that call the calculator (the rest answer at once)
TOOL_FRACTION = 0.25


def build_tokenizer(path: str):
    """Write the task's tokenizer (module docstring) to ``path`` and return it as ``AutoTokenizer`` loads it.

    Byte-level BPE without merges (one token per character, Qwen2's pre-tokenizer and decoder), so every
    loader reads it the same: with a Qwen2 ``config.json`` beside it, transformers 5 loads it as
    ``Qwen2Tokenizer``, which replaces the pre-tokenizer with Qwen2's byte-level one; a character-level
    vocabulary would then lose its whitespace (and the tool turn's newlines with it)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(VOCAB)}, [], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    # matched in the raw text before the byte split; they keep the ids VOCAB gives them
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    tok.add_special_tokens([AddedToken(t, special=True) for t in (PAD, EOS, UNK)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK,
                                   clean_up_tokenization_spaces=False)
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return AutoTokenizer.from_pretrained(path)


def make_problem(rng: random.Random, num_digits: int = NUM_DIGITS) -> tuple[str, str]:
    """``(prompt, label)``: ``"a+b="`` and the sum. Both operands have ``num_digits`` digits and the sum one
    more (operands from 5 * 10^(num_digits-1) up), so every prompt, call and answer has the same length and
    a number is copied at a fixed offset: what a 2-layer model learns quickly."""
    lo, hi = 5 * 10 ** (num_digits - 1), 10 ** num_digits - 1
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    return f"{a}+{b}=", str(a + b)


def write_prompt_file(path: str, n: int, seed: int = 0, num_digits: int = NUM_DIGITS) -> str:
    """JSONL with ``prompt`` and ``label`` keys (what ``--prompt-data`` reads)."""
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        for _ in range(n):
            prompt, label = make_problem(rng, num_digits)
            fh.write(json.dumps({"prompt": prompt, "label": label}) + "\n")
    return path


def tool_call_text(expression: str) -> str:
    """The model turn that asks the calculator for ``expression``."""
    return TOOL_CALL_START + CALL_HEAD + expression + CALL_TAIL + TOOL_CALL_END


def final_answer(response_text: str) -> str:
    """What the response answers: its text after the last tool response (all of it without one), stripped,
    the end-of-sequence token dropped."""
    tail = response_text.rsplit(RESPONSE_END, 1)[-1]
    return tail.replace(EOS, "").strip()


def answer_reward(sample: Any) -> float:
    """``--custom-rm-path megatron_rl.rollout.agent.calculator_task:answer_reward``: 1.0 for exactly the
    right final answer, else 0.0. Calling the tool earns nothing by itself."""
    return float(final_answer(sample.response_text or "") == str(sample.label))


def conversation(tokenizer: Any, prompt: str, use_tool: bool) -> tuple[list[int], list[int]]:
    """``(token ids, loss mask)`` of one warm-start conversation, built as the tool loop builds a rollout:
    the prompt, then per turn the model's tokens (mask 1) and the tool turn (mask 0), each piece tokenised
    on its own. With ``use_tool`` the model calls the calculator on the prompt's expression and answers
    with its result; without, it answers the sum at once (mask 1 on its first token only)."""
    expression = prompt.rstrip("=")
    result = calculator({"expression": expression})

    def enc(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    ids, mask = enc(prompt), [0] * len(enc(prompt))
    if not use_tool:  # only the choice is taught: the sum's digits are not learnable in seconds, and their
        answer = enc(result)  # loss would drown the copying the tool conversations teach
        return ids + answer + [tokenizer.eos_token_id], mask + [1] + [0] * len(answer)
    for text, m in [(tool_call_text(expression), 1), (FALLBACK_OPEN + result + FALLBACK_CLOSE, 0), (result, 1)]:
        piece = enc(text)
        ids += piece
        mask += [m] * len(piece)
    return ids + [tokenizer.eos_token_id], mask + [1]


def warm_start(model: Any, tokenizer: Any, *, steps: int = 400, batch_size: int = 32, lr: float = 3e-3,
               tool_fraction: float = TOOL_FRACTION, seed: int = 0) -> float:
    """Supervised warm start of ``model`` in place (module docstring): ``steps`` Adam steps on fresh
    conversations, a ``tool_fraction`` of them calling the calculator. Returns the last step's loss."""
    import torch

    rng = random.Random(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains faster on one thread than on two
    loss = torch.tensor(float("nan"))
    try:
        for _ in range(steps):
            rows = [conversation(tokenizer, make_problem(rng)[0], rng.random() < tool_fraction)
                    for _ in range(batch_size)]
            width = max(len(ids) for ids, _ in rows)
            ids = torch.full((batch_size, width), tokenizer.pad_token_id)
            labels = torch.full((batch_size, width), -100)
            for i, (row, mask) in enumerate(rows):  # right padding: causal attention never looks at it
                ids[i, :len(row)] = torch.tensor(row)
                labels[i, :len(row)] = torch.where(torch.tensor(mask) == 1, torch.tensor(row), -100)
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return float(loss.item())


def build_model(path: str, *, seed: int = 0, warm_start_steps: int = 400, num_layers: int = 2,
                hidden: int = 64) -> str:
    """A tiny Qwen2-architecture policy with the task's tokenizer, warm-started, saved as an HF directory."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
        rope_theta=10000.0,  # type: ignore[call-arg]  # 4.x's name (setup.py: >=4.51); 5.x still takes it
        tie_word_embeddings=True, dtype="float32",
        eos_token_id=VOCAB.index(EOS), pad_token_id=VOCAB.index(PAD),
    )
    config.save_pretrained(path)  # first: the tokenizer is then loaded as the engine loads it (by model type)
    tokenizer = build_tokenizer(path)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if warm_start_steps:
        warm_start(model, tokenizer, steps=warm_start_steps, seed=seed)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path, safe_serialization=True)
    return path


def prepare(out_dir: str, *, num_prompts: int = 4096, num_eval: int = 64, seed: int = 0,
            warm_start_steps: int = 400) -> dict:
    """Model + train/eval prompt files for the agent demo under ``out_dir`` (kept if already there)."""
    paths = {"model": os.path.join(out_dir, "model"), "prompts": os.path.join(out_dir, "prompts.jsonl"),
             "eval": os.path.join(out_dir, "eval.jsonl")}
    if not os.path.isfile(os.path.join(paths["model"], "model.safetensors")):
        build_model(paths["model"], seed=seed, warm_start_steps=warm_start_steps)
    if not os.path.isfile(paths["prompts"]):
        write_prompt_file(paths["prompts"], num_prompts, seed=seed + 1)
    if not os.path.isfile(paths["eval"]):
        write_prompt_file(paths["eval"], num_eval, seed=seed + 2)
    return paths


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(allow_abbrev=False, description="Prepare the CPU agent demo's warm-started tiny "
                                 "model and addition prompts (kept if already there).")
    ap.add_argument("--out", required=True, help="directory for model/, prompts.jsonl, eval.jsonl")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-start-steps", type=int, default=400, help="supervised steps before RL (0: random init)")
    args = ap.parse_args(argv)
    for k, v in prepare(args.out, seed=args.seed, warm_start_steps=args.warm_start_steps).items():
        print(f"{k}: {v}")
    return 0


__all__ = ["CALL_HEAD", "CALL_TAIL", "TOOL_TOKENS", "VOCAB", "answer_reward", "build_model", "build_tokenizer",
           "conversation", "final_answer", "make_problem", "prepare", "tool_call_text", "warm_start",
           "write_prompt_file"]

if __name__ == "__main__":
    raise SystemExit(main())

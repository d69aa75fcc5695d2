"""The built-in verifiable task of the CPU demo: "add one to each digit, mod 10".

Prompt: ``3 1 4 1 =``; correct response: ``4 2 5 2`` then EOS. The reward is the
fraction of digit positions right (a wrong length loses the missing/extra
positions), so a random policy scores ~0.03 and the signal is dense enough that
GRPO learns it from random init on two CPU cores in a few minutes (measured:
reward 0.03 -> 0.97 in ~150 steps with 32 prompts x 8 samples, KL 0.05 to the
initial model).

Everything is real HF material built locally: a word-level ``tokenizers``
tokenizer saved with ``save_pretrained`` (so ``AutoTokenizer`` loads it) and a
tiny Qwen2-architecture model with random weights (or its Qwen3-MoE twin: ``--family``).
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, Iterable

PAD, BOS, EOS, SEP = "<pad>", "<bos>", "<eos>", "="
DIGITS = [str(d) for d in range(10)]
VOCAB = [PAD, BOS, EOS, SEP, *DIGITS]
VOCAB_SIZE = 32  # the embedding is padded past the real tokens; unused ids are never sampled well


def build_tokenizer(path: str):
    """Write a word-level tokenizer for the digit task to ``path`` and return it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=PAD)
    os.makedirs(path, exist_ok=True)
    fast.save_pretrained(path)
    return fast


#: the demo model's architecture families (``--family``): the dense default and an MoE twin
DEMO_FAMILIES = ("qwen2", "qwen3_moe", "deepseek_v3", "qwen3_next")


def build_demo_model(path: str, seed: int = 0, num_layers: int = 2, hidden: int = 64, family: str = "qwen2") -> str:
    """Tiny policy + the digit tokenizer, saved as an HF directory: Qwen2 architecture, or (``qwen3_moe``)
    Qwen3-MoE with 8 experts, top-2, in every layer (what MoE features such as routing replay run on), or
    (``deepseek_v3``) DeepSeek-V3's: multi-latent attention, a dense first layer, then MoE layers with a
    shared expert and the sigmoid router, or (``qwen3_next``) Qwen3-Next's: a gated delta-net layer, then
    gated full attention, MoE layers with a gated shared expert."""
    import torch
    import transformers

    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
        rope_theta=10000.0,  # 4.x's name (setup.py: >=4.51); 5.x still takes it
        tie_word_embeddings=True, dtype="float32",
        bos_token_id=VOCAB.index(BOS), eos_token_id=VOCAB.index(EOS), pad_token_id=VOCAB.index(PAD),
    )
    config: Any
    if family == "qwen2":
        config = transformers.Qwen2Config(intermediate_size=2 * hidden, **common)  # type: ignore[arg-type]
    elif family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(intermediate_size=2 * hidden, head_dim=hidden // 4, num_experts=8,
                                             num_experts_per_tok=2, moe_intermediate_size=hidden,
                                             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                             router_aux_loss_coef=0.0, **common)  # type: ignore[arg-type,call-arg]
    elif family == "deepseek_v3":  # MLA (q and kv latents, decoupled RoPE), 1 dense layer, then a shared expert
        # and 8 routed ones behind the sigmoid router with its correction bias (DeepSeek-V3's architecture)
        common.update(num_key_value_heads=4, tie_word_embeddings=False)
        config = transformers.DeepseekV3Config(intermediate_size=2 * hidden, q_lora_rank=32, kv_lora_rank=16,
                                               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                                               n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=hidden,
                                               first_k_dense_replace=1, n_shared_experts=1, n_group=1, topk_group=1,
                                               routed_scaling_factor=1.0, norm_topk_prob=True, rope_interleave=True,
                                               **common)  # type: ignore[arg-type]
    elif family == "qwen3_next":  # a gated delta-net layer then gated full attention, MoE with a gated shared expert
        common.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
        del common["rope_theta"]
        config = transformers.Qwen3NextConfig(
            intermediate_size=2 * hidden, head_dim=hidden // 4, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden, norm_topk_prob=True,
            decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.0, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            layer_types=["linear_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)],
            **common)  # type: ignore[arg-type]
    else:
        raise ValueError(f"--family {family!r}: the demo model is one of {', '.join(DEMO_FAMILIES)}")
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = VOCAB.index(EOS)
    model.generation_config.pad_token_id = VOCAB.index(PAD)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    build_tokenizer(path)
    return path


def make_problem(rng: random.Random, num_digits: int) -> tuple[str, str]:
    digits = [rng.randrange(10) for _ in range(num_digits)]
    prompt = " ".join(map(str, digits)) + f" {SEP}"
    answer = " ".join(str((d + 1) % 10) for d in digits)
    return prompt, answer


def write_prompt_file(path: str, n: int, num_digits: int = 4, seed: int = 0) -> str:
    """JSONL with ``prompt`` and ``label`` keys (what ``--prompt-data`` reads)."""
    rng = random.Random(seed)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        for _ in range(n):
            prompt, answer = make_problem(rng, num_digits)
            fh.write(json.dumps({"prompt": prompt, "label": answer}) + "\n")
    return path


def score(response_text: str, label: str) -> float:
    """Fraction of label positions answered right; every extra or non-digit token counts as wrong.

    Each token of this vocabulary is one character, so positions are the
    non-space characters of the decoded text (tokenizer classes differ in
    whether decode puts spaces between word-level tokens: "4 2 5 2" vs "4252").
    Special tokens are dropped first, so stopping with EOS costs nothing and
    padding the answer with '=' or extra digits does.
    """
    for special in (EOS, PAD, BOS):
        response_text = response_text.replace(special, " ")
    want = [c for c in label if not c.isspace()]
    got = [c for c in response_text if not c.isspace()]
    if not want:
        return 0.0
    right = sum(1 for w, g in zip(want, got) if w == g)
    return right / max(len(want), len(got))


def digit_reward(sample) -> float:
    """Reward function for ``--custom-rm-path megatron_rl.data.synthetic:digit_reward``."""
    return score(sample.response_text or "", str(sample.label))


def batch_scores(responses: Iterable[str], labels: Iterable[str]) -> list[float]:
    return [score(r, lab) for r, lab in zip(responses, labels)]


def prepare(out_dir: str, *, num_prompts: int = 4096, num_eval: int = 64, num_digits: int = 4, seed: int = 0,
            family: str = "qwen2", hidden: int = 64, num_layers: int = 2) -> dict:
    """Model + train/eval prompt files for the demo under ``out_dir`` (kept if already there: a run dir
    resumes with its own model, so one built for another ``family`` is refused, not replaced). ``hidden`` and
    ``num_layers`` size a new model: a larger one is the demo's on-policy-distillation teacher (docs/algorithms.md)."""
    paths = {"model": os.path.join(out_dir, "model"), "prompts": os.path.join(out_dir, "prompts.jsonl"),
             "eval": os.path.join(out_dir, "eval.jsonl")}
    config_path = os.path.join(paths["model"], "config.json")
    if not os.path.isfile(config_path):
        build_demo_model(paths["model"], seed=seed, family=family, hidden=hidden, num_layers=num_layers)
    else:
        with open(config_path) as f:
            have = json.load(f).get("model_type")
        if have != family:
            raise SystemExit(f"error: {paths['model']} holds a {have} demo model, not {family}: use another OUT "
                             f"(or DEMO_FAMILY={have}) to keep that run")
    if not os.path.isfile(paths["prompts"]):
        write_prompt_file(paths["prompts"], num_prompts, num_digits, seed=seed + 1)
    if not os.path.isfile(paths["eval"]):
        write_prompt_file(paths["eval"], num_eval, num_digits, seed=seed + 2)
    return paths


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(allow_abbrev=False, description="Prepare the CPU demo's tiny model and digit-task prompts.")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-digits", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--family", default="qwen2", choices=DEMO_FAMILIES, help="the demo model's architecture")
    ap.add_argument("--hidden-size", type=int, default=64, help="a new model's hidden size (an OPD teacher: larger)")
    ap.add_argument("--num-layers", type=int, default=2, help="a new model's decoder layers")
    args = ap.parse_args()
    for k, v in prepare(args.out, num_digits=args.num_digits, seed=args.seed, family=args.family,
                        hidden=args.hidden_size, num_layers=args.num_layers).items():
        print(f"{k}: {v}")

"""A visual task for the vision-language CPU demo: "how many squares are in the picture?".

Prompt: ``<image> =`` with a 16 x 16 RGB image holding 1 to 4 colored 4 x 4 squares on black; correct response: the
count as one digit, then EOS. The answer is only in the image, so a policy that ignores the pixels cannot do better
than guessing. The reward is ``synthetic.score`` (``--custom-rm-path megatron_rl.data.synthetic:digit_reward``).

Everything is real HF material built locally: a tiny random Qwen2.5-VL (``models.hf_tiny``: its vision tower, its
``preprocessor_config.json``) with the digit task's word-level tokenizer, which also holds the model's vision tokens
(``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>`` at the config's ids), so verl's ``<image>`` marker
renders to the image slot (data/images.py); PNG files written with PIL; a JSONL prompt file whose ``images`` column
names them (``--multimodal-keys '{"image": "images"}'``).
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from megatron_rl.data.synthetic import BOS, EOS, PAD, SEP, VOCAB
from megatron_rl.models.hf_tiny import build_tiny_hf_model

FAMILY = "qwen2_5_vl"
SIDE, CELL = 16, 4  # image side and square side, in pixels: a 4 x 4 grid of cells, 16 merged image tokens
MAX_SQUARES = 4


def build_tokenizer(path: str, vision_tokens: dict[str, int]):
    """The digit task's word-level tokenizer plus the model's vision tokens (special, at their config ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(VOCAB)}
    vocab.update(vision_tokens)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=PAD,
                                   additional_special_tokens=list(vision_tokens))
    fast.save_pretrained(path)
    return fast


#: the vision tokens' ids, right after the digit task's words: a 32-token vocabulary (as the text demo's), so a
#: random policy's answers are digits often enough for GRPO's groups to differ
VISION_TOKEN_IDS: dict[str, Any] = {"image_token_id": len(VOCAB), "video_token_id": len(VOCAB) + 1,
                    "vision_start_token_id": len(VOCAB) + 2, "vision_end_token_id": len(VOCAB) + 3}
DEMO_VOCAB_SIZE = 32


def build_vlm_demo_model(path: str, seed: int = 0) -> str:
    """The tiny random Qwen2.5-VL (``hf_tiny``'s, its image processor included) with the task's tokenizer and a
    32-token vocabulary."""
    ids = VISION_TOKEN_IDS
    build_tiny_hf_model(FAMILY, path, seed=seed, vocab_size=DEMO_VOCAB_SIZE, **ids)  # token ids: to the config
    build_tokenizer(path, {"<|image_pad|>": ids["image_token_id"], "<|video_pad|>": ids["video_token_id"],
                           "<|vision_start|>": ids["vision_start_token_id"],
                           "<|vision_end|>": ids["vision_end_token_id"]})
    return path


def draw_squares(path: str, count: int, rng: random.Random) -> None:
    """A ``SIDE x SIDE`` PNG with ``count`` squares of random bright colors in distinct cells."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIDE, SIDE))
    draw = ImageDraw.Draw(image)
    cells = rng.sample(range((SIDE // CELL) ** 2), count)
    for cell in cells:
        x, y = (cell % (SIDE // CELL)) * CELL, (cell // (SIDE // CELL)) * CELL
        draw.rectangle([x, y, x + CELL - 1, y + CELL - 1], fill=tuple(rng.randrange(128, 256) for _ in range(3)))
    image.save(path)


def write_prompt_file(path: str, n: int, seed: int = 0) -> str:
    """JSONL with ``prompt`` (``<image> =``), ``images`` (one PNG path, relative to the file) and ``label``."""
    rng = random.Random(seed)
    root = os.path.dirname(os.path.abspath(path))
    images = os.path.join(root, os.path.splitext(os.path.basename(path))[0] + "_images")
    os.makedirs(images, exist_ok=True)
    with open(path, "w") as fh:
        for k in range(n):
            count = rng.randint(1, MAX_SQUARES)
            name = f"{k:05d}.png"
            draw_squares(os.path.join(images, name), count, rng)
            fh.write(json.dumps({"prompt": f"<image> {SEP}", "images": [os.path.join(os.path.basename(images), name)],
                                 "label": str(count)}) + "\n")
    return path


def prepare(out_dir: str, *, num_prompts: int = 512, num_eval: int = 32, seed: int = 0) -> dict:
    """Model and train / eval prompt files under ``out_dir`` (each kept if already there: a run dir resumes)."""
    paths = {"model": os.path.join(out_dir, "model"), "prompts": os.path.join(out_dir, "prompts.jsonl"),
             "eval": os.path.join(out_dir, "eval.jsonl")}
    if not os.path.isfile(os.path.join(paths["model"], "config.json")):
        build_vlm_demo_model(paths["model"], seed=seed)
    if not os.path.isfile(paths["prompts"]):
        write_prompt_file(paths["prompts"], num_prompts, seed=seed + 1)
    if not os.path.isfile(paths["eval"]):
        write_prompt_file(paths["eval"], num_eval, seed=seed + 2)
    return paths


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(allow_abbrev=False, description="Prepare the vision-language CPU demo's tiny "
                                 "Qwen2.5-VL and its counting-squares prompts.")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for key, value in prepare(args.out, num_prompts=args.num_prompts, seed=args.seed).items():
        print(f"{key}: {value}")

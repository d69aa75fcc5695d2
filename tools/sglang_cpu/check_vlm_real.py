"""Vision-language rollout against REAL SGLang 0.5.23 on a CPU-only machine: ``/generate`` with ``image_data``.

Starts ``sglang.launch_server`` (the CPU route of ``check_real_sglang.py``, plus ``--mm-preprocess-cache-size-mb``)
on a tiny random Qwen2.5-VL and generates through megatron_rl's ``SGLangEngine``, whose requests carry each
prompt's images as ``data:`` URLs of their PNG bytes and one image-pad token per image (SGLang expands it). Checks:

1. greedy generations with images (a prompt with two images of different sizes among them) equal the embedded
   engine's (HF transformers' module with our M-RoPE positions): the same tokens, log-probs within ``--tol``;
2. the pixels reach SGLang's vision tower: the same prompts with other images of the same sizes give other
   log-probs;
3. a weight update through the disk route carrying every tensor of another random checkpoint, vision tower
   included, then one carrying the language model alone (what ``--freeze-vision-tower`` syncs after the first):
   generations equal the embedded engine's given the same tensors.

Why the tiny model has 14-pixel patches (the demo's have 2): SGLang 0.5.23's ``Qwen2_5_VLForConditionalGeneration
.get_image_feature`` takes pixel rows whose width is neither the tower's hidden size nor 1176 (3 channels x
temporal patch 2 x 14 x 14, the released models' patch) as precomputed image embeddings and skips the vision
tower; their row count then disagrees with the pad tokens and the scheduler dies (``split_with_sizes expects
split_sizes to sum exactly to 64 ... got [16]``). Why ``--mm-preprocess-cache-size-mb``: without it SGLang's Qwen-VL
processor decodes the prompt's token ids to text and finds the images by their slot's text, which the demo's
word-level tokenizer does not give back; with it the processor expands the pad tokens of the ids as sent.

Why ``SGLANG_VLM_CACHE_SIZE_MB=0`` (what the launcher sets for runs with images): SGLang keeps each image's tower
output by the image's hash, and neither a weight update nor ``/flush_cache`` clears it; with it on, images seen
before an update keep the old tower's features (``--keep-vlm-cache`` shows it: the checks of those images fail
after each update while new images pass).

Run through ``scripts/test_sglang_real.sh --vlm``. Writes figures.json / check.log / server.log under ``--out``;
exit 0 all passed, 1 a check failed, 2 the server could not be started.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_real_sglang import CheckFailed, Report, SGLangServer, finish, start_checked  # noqa: E402
from megatron_rl.data.images import ImageProcessor  # noqa: E402
from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams  # noqa: E402
from megatron_rl.data.vlm_demo import DEMO_VOCAB_SIZE, VISION_TOKEN_IDS, build_tokenizer  # noqa: E402
from megatron_rl.infra.ports import free_port  # noqa: E402
from megatron_rl.models.hf_tiny import build_tiny_hf_model  # noqa: E402
from megatron_rl.rollout.embedded import EmbeddedEngine  # noqa: E402
from megatron_rl.rollout.sglang import SGLangEngine  # noqa: E402

PATCH = 14  # SGLang's Qwen2.5-VL runs its tower only on 1176-wide pixel rows (module docstring)
# --mem-fraction-static above the CPU route's 0.05: on a machine whose free memory moves under other jobs, SGLang's start-up
# profile can find the 0.05 share gone ("Loaded weights leave no GPU memory for the KV cache"); the KV cache stays
# capped by --max-total-tokens
SERVER_EXTRA = ["--mm-preprocess-cache-size-mb", "64", "--mem-fraction-static", "0.2"]
# (text token before the image slots, image sizes in pixels (width, height)); a two-image prompt among them
PROMPTS = [(5, [(28, 28)]), (6, [(56, 28), (28, 56)]), (7, [(56, 56)]), (8, [(28, 28)])]


def build_model(path: Path, seed: int) -> Path:
    """The demo's tiny Qwen2.5-VL and tokenizer with 14-pixel patches, its image processor to match (28 x 28 to
    56 x 56 pixels: 1 to 4 merged image tokens)."""
    if (path / "tokenizer.json").exists():
        return path
    ids = VISION_TOKEN_IDS
    build_tiny_hf_model("qwen2_5_vl", path, seed=seed, vocab_size=DEMO_VOCAB_SIZE, **ids,
                        vision_config=dict(patch_size=PATCH, window_size=2 * 2 * PATCH))
    build_tokenizer(str(path), {"<|image_pad|>": ids["image_token_id"], "<|video_pad|>": ids["video_token_id"],
                                "<|vision_start|>": ids["vision_start_token_id"],
                                "<|vision_end|>": ids["vision_end_token_id"]})
    config = json.loads((path / "preprocessor_config.json").read_text())
    config.update(patch_size=PATCH, size={"shortest_edge": 28 * 28, "longest_edge": 56 * 56})
    for key in ("min_pixels", "max_pixels"):
        config.pop(key, None)
    (path / "preprocessor_config.json").write_text(json.dumps(config, indent=2))
    return path


def png(path: Path, size: tuple[int, int], rng: random.Random) -> str:
    from PIL import Image

    image = Image.new("RGB", size)
    image.putdata([tuple(rng.randrange(256) for _ in range(3)) for _ in range(size[0] * size[1])])
    image.save(path)
    return str(path)


def requests(model: Path, out: Path, seed: int) -> list[GenerateRequest]:
    rng = random.Random(seed)
    processor = ImageProcessor(str(model))
    ids = VISION_TOKEN_IDS
    slot = [ids["vision_start_token_id"], ids["image_token_id"], ids["vision_end_token_id"]]
    made = []
    for k, (text, sizes) in enumerate(PROMPTS):
        out.mkdir(parents=True, exist_ok=True)
        images = [png(out / f"image_{k}_{j}.png", size, rng) for j, size in enumerate(sizes)]
        vision = processor.process(images, f"prompt {k}")
        prompt = [text] + [t for _ in images for t in slot] + [text]
        made.append(GenerateRequest(processor.expand(prompt, vision, f"prompt {k}"), k, multimodal_inputs=vision))
    return made


def compare(report: Report, name: str, got: list[Sample], want: list[Sample], tol: float) -> float:
    same = [a.response_ids == b.response_ids for a, b in zip(got, want)]
    delta = max(abs(x - y) for a, b in zip(got, want) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs))
    report.figures[name] = {"samples": len(got), "tokens_equal": sum(same), "max_abs_logprob_delta": delta}
    report.check(f"{name}: SGLang's greedy generations with images equal the embedded engine's ({sum(same)}/"
                 f"{len(same)} token-equal, max |delta log-prob| {delta:.2e} <= {tol:g})", all(same) and delta <= tol,
                 "; ".join(f"prompt {a.group_index}: SGLang {a.response_ids} embedded {b.response_ids}"
                           for a, b, ok in zip(got, want, same) if not ok))
    return delta


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="/tmp/sglang_vlm", help="output dir: figures.json, check.log, server.log")
    ap.add_argument("--sglang-python", default=os.environ.get("SGLANG_PYTHON", "/work/sglang-venv/bin/python"))
    ap.add_argument("--startup-timeout-s", type=float, default=600.0)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep-vlm-cache", action="store_true",
                    help="leave SGLang's image-embedding cache on (SGLANG_VLM_CACHE_SIZE_MB unset): the images seen "
                         "before a weight update then keep the old tower's features, and the after-update checks of "
                         "those images fail (shows why the launcher turns it off)")
    args = ap.parse_args(argv)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    report = Report(out)
    if not os.access(args.sglang_python, os.X_OK):
        report.log(f"error: {args.sglang_python} is not an executable python; run scripts/sglang_cpu_install.sh")
        return 2
    model = build_model(out / "model", args.seed)
    other = build_model(out / "model_v1", args.seed + 1)
    third = build_model(out / "model_v2", args.seed + 2)
    env = {} if args.keep_vlm_cache else {"SGLANG_VLM_CACHE_SIZE_MB": "0"}  # what the launcher sets (module doc)
    server = SGLangServer(args.sglang_python, model, out / "server.log", port=free_port(), extra_args=SERVER_EXTRA,
                          env=env)
    try:
        if not start_checked(report, server, args.startup_timeout_s, "server starts on a tiny Qwen2.5-VL"):
            return 2
        engine = SGLangEngine([server.url], weight_dir=str(out / "weights"), hf_checkpoint=str(model), timeout_s=60,
                              generate_timeout_s=300, update_timeout_s=300, releases_memory=False,
                              health_interval_s=0)
        reqs = requests(model, out, args.seed)
        greedy = SamplingParams(temperature=0.0, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        reference = EmbeddedEngine(str(model))
        # the embedded engine never samples the vision tokens (docs/vlm.md); SGLang does, and a random model gives
        # them mass: compare like with like
        reference.banned_tokens = ()
        first = engine.generate(reqs, greedy)
        compare(report, "with_images", first, reference.generate(reqs, greedy), args.tol)
        # the pixels reach SGLang's tower: the same prompts with other images (same sizes) give other log-probs
        other_images = engine.generate(requests(model, out / "other", args.seed + 7), greedy)
        moved = max(abs(a.rollout_logprobs[0] - b.rollout_logprobs[0]) for a, b in zip(first, other_images))
        report.figures["other_images_move_first_logprob"] = moved
        report.check(f"SGLang's generations follow the pixels (other images of the same sizes move the first "
                     f"log-prob by up to {moved:.3f})", moved > 1e-3)
        # weight sync: every tensor (the tower's included), then the language model alone (--freeze-vision-tower)
        tensors = _tensors(other)
        engine.update_weights(list(tensors.items()), 1)
        reference.update_weights(list(tensors.items()), 1)
        fresh = requests(model, out / "fresh", args.seed + 13)  # images this server never saw
        compare(report, "after_full_update_new_images", engine.generate(fresh, greedy),
                reference.generate(fresh, greedy), args.tol)
        compare(report, "after_full_update", engine.generate(reqs, greedy), reference.generate(reqs, greedy),
                args.tol)
        language = {k: v for k, v in _tensors(third).items() if not k.startswith("visual.")}
        engine.update_weights(list(language.items()), 2)
        reference.update_weights(list(language.items()), 2)
        report.figures["language_only_tensors"] = len(language)
        fresh = requests(model, out / "fresh2", args.seed + 17)
        compare(report, "after_language_model_update_new_images", engine.generate(fresh, greedy),
                reference.generate(fresh, greedy), args.tol)
        compare(report, "after_language_model_update", engine.generate(reqs, greedy),
                reference.generate(reqs, greedy), args.tol)
        engine.close()
        report.check("server alive at the end", server.alive(), "" if server.alive() else server.log_tail())
    except CheckFailed as exc:
        report.check("vision-language checks ran", False, str(exc))
    except Exception as exc:  # noqa: BLE001 - a failure of the server shows as a client error: name it with its log
        report.check("vision-language checks ran", False, f"{type(exc).__name__}: {exc}\nserver log tail:\n"
                     + server.log_tail(30))
    finally:
        server.stop()
    return finish(report, out)


def _tensors(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    tensors: dict = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


if __name__ == "__main__":
    sys.exit(main())

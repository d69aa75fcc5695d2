#!/usr/bin/env python
"""slime's torch_dist -> HF command, unchanged, over ``tools/convert_ckpt.py dist-to-hf``.

    python tools/convert_torch_dist_to_hf.py --input-dir SAVE/iter_0000100 --output-dir HF_OUT \\
        --origin-hf-dir HF_DIR

``--input-dir``: a training checkpoint's ``iter_NNNNNNN`` dir, its root (the checkpoint a resume would
take) or a converted model-only dir. ``--origin-hf-dir``: the HF dir whose config.json and tokenizer files
the output gets (convert_ckpt.py's ``--hf-config``; default: the ``hf_config/`` the checkpoint holds).
``-f/--force`` is ``--overwrite`` (it replaces a previous conversion's output or an empty dir; any other
existing dir is refused, not written into), ``--chunk-size BYTES`` is ``--max-shard-size``.
``--vocab-size N`` (slime: unpad the embedding to N rows) is accepted when it is config.json's vocab_size,
which the export always unpads to, and refused otherwise. ``--model-name`` is not needed (the family is
config.json's model_type) and is ignored, saying so. ``-a/--add-missing-from-origin-hf`` is refused: the
checkpoint must hold every tensor (MTP layers: ``--mtp-num-layers`` when training or converting).
Conversion-only options of convert_ckpt.py (``--dtype``, ``--verify``, ``--bucket-size``, ``--no-progress``,
``--json``) are accepted; exit codes and messages are convert_ckpt.py's (docs/convert.md).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

_TOOLS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(_TOOLS))
sys.path.insert(0, _TOOLS)

import convert_ckpt  # noqa: E402

PROG = "convert_torch_dist_to_hf.py"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-dir", required=True, metavar="DIR")
    ap.add_argument("--output-dir", required=True, metavar="DIR")
    ap.add_argument("--origin-hf-dir", metavar="DIR")
    ap.add_argument("--model-name", help="slime's: not needed here (config.json's model_type), ignored")
    ap.add_argument("-f", "--force", action="store_true", help="convert_ckpt.py's --overwrite")
    ap.add_argument("-a", "--add-missing-from-origin-hf", action="store_true", help="slime's: refused")
    ap.add_argument("--chunk-size", type=int, default=5 * 1024**3, metavar="BYTES",
                    help="largest shard (convert_ckpt.py's --max-shard-size)")
    ap.add_argument("--vocab-size", type=int, metavar="N", help="accepted when it is config.json's vocab_size")
    ap.add_argument("--dtype", default="keep", choices=["keep", "float32", "bfloat16", "float16"])
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--bucket-size", default="1GB")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json", action="store_true")
    return ap


def _config_dir(args) -> str:
    if args.origin_hf_dir:
        return args.origin_hf_dir
    from megatron_rl.models.model_dir import HF_CONFIG_SUBDIR, resolve_dist_dir  # lazy: imports torch
    from megatron_rl.errors import MegatronRLError

    try:
        return os.path.join(resolve_dist_dir(os.path.abspath(args.input_dir)), HF_CONFIG_SUBDIR)
    except MegatronRLError:
        return os.path.join(args.input_dir, HF_CONFIG_SUBDIR)  # convert_ckpt.py names what is wrong with it


def convert_ckpt_argv(argv=None) -> list[str]:
    """convert_ckpt.py's ``dist-to-hf`` command for slime's ``argv``; ``SystemExit(2)`` naming a refusal."""
    args = build_parser().parse_args(argv)
    errors = []
    if args.add_missing_from_origin_hf:
        errors.append("-a/--add-missing-from-origin-hf: refused; tensors the checkpoint lacks are not copied from "
                      "the origin HF dir (the export is the trained model, whole). MTP layers: train or convert "
                      "with --mtp-num-layers N so the checkpoint holds them")
    if args.vocab_size is not None:
        from megatron_rl.config.architecture import read_hf_config, text_config

        config_dir = _config_dir(args)
        try:  # unreadable or missing: convert_ckpt.py refuses it, naming the file
            vocab = text_config(read_hf_config(config_dir)).get("vocab_size")
        except (OSError, ValueError):
            vocab = args.vocab_size
        if vocab != args.vocab_size:
            errors.append(f"--vocab-size {args.vocab_size}: {config_dir}/config.json gives vocab_size {vocab}, the "
                          f"rows the export always writes (megatron's padding removed); drop --vocab-size or give "
                          f"{vocab}")
    if errors:
        print(f"{PROG}: " + "\n  - ".join(["refused:", *errors]), file=sys.stderr)
        raise SystemExit(2)
    if args.model_name is not None:
        print(f"{PROG}: note: --model-name {args.model_name} ignored; the family is config.json's model_type",
              file=sys.stderr)
    argv_out = ["dist-to-hf", "--input", args.input_dir, "--output", args.output_dir, "--max-shard-size",
                str(args.chunk_size), "--dtype", args.dtype, "--bucket-size", args.bucket_size]
    if args.origin_hf_dir:
        argv_out += ["--hf-config", args.origin_hf_dir]
    if args.force:
        argv_out.append("--overwrite")
    return argv_out + [f"--{k}" for k in ("verify", "no-progress", "json") if getattr(args, k.replace("-", "_"))]


def main(argv=None) -> int:
    return convert_ckpt.main_translated(convert_ckpt_argv, argv)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, convert_ckpt._on_sigint)
    sys.exit(convert_ckpt._entry(main))

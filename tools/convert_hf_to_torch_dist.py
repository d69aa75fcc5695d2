#!/usr/bin/env python
"""slime's HF -> torch_dist command, unchanged, over ``tools/convert_ckpt.py hf-to-dist``.

    source scripts/models/glm4.5-355B-A32B.sh   # slime's MODEL_ARGS
    python tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint HF_DIR --save DIST_DIR
    torchrun --nproc-per-node 8 tools/convert_hf_to_torch_dist.py ${MODEL_ARGS[@]} --hf-checkpoint HF_DIR \\
        --save DIST_DIR --pipeline-model-parallel-size 8

The model comes from ``--hf-checkpoint``'s config.json, as in a run; the MODEL_ARGS are checked against it
as a run checks them (``config/architecture.py``: a flag that disagrees is refused naming both values and
the file, before anything is written). Parallel sizes (``--tensor-/--pipeline-/--expert-model-parallel-size``,
``--expert-tensor-parallel-size``) and ``--mtp-num-layers`` are the converter's; Megatron's other knobs in a
slime MODEL_ARGS (fusions, dispatcher, router dtype, ...) change no weight and are parsed, not used.

Differs from slime's: ``--save`` becomes the model-only torch_dist dir convert_ckpt.py writes (not
``release/`` under it), which ``--load`` / ``--ref-load`` take as it is; under torchrun the layout is the
flags' (slime picks a pipeline size from the world size; here the other ranks are data-parallel copies);
the dtype is the checkpoint's (``--dtype`` converts). Conversion-only options of convert_ckpt.py
(``--dtype``, ``--verify``, ``--overwrite``, ``--bucket-size``, ``--no-progress``, ``--json``) are accepted;
exit codes and messages are convert_ckpt.py's (docs/convert.md).
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

PROG = "convert_hf_to_torch_dist.py"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=PROG, allow_abbrev=False, add_help=True,
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hf-checkpoint", required=True, metavar="DIR", help="the HF model dir (config.json builds it)")
    ap.add_argument("--save", required=True, metavar="DIR", help="the torch_dist dir to write")
    ap.add_argument("--custom-model-provider-path", metavar="PATH",
                    help="slime's: refused (the bridge for config.json's model_type builds the model)")
    ap.add_argument("--padded-vocab-size", type=int, metavar="N",
                    help="slime's: refused (the embedding's rows are config.json's vocab_size)")
    ap.add_argument("--allgather-cp", action="store_true",
                    help="slime's: no effect (a conversion has no context parallelism)")
    ap.add_argument("--dtype", default="keep", choices=["keep", "float32", "bfloat16", "float16"])
    ap.add_argument("--verify", action="store_true")
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument("--bucket-size", default="1GB")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json", action="store_true")
    return ap


def convert_ckpt_argv(argv=None) -> list[str]:
    """convert_ckpt.py's ``hf-to-dist`` command for slime's ``argv``; ``SystemExit(2)`` with every refusal on
    stderr when the MODEL_ARGS contradict themselves or config.json, or name what this converter does not do."""
    from megatron_rl.config import parse_config  # stdlib only: --help and refusals stay fast
    from megatron_rl.config.architecture import architecture_errors
    from megatron_rl.errors import ConfigError

    args, model_args = build_parser().parse_known_args(argv)
    errors = []
    if args.custom_model_provider_path is not None:
        errors.append(f"--custom-model-provider-path {args.custom_model_provider_path}: refused; the model is "
                      "the bridge's for config.json's model_type (megatron_rl/models/families.py): drop it")
    if args.padded_vocab_size is not None:
        errors.append(f"--padded-vocab-size {args.padded_vocab_size}: refused; the embedding's rows are "
                      "config.json's vocab_size (checked against --vocab-size when given): drop it")
    try:
        cfg = parse_config([*model_args, "--hf-checkpoint", args.hf_checkpoint], validate=False)
    except ConfigError as e:
        errors.append(str(e))
    else:
        errors += architecture_errors(cfg)
    if not os.path.isfile(os.path.join(args.hf_checkpoint, "config.json")):
        errors.append(f"--hf-checkpoint {args.hf_checkpoint}: no config.json there; point it at an HF model dir")
    if errors:
        print(f"{PROG}: " + "\n  - ".join(["refused:", *errors]), file=sys.stderr)
        raise SystemExit(2)
    p = cfg.parallel
    argv_out = ["hf-to-dist", "--input", args.hf_checkpoint, "--output", args.save, "--dtype", args.dtype,
                "--bucket-size", args.bucket_size,
                "--tensor-model-parallel-size", str(p.tensor_model_parallel_size),
                "--pipeline-model-parallel-size", str(p.pipeline_model_parallel_size),
                "--expert-model-parallel-size", str(p.expert_model_parallel_size),
                "--mtp-num-layers", str(cfg.megatron.mtp_num_layers or 0)]
    if p.expert_tensor_parallel_size is not None:
        argv_out += ["--expert-tensor-parallel-size", str(p.expert_tensor_parallel_size)]
    return argv_out + [f"--{k}" for k in ("verify", "overwrite", "no-progress", "json")
                       if getattr(args, k.replace("-", "_"))]


def main(argv=None) -> int:
    return convert_ckpt.main_translated(convert_ckpt_argv, argv)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, convert_ckpt._on_sigint)
    sys.exit(convert_ckpt._entry(main))

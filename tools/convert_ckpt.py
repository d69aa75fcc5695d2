#!/usr/bin/env python
"""Convert checkpoints between HF safetensors and megatron-core torch_dist, and fsdp checkpoints to HF.

    # HF -> torch_dist (one process, streaming: peak memory ~ largest tensor + --bucket-size;
    # the output reloads at any TP/PP/EP)
    python tools/convert_ckpt.py hf-to-dist --input HF_DIR --output DIST_DIR [--dtype bfloat16] [--verify] \\
        [--bucket-size 1GB]

    # torch_dist (converted dir, training iter_NNNNNNN dir or checkpoint root) -> HF
    python tools/convert_ckpt.py dist-to-hf --input DIST_DIR --output HF_DIR [--hf-config HF_DIR] \\
        [--max-shard-size 5GB] [--dtype keep] [--verify]

    # the same under torchrun: each rank writes its shard (faster; --verify then holds 1/(TP*PP) per rank)
    torchrun --nproc-per-node 8 tools/convert_ckpt.py hf-to-dist --input HF --output DIST \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --expert-model-parallel-size 2

    # an fsdp training checkpoint (--train-backend fsdp: DCP, iter_NNNNNNN dir or checkpoint root) -> HF;
    # one process, megatron-core not needed, reads any DP size's shards
    python tools/convert_ckpt.py fsdp-to-hf --input CKPT --output HF_DIR [--hf-config HF_DIR] \\
        [--max-shard-size 5GB] [--dtype keep] [--verify] [--bucket-size 1GB]

Families: every one ``megatron_rl.models`` bridges (llama, qwen2, qwen3, qwen3_moe, mixtral, glm4_moe); fsdp-to-hf:
any HF causal LM the fsdp backend trains. A megatron torch_dist and an fsdp checkpoint are told
apart by their ``COMPLETE.json`` format: the wrong direction is refused naming the right one.
Refusals (unmapped / missing / mis-shaped tensors, weights holding inf/NaN in either direction,
config mismatches, incomplete inputs, an existing output without --overwrite, an output that is,
contains or lies inside the input) print one message naming the tensors and the fix on stderr
and exit 2; Ctrl-C prints one line and exits 130. Outputs appear only when complete; a failed run
removes its temp dir. See docs/convert.md.
"""

from __future__ import annotations

import os
import signal
import sys

_in_main = False  # set by the entry point: from then on a Ctrl-C is main's KeyboardInterrupt (temp dir removed)


def _on_sigint(signum, frame) -> None:
    """Ctrl-C from the tool's first line on: one line on stderr and exit 130, never a traceback.

    While the tool starts (these imports) nothing is written: it exits here. Once the entry point
    runs it raises KeyboardInterrupt once, which main answers (temp dir removed, one line) or the
    entry point does; later Ctrl-Cs are ignored, so that clean-up cannot be cut short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if _in_main:
        raise KeyboardInterrupt
    print("convert_ckpt.py: interrupted while starting; nothing was written", file=sys.stderr, flush=True)
    sys.exit(130)


if __name__ == "__main__":  # not in the torch_dist writer's spawned helpers (__mp_main__) nor on import
    signal.signal(signal.SIGINT, _on_sigint)

import argparse  # noqa: E402
import json  # noqa: E402
from typing import Callable, Optional  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_rl.errors import MegatronRLError  # noqa: E402
from megatron_rl.infra.checkpoint_root import temp_dir_for  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="convert_ckpt.py", allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="direction", required=True)
    for name, help_ in (("hf-to-dist", "HF safetensors dir -> torch_dist dir"),
                        ("dist-to-hf", "torch_dist dir (or checkpoint root) -> HF safetensors dir"),
                        ("fsdp-to-hf", "fsdp checkpoint (--train-backend fsdp: iter_NNNNNNN dir or checkpoint root) "
                                       "-> HF safetensors dir"),
                        ("dist-to-peft", "a --lora-rank run's torch_dist checkpoint -> its adapters as a HF PEFT dir "
                                         "(adapter_model.safetensors + adapter_config.json)"),
                        ("fsdp-to-peft", "a --train-backend fsdp --lora-rank run's checkpoint -> its adapters as a "
                                         "HF PEFT dir")):
        p = sub.add_parser(name, help=help_, allow_abbrev=False)
        p.add_argument("--input", required=True, metavar="DIR")
        p.add_argument("--output", required=True, metavar="DIR")
        if name == "fsdp-to-peft":
            p.add_argument("--overwrite", action="store_true", help="replace an existing --output (atomically)")
            p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
            continue
        if name == "dist-to-peft":
            p.add_argument("--hf-config", metavar="DIR", help="dir with config.json (default: INPUT/hf_config)")
            p.add_argument("--lora-base", metavar="DIR",
                           help="the HF base the adapters were trained on, written as the PEFT dir's "
                                "base_model_name_or_path (default: the run's --hf-checkpoint, recorded in the "
                                "checkpoint; checked by its weights digest)")
            p.add_argument("--overwrite", action="store_true", help="replace an existing --output (atomically)")
            p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
            continue
        if name == "dist-to-hf":
            p.add_argument("--merge-lora", action="store_true",
                           help="a --lora-rank run's checkpoint: fold the adapters into the weights (PEFT's "
                                "merge_and_unload); without it such a checkpoint is refused")
            p.add_argument("--lora-base", metavar="DIR",
                           help="with --merge-lora: the HF base the adapters were trained on (default: the run's "
                                "--hf-checkpoint, recorded in the checkpoint; checked by its weights digest)")
        p.add_argument("--dtype", default="keep", choices=["keep", "float32", "bfloat16", "float16"],
                       help="convert every tensor to this dtype (default: keep the source dtype)")
        p.add_argument("--verify", action="store_true",
                       help="reload the output and compare every tensor (bit-exact; with --dtype against the "
                            "source cast to it)")
        p.add_argument("--overwrite", action="store_true", help="replace an existing --output (atomically)")
        p.add_argument("--no-progress", action="store_true")
        p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
        if name != "fsdp-to-hf":  # fsdp-to-hf is one process: DCP reassembles any layout's shards
            p.add_argument("--tensor-model-parallel-size", type=int, default=1, dest="tp")
            p.add_argument("--pipeline-model-parallel-size", type=int, default=1, dest="pp")
            p.add_argument("--expert-model-parallel-size", type=int, default=1, dest="ep")
            p.add_argument("--expert-tensor-parallel-size", type=int, default=None, dest="etp")
        if name == "hf-to-dist":
            p.add_argument("--mtp-num-layers", type=int, default=0,
                           help="keep the checkpoint's multi-token-prediction layers (config.json "
                                "num_nextn_predict_layers; DeepSeek-V3 / GLM-4.5) as megatron's MTP block, as "
                                "training with --mtp-num-layers builds it; 0 (default): skip them, as transformers "
                                "does. dist-to-hf keeps whatever MTP layers the torch_dist checkpoint holds")
        if name != "hf-to-dist":
            p.add_argument("--hf-config", metavar="DIR",
                           help="dir with config.json + tokenizer files (default: INPUT/hf_config)")
            p.add_argument("--max-shard-size", default="5GB", help="HF shard size limit (default 5GB)")
        p.add_argument("--bucket-size", default="1GB",
                       help="how much the conversion holds at a time (default 1GB): hf-to-dist writes torch_dist "
                            "files of this size, dist-to-hf / fsdp-to-hf load this many bytes of parameters per "
                            "read; peak memory is about the largest tensor plus this (to HF: plus one HF shard)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        from megatron_rl.convert.common import parse_dtype  # lazy: imports torch (--help stays instant)
        from megatron_rl.convert.safetensors_writer import parse_size  # lazy: imports torch

        if args.direction == "dist-to-peft":
            from megatron_rl.convert.lora_export import convert_dist_to_peft  # lazy: imports torch, megatron-core

            return _report(args, convert_dist_to_peft(args.input, args.output, hf_config_dir=args.hf_config,
                                                      overwrite=args.overwrite, lora_base=args.lora_base))
        if args.direction == "fsdp-to-peft":
            from megatron_rl.convert.fsdp_to_hf import convert_fsdp_to_peft  # lazy: imports torch, not megatron-core

            return _report(args, convert_fsdp_to_peft(args.input, args.output, overwrite=args.overwrite))
        if args.direction == "fsdp-to-hf":
            from megatron_rl.convert.fsdp_to_hf import convert_fsdp_to_hf  # lazy: imports torch, not megatron-core

            summary = convert_fsdp_to_hf(args.input, args.output, hf_config_dir=args.hf_config,
                                         dtype=parse_dtype(args.dtype), max_shard_size=args.max_shard_size,
                                         verify=args.verify, overwrite=args.overwrite,
                                         show_progress=not args.no_progress,
                                         bucket_bytes=parse_size(args.bucket_size, "--bucket-size"))
            return _report(args, summary)
        from megatron_rl.convert.dist_to_hf import convert_dist_to_hf  # lazy: imports torch
        from megatron_rl.convert.hf_to_dist import convert_hf_to_dist  # lazy: imports torch
        from megatron_rl.models.parallel import ParallelLayout  # lazy: imports torch

        layout = ParallelLayout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp)
        kw = dict(layout=layout, dtype=parse_dtype(args.dtype), verify=args.verify, overwrite=args.overwrite,
                  show_progress=not args.no_progress)
        if args.direction == "hf-to-dist":
            summary = convert_hf_to_dist(args.input, args.output, bucket_bytes=parse_size(args.bucket_size, "--bucket-size"),
                                         mtp_num_layers=args.mtp_num_layers, **kw)
            summary = {k: summary[k] for k in ("format", "family", "dtype", "seconds", "verified")} | \
                {"output": os.path.abspath(args.output), "files": len(summary.get("files", []))}
        else:
            summary = convert_dist_to_hf(args.input, args.output, hf_config_dir=args.hf_config,
                                         max_shard_size=args.max_shard_size, merge_lora=args.merge_lora,
                                         lora_base=args.lora_base,
                                         bucket_bytes=parse_size(args.bucket_size, "--bucket-size"), **kw)
    except MegatronRLError as e:
        _remove_temp_output(args.output)
        print(f"convert_ckpt.py {args.direction}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        _remove_temp_output(args.output)
        print(f"convert_ckpt.py {args.direction}: interrupted; --output {args.output} was not written or changed "
              "(the partial temp dir was removed)", file=sys.stderr)
        return 130
    finally:
        _shutdown()
    return _report(args, summary)


def _report(args, summary: dict) -> int:
    if _is_rank0():
        if args.json:
            print(json.dumps(summary, sort_keys=True))
        else:
            print(f"{args.direction}: wrote {summary.get('output')} ({summary.get('dtype')}, "
                  f"{summary.get('seconds')} s{', verified bit-exact' if summary.get('verified') else ''})")
        if summary.get("note"):
            print(f"convert_ckpt.py {args.direction}: note: {summary['note']}", file=sys.stderr)
    return 0


def _remove_temp_output(output: str) -> None:
    """A failed or interrupted conversion leaves no partial output: the output is published only by
    renaming its hidden temp sibling into place, so removing that sibling is the whole clean-up."""
    if _is_rank0():
        import shutil

        shutil.rmtree(temp_dir_for(output), ignore_errors=True)


def _is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _shutdown() -> None:
    dist = sys.modules.get("torch.distributed")  # never imported here: a Ctrl-C may have cut torch's import short
    if dist is not None and getattr(dist, "is_initialized", lambda: False)():
        try:
            from megatron_rl.models.parallel import destroy_parallel  # lazy: imports torch

            destroy_parallel()
        finally:
            dist.destroy_process_group()


def main_translated(translate: Callable[[Optional[list[str]]], list[str]], argv=None) -> int:
    """``main`` over another command line (slime's converter commands): ``translate`` turns it into this tool's;
    its usage errors and refusals (``SystemExit``) become the exit code."""
    try:
        return main(translate(argv))
    except SystemExit as e:  # argparse's usage errors and the translation's refusals
        return int(e.code or 0)


def _entry(run: Callable[[], int] = main) -> int:
    """The command line's entry (``run``: this tool's ``main``, or a slime-named entry point's over it)."""
    global _in_main
    _in_main = True
    try:
        return run()
    except KeyboardInterrupt:  # outside main's own handling (the arguments, the summary line)
        print("convert_ckpt.py: interrupted; an --output is either whole or was not written (it appears only when "
              "complete)", file=sys.stderr)
        return 130


if __name__ == "__main__":  # the torch_dist writer spawns helpers: keep module import side-effect free
    sys.exit(_entry())

"""Check that megatron-core, at any parallel layout, reproduces HF transformers' logits.

Run under torchrun (or plain python for one rank)::

    torchrun --nproc-per-node 2 tools/check_parity.py --hf-checkpoint DIR \
        --tensor-model-parallel-size 2 [--sequence-parallel] [--json]

Loads the HF checkpoint into megatron-core (streaming, each rank reads its own
slices), runs a random batch of sequences of different lengths through megatron's
``get_forward_backward_func`` (forward only; packed THD when PackedCoreAttention is
available, padded otherwise) and through ``transformers`` on rank 0, and prints
per-sequence max |delta logit| and next-token log-prob delta. Exit status 1 when
the max logit delta exceeds ``--tolerance``; 2 for a refused configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv=None):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--hf-checkpoint", required=True, help="HF checkpoint dir (config.json + safetensors)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1)
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    p.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    p.add_argument("--context-parallel-size", type=int, default=1)
    p.add_argument("--expert-model-parallel-size", type=int, default=1)
    p.add_argument("--expert-tensor-parallel-size", type=int, default=None)
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--seq-lengths", default="17,9,24,5", help="comma-separated sequence lengths")
    p.add_argument("--num-microbatches", type=int, default=None,
                   help="default: pipeline size when interleaved (VPP), else 1")
    p.add_argument("--padded", action="store_true", help="use padded [b, s] input even if THD is available")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tolerance", type=float, default=1e-4)
    p.add_argument("--json", action="store_true", help="print one JSON object (rank 0)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    # lazy: these import torch (~2 s); --help and argument errors answer without it
    from megatron_rl.errors import MegatronRLError
    from megatron_rl.models import get_bridge, parity
    from megatron_rl.models.parallel import ParallelLayout, initialize_parallel
    from megatron_rl.models.spec import supports_packed_sequences

    layout = ParallelLayout(tp=args.tensor_model_parallel_size, pp=args.pipeline_model_parallel_size,
                            vpp=args.virtual_pipeline_model_parallel_size, cp=args.context_parallel_size,
                            ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
                            sequence_parallel=args.sequence_parallel)
    try:
        bridge = get_bridge(args.hf_checkpoint)
        initialize_parallel(layout, seed=args.seed)
        if hasattr(bridge, "vision_shapes"):  # a vision-language model: samples with images
            return _vision_language(args, bridge, layout)
        packed = supports_packed_sequences() and not args.padded
        chunks = bridge.build_model(layout)
        bridge.load_hf_weights(chunks, args.hf_checkpoint)
        for c in chunks:
            c.eval()
        lengths = [int(x) for x in args.seq_lengths.split(",")]
        num_mb = args.num_microbatches or (layout.pp if (layout.vpp or 1) > 1 else 1)
        mbs = parity.random_microbatches(bridge.vocab_size, lengths, num_mb, args.seed)
        with torch.no_grad():
            logits = parity.megatron_run(chunks, mbs, bridge.vocab_size, packed=packed, forward_only=True)
    except MegatronRLError as exc:
        print(f"check_parity: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    rank = torch.distributed.get_rank()
    ok = True  # rank 0 decides; the others take its verdict
    if rank == 0:
        reference = parity.hf_logits(parity.load_hf_model(args.hf_checkpoint), mbs)
        seqs = [s for mb in mbs for s in mb.seqs]
        result = parity.compare(logits, reference, seqs)
        result.update(layout=layout.describe(), model=os.path.abspath(args.hf_checkpoint),
                      family=bridge.family, packed=packed, world_size=torch.distributed.get_world_size(),
                      tolerance=args.tolerance)
        ok = result["max_abs_logit_diff"] <= args.tolerance
        result["ok"] = ok
        if args.json:
            print(json.dumps(result))
        else:
            print(f"model {bridge.family} {args.hf_checkpoint}  layout {layout.describe()}  "
                  f"world {result['world_size']}  input {'packed THD' if packed else 'padded'}")
            for i, p in enumerate(result["per_sequence"]):
                print(f"  seq {i} len {p['length']:4d}  max|dlogit| {p['max_abs_logit_diff']:.3e}  "
                      f"max|dlogprob| {p['max_abs_logprob_diff']:.3e}")
            print(f"max |delta logit| {result['max_abs_logit_diff']:.3e}  max |delta logprob| "
                  f"{result['max_abs_logprob_diff']:.3e}  tolerance {args.tolerance:g}  "
                  f"{'OK' if ok else 'FAIL'}")
    return _verdict_and_close(ok)


def _verdict_and_close(ok: bool) -> int:
    """Rank 0's verdict (0 or 1) on every rank, then the groups torn down: every rank exits with the same code."""
    import torch

    from megatron_rl.models.parallel import destroy_parallel

    flag = torch.tensor([0 if ok else 1])
    torch.distributed.broadcast(flag, src=0)
    destroy_parallel()
    torch.distributed.destroy_process_group()
    return int(flag.item())


def _vision_language(args, bridge, layout) -> int:
    """A vision-language checkpoint: one sample per ``--seq-lengths`` entry (text tokens), every other one with a
    random image of 2x2 merged patches, packed THD micro-batches (``--padded``: one sample per micro-batch;
    ``megatron_rl.models.vlm_parity``), against HF's own model given the same ids, pixels and grids."""
    import torch

    from megatron_rl.models import vlm_parity

    chunks = bridge.build_model(layout)
    bridge.load_hf_weights(chunks, args.hf_checkpoint)
    for c in chunks:
        c.eval()
    m = bridge.spatial_merge_size
    lengths = [int(x) for x in args.seq_lengths.split(",")]
    samples = vlm_parity.random_samples(bridge, [(n, [(1, 2 * m, 2 * m)] if i % 2 == 0 else [])
                                                 for i, n in enumerate(lengths)], args.seed)
    packed = not args.padded
    if packed:  # --num-microbatches THD batches (default 1)
        num_mb = args.num_microbatches or 1
        bounds = [round(i * len(samples) / num_mb) for i in range(num_mb + 1)]
        microbatches = [samples[a:b] for a, b in zip(bounds, bounds[1:])]
    else:
        microbatches = [[s] for s in samples]
    with torch.no_grad():
        logits = vlm_parity.megatron_run(chunks, microbatches, bridge.vocab_size, forward_only=True, packed=packed)
    ok = True  # rank 0 decides; the others take its verdict
    if torch.distributed.get_rank() == 0:
        hf = vlm_parity.load_hf_model(args.hf_checkpoint)
        with torch.no_grad():
            reference = [vlm_parity.hf_forward(hf, s, bridge.image_token_id) for s in samples]
        from megatron_rl.models import parity

        result = parity.compare(logits, reference, [s.input_ids for s in samples])
        ok = result["max_abs_logit_diff"] <= args.tolerance
        result.update(layout=layout.describe(), model=os.path.abspath(args.hf_checkpoint), family=bridge.family,
                      packed=packed, images=[0 if s.image_grid_thw is None else len(s.image_grid_thw) for s in samples],
                      world_size=torch.distributed.get_world_size(), tolerance=args.tolerance, ok=ok)
        if args.json:
            print(json.dumps(result))
        else:
            print(f"model {bridge.family} {args.hf_checkpoint}  layout {layout.describe()}  "
                  f"world {result['world_size']}  input {'packed THD' if packed else 'one sample per micro-batch'}, "
                  f"images per sample {result['images']}")
            print(f"max |delta logit| {result['max_abs_logit_diff']:.3e}  max |delta logprob| "
                  f"{result['max_abs_logprob_diff']:.3e}  tolerance {args.tolerance:g}  {'OK' if ok else 'FAIL'}")
    return _verdict_and_close(ok)


if __name__ == "__main__":
    sys.exit(main())

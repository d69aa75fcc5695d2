"""Conversion worker for tests/convert/test_convert_roundtrip.py and tests/dist/test_convert.py.

One process runs many conversions (imports and the torch_dist writer's helper
start once), writes ``results.json`` into ``--out`` and leaves the produced dirs
there for the test to compare with the sources.

``--mode roundtrip`` (plain python, one process): for every ``--family``
HF -> torch_dist -> HF with --verify (small shards), a bfloat16 conversion, and
the dist->HF refusals that need a real torch_dist dir.

``--mode layouts`` (torchrun, 2 ranks): HF -> torch_dist written at TP1 (DP2) and
TP2, each exported back to HF at other layouts (TP2 / TP1 / PP2, EP2 and TP2xEP2 for MoE families).

Both modes also check that the streaming writer's output is the checkpoint
``dist_checkpointing.save`` writes for the same model loaded in memory
(:func:`same_as_megatron_save`), at TP1 in one process and at TP2 / PP2 / EP2
under torchrun.
"""

from __future__ import annotations

import argparse
import json
import os


def _expect_refusal(fn, *needles) -> str:
    from megatron_rl.errors import MegatronRLError

    try:
        fn()
    except MegatronRLError as e:
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        if missing:
            raise AssertionError(f"refusal does not name {missing}: {msg}") from e
        return msg
    raise AssertionError("conversion was not refused")


def _dcp_contents(path: str) -> dict:
    """Every entry of a torch_dist dir as full tensors / bytes (no process group needed)."""
    import io

    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    target = os.path.join(path + ".contents.pt")
    dcp_to_torch_save(path, target)
    sd = torch.load(target, weights_only=False)
    os.remove(target)
    meta = FileSystemReader(path).read_metadata()
    return {"entries": {k: (v.getvalue() if isinstance(v, io.BytesIO) else v) for k, v in sd.items()},
            "metadata": meta.state_dict_metadata,
            "common": torch.load(os.path.join(path, "common.pt"), weights_only=False),
            "metadata.json": open(os.path.join(path, "metadata.json")).read()}


def same_as_megatron_save(hf: str, streamed: str, layout, scratch: str, mtp_num_layers: int = 0) -> list:
    """Collective. Save ``hf`` loaded into a real model with ``dist_checkpointing.save`` at
    ``layout`` and compare with ``streamed`` (written at the same layout): same .metadata
    (keys, global shapes, chunk offsets/sizes, dtypes), common.pt, metadata.json and every
    byte of every tensor and ShardedObject. Returns the differences (rank 0; [] elsewhere)."""
    import shutil

    import torch
    import torch.distributed as dist

    from megatron_rl.infra.dist import barrier, rank
    from megatron_rl.models import dist_io, get_bridge, model_dir

    bridge = get_bridge(hf, mtp_num_layers=mtp_num_layers)
    dist_io.setup(layout)
    chunks = bridge.build_model(layout)
    bridge.load_hf_weights(chunks, hf)
    if rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        os.makedirs(scratch)
    barrier()
    dist_io.dist_checkpointing().save(dist_io.model_sharded_state_dict(chunks), scratch,
                                      content_metadata={"megatron_rl_format": model_dir.FORMAT})
    dist_io.free(chunks)
    barrier()
    if dist.is_initialized() and dist.get_rank() != 0:
        return []
    a, b = _dcp_contents(streamed), _dcp_contents(scratch)
    diffs = [f"{what} differs" for what in ("metadata", "common", "metadata.json") if a[what] != b[what]]
    if set(a["entries"]) != set(b["entries"]):
        diffs.append(f"entries differ: {sorted(set(a['entries']) ^ set(b['entries']))}")
    for k in sorted(set(a["entries"]) & set(b["entries"])):
        x, y = a["entries"][k], b["entries"][k]
        if isinstance(x, torch.Tensor):
            same = isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape and torch.equal(
                x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        else:
            same = x == y
        if not same:
            diffs.append(f"{k} differs")
    shutil.rmtree(scratch)
    return diffs


def roundtrip(args) -> dict:
    import torch

    from megatron_rl.convert.dist_to_hf import convert_dist_to_hf
    from megatron_rl.convert.hf_to_dist import convert_hf_to_dist
    from megatron_rl.models.hf_tiny import build_tiny_hf_model
    from megatron_rl.models.parallel import ParallelLayout

    out = {}
    lay = ParallelLayout()
    for fam in args.family:
        hf = build_tiny_hf_model(fam, os.path.join(args.out, f"{fam}_hf"))
        d = os.path.join(args.out, f"{fam}_dist")
        back = os.path.join(args.out, f"{fam}_back")
        convert_hf_to_dist(hf, d, layout=lay, verify=True, show_progress=False)
        # 30KB buckets: the streaming reader loads a few parameters per dist_checkpointing.load
        s = convert_dist_to_hf(d, back, layout=lay, verify=True, max_shard_size="200KB", show_progress=False,
                               bucket_bytes=30_000)
        out[fam] = {"hf": hf, "dist": d, "back": back, "shards": s["files"],
                    "vs_megatron_save": same_as_megatron_save(hf, d, lay, os.path.join(args.out, "ref"))}
    fam = args.family[0]
    hf = out[fam]["hf"]
    small = os.path.join(args.out, f"{fam}_dist_small_buckets")  # many .distcp files per rank
    convert_hf_to_dist(hf, small, layout=lay, show_progress=False, bucket_bytes=20_000)
    out["small_buckets"] = {"files": len([f for f in os.listdir(small) if f.endswith(".distcp")]),
                            "vs_megatron_save": same_as_megatron_save(hf, small, lay, os.path.join(args.out, "ref"))}
    tied_hf = build_tiny_hf_model(fam, os.path.join(args.out, "tied_hf"), tie_word_embeddings=True)
    tied_dist, tied_back = os.path.join(args.out, "tied_dist"), os.path.join(args.out, "tied_back")
    convert_hf_to_dist(tied_hf, tied_dist, layout=lay, verify=True, show_progress=False)
    convert_dist_to_hf(tied_dist, tied_back, layout=lay, verify=True, show_progress=False, bucket_bytes=30_000)
    out["tied"] = {"hf": tied_hf, "back": tied_back,
                   "vs_megatron_save": same_as_megatron_save(tied_hf, tied_dist, lay, os.path.join(args.out, "ref"))}
    d16 = os.path.join(args.out, f"{fam}_dist_bf16")
    convert_hf_to_dist(hf, d16, layout=lay, dtype=torch.bfloat16, verify=True, show_progress=False)
    back16 = os.path.join(args.out, f"{fam}_back_bf16")
    convert_dist_to_hf(d16, back16, layout=lay, verify=True, show_progress=False)
    back32 = os.path.join(args.out, f"{fam}_back_bf16_to_fp32")
    convert_dist_to_hf(d16, back32, layout=lay, dtype=torch.float32, verify=True, show_progress=False)
    out["bf16"] = {"hf": hf, "back": back16, "back_fp32": back32}

    # refusals that need a real torch_dist dir
    other = build_tiny_hf_model(fam, os.path.join(args.out, "other_hidden"), hidden_size=32)
    refusals = {}
    refusals["fingerprint"] = _expect_refusal(
        lambda: convert_dist_to_hf(out[fam]["dist"], os.path.join(args.out, "x1"), hf_config_dir=other,
                                   show_progress=False), "hidden_size", "64", "32", "--hf-config")
    if "qwen3" in out and "llama" in out:
        refusals["keys"] = _expect_refusal(
            lambda: convert_dist_to_hf(out["qwen3"]["dist"], os.path.join(args.out, "x2"),
                                       hf_config_dir=out["llama"]["hf"], show_progress=False),
            "self_attention.q_layernorm.weight", "map to no parameter")
    refusals["exists"] = _expect_refusal(
        lambda: convert_dist_to_hf(out[fam]["dist"], out[fam]["back"], show_progress=False), "--overwrite")
    for x in ("x1", "x2"):
        assert not os.path.exists(os.path.join(args.out, x)), f"refused conversion left output {x}"
    out["refusals"] = refusals
    return out


def layouts(args) -> dict:
    import torch.distributed as dist

    from megatron_rl.convert.dist_to_hf import convert_dist_to_hf
    from megatron_rl.convert.hf_to_dist import convert_hf_to_dist
    from megatron_rl.models import get_bridge
    from megatron_rl.models.hf_tiny import build_tiny_hf_model
    from megatron_rl.models.parallel import ParallelLayout, initialize_parallel

    initialize_parallel(ParallelLayout())  # the process group, for the barrier below
    rank = int(os.environ.get("RANK", "0"))
    out = {}
    for fam in args.family:
        hf = os.path.join(args.out, f"{fam}_hf")
        if rank == 0:
            build_tiny_hf_model(fam, hf, seed=3)
        dist.barrier()
        moe = get_bridge(hf).moe
        d1 = os.path.join(args.out, f"{fam}_dist_tp1")
        d2 = os.path.join(args.out, f"{fam}_dist_tp2")
        convert_hf_to_dist(hf, d1, layout=ParallelLayout(), show_progress=False)  # TP1 x DP2
        convert_hf_to_dist(hf, d2, layout=ParallelLayout(tp=2), verify=True, show_progress=False)
        # the streaming writer at parallel layouts vs megatron's save of the loaded model
        written = {"tp2": (d2, ParallelLayout(tp=2))}
        if moe:
            written["ep2"] = (os.path.join(args.out, f"{fam}_dist_ep2"), ParallelLayout(ep=2))
        else:
            written["pp2"] = (os.path.join(args.out, f"{fam}_dist_pp2"), ParallelLayout(pp=2))
            # tied embeddings at PP2: the last stage's output layer shares the first stage's embedding
            tied_hf = os.path.join(args.out, f"{fam}_tied_hf")
            if rank == 0:
                build_tiny_hf_model(fam, tied_hf, seed=4, tie_word_embeddings=True)
            dist.barrier()
            tied_dist = os.path.join(args.out, f"{fam}_tied_dist_pp2")
            convert_hf_to_dist(tied_hf, tied_dist, layout=ParallelLayout(pp=2), verify=True, show_progress=False)
            vs_tied = same_as_megatron_save(tied_hf, tied_dist, ParallelLayout(pp=2), os.path.join(args.out, "ref"))
        vs_megatron = {}
        for name, (dst, lay) in written.items():
            if dst != d2:
                convert_hf_to_dist(hf, dst, layout=lay, show_progress=False)
            vs_megatron[name] = same_as_megatron_save(hf, dst, lay, os.path.join(args.out, "ref"))
        exports = {"tp1_to_tp2": (d1, ParallelLayout(tp=2)), "tp2_to_pp2": (d2, ParallelLayout(pp=2)),
                   "tp2_to_tp1": (d2, ParallelLayout())}
        if moe:
            exports["tp2_to_ep2"] = (d2, ParallelLayout(ep=2))
            exports["tp1_to_tp2ep2"] = (d1, ParallelLayout(tp=2, ep=2, etp=1))
        got = {}
        for name, (src, lay) in exports.items():
            dst = os.path.join(args.out, f"{fam}_{name}")
            convert_dist_to_hf(src, dst, layout=lay, verify=True, max_shard_size="300KB", show_progress=False)
            got[name] = dst
        if not moe:
            vs_megatron["pp2_tied"] = vs_tied
        out[fam] = {"hf": hf, "exports": got, "vs_megatron_save": vs_megatron}
    if args.mtp:
        out["glm4_moe_mtp"] = mtp_layouts(args.out, rank)
    return out


def mtp_layouts(root: str, rank: int) -> dict:
    """A glm4_moe checkpoint with its MTP layer: written at PP2 (the MTP block on the last stage; the streaming
    writer == dist_checkpointing.save of the loaded model), exported at TP2 and TP1."""
    import torch.distributed as dist

    from megatron_rl.convert.dist_to_hf import convert_dist_to_hf
    from megatron_rl.convert.hf_to_dist import convert_hf_to_dist
    from megatron_rl.models.hf_tiny import build_tiny_hf_model
    from megatron_rl.models.parallel import ParallelLayout

    hf, dst = os.path.join(root, "glm4_moe_mtp_hf"), os.path.join(root, "glm4_moe_mtp_dist_pp2")
    if rank == 0:
        build_tiny_hf_model("glm4_moe", hf, seed=5, mtp=True)
    dist.barrier()
    convert_hf_to_dist(hf, dst, layout=ParallelLayout(pp=2), verify=True, show_progress=False, mtp_num_layers=1)
    vs = same_as_megatron_save(hf, dst, ParallelLayout(pp=2), os.path.join(root, "ref"), mtp_num_layers=1)
    got = {}
    for name, lay in (("pp2_to_tp2", ParallelLayout(tp=2, etp=1)), ("pp2_to_tp1", ParallelLayout())):
        got[name] = os.path.join(root, f"glm4_moe_mtp_{name}")
        convert_dist_to_hf(dst, got[name], layout=lay, verify=True, show_progress=False)
    return {"hf": hf, "exports": got, "vs_megatron_save": {"pp2": vs}}


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=["roundtrip", "layouts"], required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", nargs="+", required=True)
    ap.add_argument("--mtp", action="store_true", help="layouts: also a glm4_moe checkpoint with its MTP layer")
    args = ap.parse_args(argv)
    result = roundtrip(args) if args.mode == "roundtrip" else layouts(args)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump(result, f, indent=2)


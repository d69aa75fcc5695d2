"""slime's converter commands (tools/convert_hf_to_torch_dist.py, tools/convert_torch_dist_to_hf.py) over
tools/convert_ckpt.py: slime's arguments unchanged, the MODEL_ARGS checked against config.json, and the
outputs equal convert_ckpt.py's byte for byte (a tiny DeepSeek-V3: MLA, grouped sigmoid router, shared expert).
"""

from __future__ import annotations

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "tools"))
import convert_ckpt  # noqa: E402
import convert_hf_to_torch_dist  # noqa: E402
import convert_torch_dist_to_hf  # noqa: E402

from megatron_rl.models.model_dir import MARKER_NAME  # noqa: E402


def deepseek_v3_model_args(layers: int = 4, qk_head_dim: int = 16) -> list[str]:
    """slime's scripts/models/deepseek-v3.sh with the tiny deepseek_v3's values (models/hf_tiny.py)."""
    return [
        "--disable-bias-linear", "--num-layers", str(layers), "--hidden-size", "64", "--ffn-hidden-size", "128",
        "--num-attention-heads", "4", "--kv-channels", "8", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--norm-epsilon", "1e-6", "--swiglu",
        "--untie-embeddings-and-output-weights", "--vocab-size", "250",
        "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "16", "--qk-head-dim", str(qk_head_dim),
        "--qk-pos-emb-head-dim", "8", "--v-head-dim", "12", "--qk-layernorm", "--rotary-scaling-factor", "4",
        "--rotary-base", "10000", "--mscale", "1.0", "--mscale-all-dim", "0.8", "--attention-softmax-in-fp32",
        "--no-rope-fusion",
        "--num-experts", "4", "--moe-layer-freq", "[0, 1, 1, 1]", "--moe-ffn-hidden-size", "32", "--moe-router-topk",
        "2", "--moe-shared-expert-intermediate-size", "32", "--moe-router-pre-softmax", "--moe-router-score-function",
        "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-load-balancing-type", "seq_aux_loss",
        "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0", "--moe-router-bias-update-rate", "0",
        "--moe-router-group-topk", "1", "--moe-router-num-groups", "2", "--moe-grouped-gemm",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp32", "--moe-permute-fusion",
    ]


def _files(root) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
            for d, _, fs in os.walk(root) for f in fs}


def _save_id(metadata: bytes) -> bytes:
    import pickle

    return pickle.loads(metadata).storage_meta.save_id.encode()


def assert_same_output(a, b):
    """Every file byte for byte, but for the UUID torch.distributed.checkpoint draws at every save (its
    ``.metadata``'s ``save_id``, and so that file's CRC-32 in COMPLETE.json)."""
    fa, fb = _files(a), _files(b)
    assert sorted(fa) == sorted(fb)
    if ".metadata" in fa:
        fb[".metadata"] = fb[".metadata"].replace(_save_id(fb[".metadata"]), _save_id(fa[".metadata"]))
    for name in fa:
        if name == MARKER_NAME and ".metadata" in fa:
            ma, mb = json.loads(fa[name]), json.loads(fb[name])
            for m in (ma, mb):
                m["files"] = [{**f, "crc32": None} if f["path"] == ".metadata" else f for f in m["files"]]
            assert ma == mb, name
        else:
            assert fa[name] == fb[name], f"{name} differs"


def test_slime_converter_commands_equal_convert_ckpt_bitwise(tmp_path, tiny_hf_models, capsys):
    """Each pair writes to the same --output path in turn (torch_dist's .metadata records the dir it was
    written to), the reference moved aside first."""
    src = tiny_hf_models("deepseek_v3")
    dist, ref = tmp_path / "dist", tmp_path / "ref_dist"
    assert convert_ckpt.main(["hf-to-dist", "--input", src, "--output", str(dist), "--no-progress"]) == 0
    dist.rename(ref)
    rc = convert_hf_to_torch_dist.main([*deepseek_v3_model_args(), "--hf-checkpoint", src, "--save", str(dist),
                                        "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    assert_same_output(ref, dist)

    hf, ref_hf = tmp_path / "hf", tmp_path / "ref_hf"
    assert convert_ckpt.main(["dist-to-hf", "--input", str(dist), "--output", str(hf), "--hf-config", src,
                              "--no-progress"]) == 0
    hf.rename(ref_hf)
    capsys.readouterr()
    rc = convert_torch_dist_to_hf.main(["--input-dir", str(dist), "--output-dir", str(hf), "--origin-hf-dir", src,
                                        "--vocab-size", "250", "--model-name", "deepseekv3config", "--no-progress"])
    assert rc == 0 and "--model-name deepseekv3config ignored" in capsys.readouterr().err
    assert_same_output(ref_hf, hf)
    assert _files(hf)["config.json"] == open(os.path.join(src, "config.json"), "rb").read()
    # -f is --overwrite: the previous conversion's output is replaced
    assert convert_torch_dist_to_hf.main(["--input-dir", str(dist), "--output-dir", str(hf), "-f",
                                          "--no-progress"]) == 0


def test_model_args_that_disagree_with_config_json_are_refused_before_writing(tmp_path, tiny_hf_models, capsys):
    """slime's --qk-head-dim is the no-RoPE part (qk_nope_head_dim), not the whole head (qk_head_dim 24)."""
    src = tiny_hf_models("deepseek_v3")
    out = tmp_path / "dist"
    capsys.readouterr()
    rc = convert_hf_to_torch_dist.main([*deepseek_v3_model_args(layers=5, qk_head_dim=24), "--hf-checkpoint", src,
                                        "--save", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert "--num-layers 5 does not match" in err and "num_hidden_layers gives 4" in err, err
    assert "--qk-head-dim 24 does not match" in err and "qk_nope_head_dim gives 16" in err, err
    rc = convert_hf_to_torch_dist.main(["--hf-checkpoint", src, "--save", str(out), "--padded-vocab-size", "256",
                                        "--custom-model-provider-path", "m:f"])
    err = capsys.readouterr().err
    assert rc == 2 and "--padded-vocab-size 256: refused" in err and "--custom-model-provider-path m:f: refused" in err


def test_dist_to_hf_refusals_name_the_flag(tmp_path, tiny_hf_models, capsys):
    src = tiny_hf_models("deepseek_v3")
    dist = tmp_path / "dist"
    assert convert_hf_to_torch_dist.main(["--hf-checkpoint", src, "--save", str(dist), "--no-progress"]) == 0
    capsys.readouterr()
    out = tmp_path / "hf"
    rc = convert_torch_dist_to_hf.main(["--input-dir", str(dist), "--output-dir", str(out), "--vocab-size", "256",
                                        "-a"])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert "--vocab-size 256:" in err and "gives vocab_size 250" in err, err
    assert "-a/--add-missing-from-origin-hf: refused" in err, err

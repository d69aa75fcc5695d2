"""torch_dist checkpoints of MegatronBackend: exact resume, resharding, refusal of bad dirs.

Three launches (tests/dist/scripts/ckpt_worker.py):

1. 2 ranks: for DP2 + ``--use-distributed-optimizer``, for TP2 (plain
   optimizer) and for TP2 + LoRA adapters (``--lora-rank 4``, distributed optimizer, base frozen):
   4 uninterrupted steps, and 2 steps + save.
2. 2 ranks, a FRESH process: load each checkpoint + 2 steps. Must equal the
   uninterrupted run BITWISE: per-step metrics (loss, grad norm, lr...), exported
   HF weights, every rank's optimizer state (param, exp_avg, exp_avg_sq, step) and
   the RNG streams (python, numpy, torch, megatron tracker) on every rank.
   Also: the TP2 checkpoint is loaded at PP2 x VPP2 (model0/model1) and re-saved.
3. 1 rank (TP1): the TP2 checkpoint loads (model + optimizer resharded) with
   forward log-probs equal to TP2's at save time, and the next 2 steps match the
   TP2 run; so does the PP2 x VPP2 re-save. Temp / unmarked / truncated / garbage
   checkpoints and one of the other optimizer kind are refused first.

In launch 2 (2 ranks): same-size damage in a ``.distcp`` makes auto-resume
fall back to the previous checkpoint, ``--load ROOT/iter_N`` loads exactly that one or
fails naming it, and a +inf weight on one rank's shard is refused by every rank, naming
the checkpoint and the parameter, with the model left untouched.

The schedule (warm-up 2, cosine decay), weight decay, grad clipping, KL against a
reference snapshot and per-step RNG use make every piece of state matter.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from _resume_checks import JOB, SKIP, assert_resume_bitwise
from _resume_checks import job as _job
from _resume_checks import rec as _rec
from _util import REPO

pytestmark = pytest.mark.dist

LAYOUTS = {"do": ["--use-distributed-optimizer"], "tp": ["--tensor-model-parallel-size", "2"],
           # LoRA adapters (sharded over TP: column B / row A) under the distributed optimizer, base frozen
           "lora": ["--tensor-model-parallel-size", "2", "--use-distributed-optimizer", "--lora-rank", "4",
                    "--lora-alpha", "8"]}
# the same with PEFT's modules_to_save trained in full beside the adapters (embedding, output layer, every norm)
LAYOUTS["lora_saved"] = LAYOUTS["lora"] + ["--lora-modules-to-save", "embed_tokens", "lm_head", "norm"]
VPP = ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]


def shared_launch(ctx):
    """Two phases of the group's launches (tests/_launches.py): the 2-rank straight and saving runs; then,
    after the corrupt roots, the PEFT export and the damaged copies were made from the saves, the 2-rank
    resumes (fresh processes) and the 1-rank reshard (the phase's 1-rank launch runs after its 2-rank one,
    which writes the VPP checkpoint it loads). Phase 2's jobs load their checkpoints by iteration dir, so the
    damaged copies beside the TP2 one change nothing for them. (out dir, roots, damaged dirs)."""
    hf = ctx.tiny_hf_models("qwen2")
    out = ctx.tmp_path_factory.mktemp("ckpt_out")
    roots = {k: out / f"root_{k}" for k in LAYOUTS}
    saves = {k: str(roots[k] / "iter_0000002") for k in LAYOUTS}
    jobs = []
    for k, flags in LAYOUTS.items():
        jobs += [_job(tag=f"straight_{k}", flags=flags, steps=4),
                 _job(tag=f"save_{k}", flags=flags, steps=2, save=saves[k])]
    yield {2: [(JOB, [hf, out, *jobs])]}
    fb, inf = _corruption_roots(out, saves["tp"])
    jobs = [_job(tag=f"resume_{k}", flags=flags, steps=2, load=saves[k]) for k, flags in LAYOUTS.items()]
    # the LoRA checkpoint's adapters as a PEFT dir, and a fresh run started from it (--lora-load)
    peft = subprocess.run([sys.executable, "tools/convert_ckpt.py", "dist-to-peft", "--input", saves["lora"],
                           "--output", str(out / "lora_peft")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert peft.returncode == 0, peft.stderr[-3000:]
    jobs.append(_job(tag="lora_load", flags=LAYOUTS["lora"] + ["--lora-load", str(out / "lora_peft")], steps=0))
    # interleaved pipeline (model0/model1 keys): load the TP2 checkpoint at PP2 x VPP2 and save it again
    vpp_save = str(out / "root_vpp" / "iter_0000002")
    jobs.append(_job(tag="vpp", flags=VPP, steps=0, load=saves["tp"], save=vpp_save))
    tp = LAYOUTS["tp"]
    jobs.append(_job(tag="poison", flags=tp, steps=0, load=saves["tp"], poison="word_embeddings",
                     save=os.path.join(inf, "iter_0000002")))
    jobs.append(_job(tag="corrupt", flags=tp, steps=0, resume=[
        ["--save", fb], ["--load", os.path.join(fb, "iter_0000002")], ["--load", os.path.join(fb, "iter_0000001")],
        ["--save", inf], ["--load", os.path.join(inf, "iter_0000002")]]))
    # damaged copies of the TP2 checkpoint, next to it (root_tp) and apart (bad*)
    good = saves["tp"]
    temp = str(roots["tp"] / ".iter_0000004.tmp")
    shutil.copytree(good, temp)
    unmarked = str(roots["tp"] / "iter_0000003")
    shutil.copytree(good, unmarked)
    os.remove(os.path.join(unmarked, "COMPLETE.json"))
    truncated = str(out / "bad_trunc" / "iter_0000002")
    shutil.copytree(good, truncated)
    shard = sorted(f for f in os.listdir(truncated) if f.endswith(".distcp"))[0]
    with open(os.path.join(truncated, shard), "r+b") as f:
        f.truncate(100)
    garbage = str(out / "bad_garbage" / "iter_0000002")
    shutil.copytree(good, garbage)
    common = os.path.join(garbage, "common.pt")
    size = os.path.getsize(common)
    with open(common, "wb") as f:
        f.write(b"\0" * size)  # same size: only the reader can tell
    torn = str(out / "bad_torn" / "iter_0000002")  # a torn .distcp zip under a marker without checksums
    shutil.copytree(good, torn)
    with open(os.path.join(torn, shard), "r+b") as f:
        data = bytearray(f.read())
        data[::7] = bytes(b ^ 0x5A for b in data[::7])
        f.seek(0)
        f.write(data)
    marker = json.load(open(os.path.join(torn, "COMPLETE.json")))
    marker["files"] = [{k: v for k, v in e.items() if k != "crc32"} for e in marker["files"]]
    json.dump(marker, open(os.path.join(torn, "COMPLETE.json"), "w"))
    bad = {"temp": temp, "unmarked": unmarked, "truncated": truncated, "garbage": garbage, "torn": torn,
           "dist_opt": saves["do"],  # saved with --use-distributed-optimizer, loaded without
           "lora": saves["lora"]}  # a LoRA run's, loaded by a run without adapters
    yield {2: [(JOB, [hf, out, *jobs])],
           1: [(JOB, [hf, out, _job(tag="reshard_tp1", steps=2, load=good, refuse=list(bad.values())),
                      _job(tag="vpp_to_tp1", steps=0, load=vpp_save)])]}
    return out, roots, bad


@pytest.fixture(scope="module")
def ckpt(shared_launch_state):
    return shared_launch_state


def _copy_as(src, dst, rollout_id):
    """A copy of checkpoint ``src`` whose extra_state says ``rollout_id``, re-sealed as a save would."""
    from megatron_rl.infra.checkpoint_root import MARKER_NAME, file_list

    shutil.copytree(src, dst)
    extra_path = os.path.join(dst, "extra_state.json")
    extra = json.load(open(extra_path))
    extra["rollout_id"] = rollout_id
    json.dump(extra, open(extra_path, "w"))
    meta = json.load(open(os.path.join(dst, MARKER_NAME)))
    meta["files"] = [e for e in file_list(dst) if e["path"] != MARKER_NAME]
    json.dump(meta, open(os.path.join(dst, MARKER_NAME), "w"))


def _corruption_roots(out, good):
    """root_fb: iter_1 (rollout 11) good, iter_2 (rollout 22) with same-size garbage in its largest .distcp;
    root_inf: iter_1 (rollout 11) good, iter_2 written by the "poison" job (a +inf weight)."""
    fb, inf = out / "root_fb", out / "root_inf"
    _copy_as(good, fb / "iter_0000001", 11)
    _copy_as(good, fb / "iter_0000002", 22)
    _copy_as(good, inf / "iter_0000001", 11)
    bad = fb / "iter_0000002"
    shard = max((f for f in os.listdir(bad) if f.endswith(".distcp")), key=lambda f: os.path.getsize(bad / f))
    size = os.path.getsize(bad / shard)
    with open(bad / shard, "r+b") as f:
        f.seek(size // 2)
        f.write(os.urandom(64))
    assert os.path.getsize(bad / shard) == size
    return str(fb), str(inf)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_bitwise_exact(ckpt, layout):
    out, *_ = ckpt
    assert_resume_bitwise(out, layout, nproc=2)


def test_lora_modules_to_save_are_checkpointed_beside_the_adapters(ckpt):
    """--lora-modules-to-save under TP2 + the distributed optimizer: the checkpoint holds the adapters and exactly
    the trained base parameters (once: a save that dropped them from the model entries failed with "Param id 0
    does not match any model sharded param"), the resume is bitwise (test_resume_is_bitwise_exact[lora_saved]),
    and its optimizer state is the adapters' and those modules' (more than the adapters alone)."""
    out, *_ = ckpt
    from megatron_rl.models import dist_io

    saved_dir = out / "root_lora_saved" / "iter_0000002"
    stored = dist_io.checkpoint_model_tensors(str(saved_dir))
    assert set(stored) == {"embedding.word_embeddings.weight", "output_layer.weight", "decoder.final_layernorm.weight",
                           "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                           "decoder.layers.mlp.linear_fc1.layer_norm_weight"}, sorted(stored)
    assert dist_io.checkpoint_adapter_tensors(str(saved_dir))
    meta = json.load(open(saved_dir / "COMPLETE.json"))
    assert meta["lora"]["modules_to_save"] == ["embed_tokens", "lm_head", "norm"] and "lora_base" in meta
    _, _, with_saved = assert_resume_bitwise(out, "lora_saved", nproc=2)
    _, _, adapters_only = assert_resume_bitwise(out, "lora", nproc=2)
    assert all(a > b for a, b in zip(with_saved, adapters_only)), (with_saved, adapters_only)


def test_lora_run_keeps_optimizer_state_for_the_adapters_only(ckpt, tiny_hf_models):
    """The LoRA layout above resumes bitwise (its exported weights are the merged adapters); here: each rank's
    optimizer state covers exactly its adapter shards (r x (in + out) per adapted HF linear, the sharded half
    counted once per TP rank), and the merged weights moved while training."""
    import transformers

    out, *_ = ckpt
    _, w0, sizes = assert_resume_bitwise(out, "lora", nproc=2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_models("qwen2"))
    r, tp, want = 4, 2, 0
    for name, module in hf.named_modules():
        kind = {"q_proj": "col", "k_proj": "col", "v_proj": "col", "gate_proj": "col", "up_proj": "col",
                "o_proj": "row", "down_proj": "row"}.get(name.rsplit(".", 1)[-1])
        if kind == "col":  # A [r, in] replicated, B [out / tp, r]
            want += r * module.in_features + module.out_features // tp * r
        elif kind == "row":  # A [r, in / tp], B [out, r] replicated
            want += r * module.in_features // tp + module.out_features * r
    assert sizes == [want, want], (sizes, want)
    assert want < sum(p.numel() for p in hf.parameters()) / 10
    assert not any("lora" in n for n in w0)  # the engine's names: merged into the base weights
    # the checkpoint holds the adapters (and their optimizer state), not the frozen base: it records the base's
    # digest, which a resume checks against --hf-checkpoint (refused when other weights: test below)
    from megatron_rl.models import dist_io
    from megatron_rl.models.hf_checkpoint import weights_digest

    lora_dir, full_dir = out / "root_lora" / "iter_0000002", out / "root_tp" / "iter_0000002"
    assert dist_io.checkpoint_model_tensors(str(lora_dir)) == {} and dist_io.checkpoint_adapter_tensors(str(lora_dir))
    meta = json.load(open(lora_dir / "COMPLETE.json"))
    assert meta["lora_base"]["weights_digest"] == weights_digest(tiny_hf_models("qwen2"))

    def size(d):
        return sum(f.stat().st_size for f in d.rglob("*") if f.is_file() and f.suffix == ".distcp")

    assert size(lora_dir) < size(full_dir) / 2, (size(lora_dir), size(full_dir))  # 0.34x: the tiny model's adapters are a tenth
    # its base weights alone are not the trained model: dist-to-hf refuses it without --merge-lora
    from peft import PeftModel

    proc = subprocess.run([sys.executable, "tools/convert_ckpt.py", "dist-to-hf", "--input",
                           str(out / "root_lora" / "iter_0000002"), "--output", str(out / "lora_hf"), "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "is a LoRA run's (--lora-rank 4)" in proc.stderr and "--merge-lora" in \
        proc.stderr and "dist-to-peft" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert not (out / "lora_hf").exists()
    # dist-to-peft (run by the fixture): a PEFT dir that peft loads on the base model; merged, it is what the
    # run synced its engine with at that step (the saving job's export of the merged weights)
    cfg = json.load(open(out / "lora_peft" / "adapter_config.json"))
    assert (cfg["peft_type"], cfg["r"], cfg["lora_alpha"]) == ("LORA", 4, 8.0)
    assert sorted(cfg["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"])
    merged = PeftModel.from_pretrained(hf, str(out / "lora_peft")).merge_and_unload().state_dict()
    # its base is the run's --hf-checkpoint (COMPLETE.json's lora_base), so the adapter dir loads alone (was: the
    # checkpoint's hf_config folder, which holds no weights)
    assert cfg["base_model_name_or_path"] == os.path.abspath(tiny_hf_models("qwen2"))
    from peft import AutoPeftModelForCausalLM

    alone = AutoPeftModelForCausalLM.from_pretrained(str(out / "lora_peft")).merge_and_unload().state_dict()
    assert all(torch.equal(alone[n], merged[n]) for n in merged)
    synced = torch.load(out / "save_lora_weights.pt")
    worst = max((synced[n] - merged[n]).abs().max().item() for n in synced)
    assert worst <= 1e-6, worst
    # dist-to-hf --merge-lora: the adapters folded into the base read from the run's --hf-checkpoint (the
    # checkpoint holds no base), checked by digest; a wrong --lora-base is refused naming the fix
    proc = subprocess.run([sys.executable, "tools/convert_ckpt.py", "dist-to-hf", "--merge-lora", "--input",
                           str(lora_dir), "--output", str(out / "lora_merged"), "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from safetensors.torch import load_file

    exported = {k: v for f in sorted((out / "lora_merged").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert set(exported) == set(synced)
    assert max((exported[n] - merged[n]).abs().max().item() for n in exported) <= 1e-6
    proc = subprocess.run([sys.executable, "tools/convert_ckpt.py", "dist-to-hf", "--merge-lora", "--input",
                           str(lora_dir), "--output", str(out / "lora_merged2"), "--no-progress", "--lora-base",
                           tiny_hf_models("qwen3")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "are not the base" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # a new run started from that PEFT dir (--lora-load) computes the checkpoint's log-probs, bit for bit
    assert _rec(out, "lora_load")["logprobs_start"] == _rec(out, "save_lora")["logprobs_end"]


def test_tp2_checkpoint_loads_at_tp1(ckpt):
    out, _, _ = ckpt
    saved, straight, reshard = _rec(out, "save_tp"), _rec(out, "straight_tp"), _rec(out, "reshard_tp1")
    assert reshard["start_step"] == 2 and reshard["extra_state"]["next_step"] == 2
    worst = max(abs(a - b) for x, y in zip(saved["logprobs_end"], reshard["logprobs_start"]) for a, b in zip(x, y))
    assert worst <= 1e-6
    # optimizer state and schedule resharded too: the next steps follow the TP2 run
    for s0, s1 in zip(straight["steps"][2:], reshard["steps"], strict=True):
        for k in set(s0["metrics"]) - SKIP:
            assert s1["metrics"][k] == pytest.approx(s0["metrics"][k], rel=1e-4, abs=1e-5), k
    assert reshard["lr"] == pytest.approx(straight["lr"], rel=1e-12)
    w0 = torch.load(out / "straight_tp_weights.pt")
    w1 = torch.load(out / "reshard_tp1_weights.pt")
    assert max((w0[n] - w1[n]).abs().max().item() for n in w0) < 2e-5
    assert any("RNG states are NOT restored" in w for w in reshard["load_warnings"]), reshard["load_warnings"]


def _max_diff(a, b):
    return max(abs(x - y) for r, s in zip(a, b, strict=True) for x, y in zip(r, s, strict=True))


def test_interleaved_pipeline_checkpoint_roundtrip(ckpt):
    """TP2 -> PP2 x VPP2 (loads into model0/model1, saves them) -> TP1: the same model throughout."""
    out, *_ = ckpt
    saved, vpp, tp1 = _rec(out, "save_tp"), _rec(out, "vpp"), _rec(out, "vpp_to_tp1")
    assert vpp["start_step"] == tp1["start_step"] == 2 and tp1["extra_state"]["next_step"] == 2
    assert _max_diff(saved["logprobs_end"], vpp["logprobs_start"]) <= 1e-6
    assert _max_diff(saved["logprobs_end"], tp1["logprobs_start"]) <= 1e-6
    meta = json.load(open(out / "root_vpp" / "iter_0000002" / "COMPLETE.json"))
    assert (meta["layout"]["pp"], meta["layout"]["vpp"], meta["optimizer_steps"]) == (2, 2, 2)


def test_incomplete_and_corrupt_checkpoints_are_refused(ckpt):
    from megatron_rl.infra.checkpoint_root import find_latest_complete

    out, roots, bad = ckpt
    msgs = _rec(out, "reshard_tp1")["refusals"]
    assert set(msgs) == set(bad.values())
    assert "unpublished temp dir" in msgs[bad["temp"]] and bad["temp"] in msgs[bad["temp"]]
    assert "no COMPLETE.json" in msgs[bad["unmarked"]] and "find_latest_complete" in msgs[bad["unmarked"]]
    assert "corrupt" in msgs[bad["truncated"]] and "COMPLETE.json says" in msgs[bad["truncated"]]
    # same-size garbage: refused by its checksum, naming the file (before it is parsed)
    assert "common.pt has CRC-32" in msgs[bad["garbage"]] and bad["garbage"] in msgs[bad["garbage"]]
    # a torn .distcp under a marker without checksums: the load's own error, one line, naming the dir
    assert f"loading checkpoint {bad['torn']} failed (rank 0: RuntimeError: PytorchStreamReader" in msgs[bad["torn"]]
    assert "Traceback" not in msgs[bad["torn"]]
    assert "--use-distributed-optimizer" in msgs[bad["dist_opt"]] and bad["dist_opt"] in msgs[bad["dist_opt"]]
    assert (f"checkpoint {bad['lora']} holds LoRA adapters --lora-rank 4 --lora-alpha 8 --lora-target-modules "
            "all-linear; this run has no LoRA adapters (full fine-tuning): resume with the checkpoint's --lora-* "
            "flags") in msgs[bad["lora"]], msgs[bad["lora"]]
    # the newest complete checkpoint skips the unmarked iter_0000003 and the temp dir
    assert find_latest_complete(str(roots["tp"])) == 2
    assert find_latest_complete(str(roots["do"])) == 2


def test_corrupt_or_non_finite_checkpoint_falls_back_and_named_load_is_exact(ckpt):
    """On 2 ranks (TP2): every rank reaches the same verdict and the model is never half-loaded."""
    out, *_ = ckpt
    fb, inf = out / "root_fb", out / "root_inf"
    rec = _rec(out, "corrupt")
    assert _rec(out, "poison")["poisoned"].endswith("word_embeddings.weight")
    auto_fb, named_bad, named_good, auto_inf, named_inf = rec["resume"]
    for outcome in (auto_fb, named_bad, named_good, auto_inf, named_inf):
        assert len(outcome) == 2  # both ranks
        assert {k: v for k, v in outcome[0].items() if k != "warnings"} == \
            {k: v for k, v in outcome[1].items() if k != "warnings"}
    # auto-resume: the damaged iter_2 is skipped with a warning naming the file; iter_1 (rollout 11) loads
    assert auto_fb[0]["step"] == 11 and auto_fb[0]["optimizer_steps"] == 2
    warned = " ".join(auto_fb[0]["warnings"])
    assert f"not resuming from {fb / 'iter_0000002'}" in warned and ".distcp has CRC-32" in warned
    # --load of that iteration by name: refused by name, no fallback; --load of iter_1 loads exactly it
    assert named_bad[0]["class"] == "CheckpointError" and f"--load {fb / 'iter_0000002'}" in named_bad[0]["error"]
    assert ".distcp has CRC-32" in named_bad[0]["error"]
    assert named_good[0]["step"] == 11
    # +inf on rank 0's shard only: both ranks refuse, naming checkpoint and parameter; auto-resume falls back
    assert auto_inf[0]["step"] == 11
    warned = " ".join(auto_inf[0]["warnings"] + auto_inf[1]["warnings"])
    assert f"{inf / 'iter_0000002'} holds non-finite (inf/NaN) weights in 1 tensor(s): " in warned
    assert "word_embeddings.weight" in warned
    for r in (0, 1):
        assert "non-finite" in named_inf[r]["error"] and "word_embeddings.weight" in named_inf[r]["error"]
    # the refused loads applied nothing: the model is the good checkpoint's, exactly
    assert _max_diff(_rec(out, "save_tp")["logprobs_end"], rec["logprobs_start"]) <= 1e-6


def test_an_adapter_only_checkpoint_refuses_another_base(tiny_hf_models, tmp_path):
    """A LoRA checkpoint's base is --hf-checkpoint's weights, checked by digest: a copy of the files passes,
    other weights of the same architecture are refused naming both."""
    import shutil
    from types import SimpleNamespace

    from megatron_rl.backends.checkpoint_common import lora_base_record, refuse_other_base
    from megatron_rl.errors import CheckpointError

    def backend(hf):
        return SimpleNamespace(cfg=SimpleNamespace(model=SimpleNamespace(hf_checkpoint=hf),
                                                   lora=SimpleNamespace(lora_rank=4, lora_alpha=8.0,
                                                                        lora_target_modules=["all-linear"])))

    base = tiny_hf_models("qwen2")
    saved = lora_base_record(backend(base))
    copy = shutil.copytree(base, tmp_path / "copy")
    refuse_other_base("ckpt", saved, backend(str(copy)))  # the same weights elsewhere
    other = tiny_hf_models("qwen2", seed=1)
    with pytest.raises(CheckpointError, match=r"holds LoRA adapters trained on the base .*qwen2.* this run's "
                                              r"--hf-checkpoint .* has other weights"):
        refuse_other_base("ckpt", saved, backend(other))


def test_dist_to_peft_names_the_recorded_base_not_the_weightless_hf_config(tiny_hf_models, tmp_path):
    """base_model_name_or_path of dist-to-peft's adapter_config.json: the base recorded in COMPLETE.json
    (``lora_base``), or --lora-base (digest checked); was the checkpoint's hf_config folder, which holds no
    weights (AutoPeftModelForCausalLM failed). A base that is not on this machine, or an older checkpoint with
    no record, is written with a note naming --lora-base. The real export: test_lora_run_keeps_optimizer_state_
    for_the_adapters_only loads it with AutoPeftModelForCausalLM."""
    import shutil

    from megatron_rl.convert.lora_export import peft_base
    from megatron_rl.errors import CheckpointError
    from megatron_rl.models.hf_checkpoint import weights_digest

    hf = tiny_hf_models("qwen2")
    meta = {"lora_base": {"hf_checkpoint": hf, "weights_digest": weights_digest(hf)}}
    assert peft_base("ckpt", meta) == (hf, None)
    copy = str(shutil.copytree(hf, tmp_path / "copy"))
    assert peft_base("ckpt", meta, copy) == (copy, None)
    with pytest.raises(CheckpointError, match="are not the base"):
        peft_base("ckpt", meta, tiny_hf_models("qwen2", seed=1))
    gone = {"lora_base": {**meta["lora_base"], "hf_checkpoint": str(tmp_path / "elsewhere")}}
    base, note = peft_base("ckpt", gone)
    assert base == str(tmp_path / "elsewhere") and "does not exist on this machine" in note and "--lora-base" in note
    base, note = peft_base("ckpt", {})
    assert base == "" and "records no HF base" in note and "--lora-base" in note

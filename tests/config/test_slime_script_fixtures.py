"""slime's own launch scripts, flag for flag, through ``--dry-run``; and every flag of slime's arguments.py
on docs/migrating-from-slime.md.

The argv of each script is in slime_fixtures/scripts.json: slime's ``scripts/run-*.sh`` (and
``scripts/models/*.sh``) as bash expands them, at the THUDM/slime commit recorded there
(slime_fixtures/extract.py regenerates it); nothing is edited but the path variables ($BASE_DIR,
$BASE_FOLDER, /root/), pointed at local directories. Two runs of each script:

* real shapes: ``--hf-checkpoint`` holds the model's published config.json (no weights: validation and
  the planner read only config.json), so the scripts' architecture flags are compared with the real
  configs and the plan is the scripts' real layout;
* tiny configs: the same flags with the values restated for a tiny model of the family
  (models/hf_tiny.py, a config that transformers itself writes), as a slime user's own models/*.sh
  for it would state them, and the layout sizes scaled to fit it: no flag added or dropped.

Scripts of families not built here (GLM-4.7-Flash's and GLM-5's), with context parallelism over gated
delta-net layers (Qwen3-Next, Qwen3.5: their tiny runs, at CP 1, pass) or SFT are refused, each for its
stated reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rl.config import parse_config
from megatron_rl.config.validate import collect_errors, is_not_built_yet
from megatron_rl.errors import ConfigError
from test_slime_scripts import DEEPSEEK_R1, GLM45, KIMI_K2  # tests/config is on sys.path (rootdir)

FIXTURES = Path(__file__).resolve().parent / "slime_fixtures"
SCRIPTS = json.loads((FIXTURES / "scripts.json").read_text())
ARGUMENTS = json.loads((FIXTURES / "arguments.json").read_text())

# -- published config.json shapes (huggingface.co/<org>/<model>/config.json) -----------------------------
# moonshotai/Kimi-K2-Thinking: Kimi-K2's architecture with YaRN factor 64 over 262,144 positions and
# rms_norm_eps 1e-5 (as slime's models/kimi-k2-thinking.sh states it)
KIMI_K2_THINKING = {**KIMI_K2, "max_position_embeddings": 262144, "rms_norm_eps": 1e-05,
                    "rope_scaling": {**KIMI_K2["rope_scaling"], "factor": 64.0}}
# moonshotai/Moonlight-16B-A3B: DeepSeek-V3's architecture without a q latent and without YaRN
MOONLIGHT = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
             "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11264, "moe_intermediate_size": 1408,
             "num_hidden_layers": 27, "num_attention_heads": 16, "num_key_value_heads": 16, "n_routed_experts": 64,
             "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
             "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.446, "scoring_func": "sigmoid",
             "topk_method": "noaux_tc", "norm_topk_prob": True, "q_lora_rank": None, "kv_lora_rank": 512,
             "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 163840,
             "rope_theta": 50000.0, "rope_scaling": None, "rms_norm_eps": 1e-05, "tie_word_embeddings": False,
             "max_position_embeddings": 8192}
# Qwen/Qwen3-Next-80B-A3B-Thinking
QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_act": "silu",
              "hidden_size": 2048, "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16,
              "num_key_value_heads": 2, "head_dim": 256, "partial_rotary_factor": 0.25, "rope_theta": 10000000,
              "rms_norm_eps": 1e-06, "vocab_size": 151936, "tie_word_embeddings": False,
              "max_position_embeddings": 262144, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
              "linear_num_value_heads": 32, "num_experts": 512, "num_experts_per_tok": 10,
              "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512, "decoder_sparse_step": 1,
              "mlp_only_layers": [], "norm_topk_prob": True, "router_aux_loss_coef": 0.001}
# Qwen/Qwen3.5-27B's text model (its config.json nests it as text_config of a multimodal model_type qwen3_5)
QWEN35_27B_TEXT = {"model_type": "qwen3_5_text", "hidden_act": "silu", "hidden_size": 5120,
                   "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
                   "num_key_value_heads": 4, "head_dim": 256, "rms_norm_eps": 1e-06, "vocab_size": 248320,
                   "tie_word_embeddings": False, "max_position_embeddings": 262144, "full_attention_interval": 4,
                   "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
                   "linear_num_key_heads": 16, "linear_num_value_heads": 48,
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                       "mrope_section": [11, 11, 10], "mrope_interleaved": True}}
QWEN35_27B = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "text_config": QWEN35_27B_TEXT}
# zai-org/GLM-4.7-Flash and zai-org/GLM-5: their model_types (MLA + MoE; DSA) have no bridge here
GLM47_FLASH = {"architectures": ["Glm4MoeLiteForCausalLM"], "model_type": "glm4_moe_lite", "hidden_size": 2048,
               "num_hidden_layers": 47, "num_attention_heads": 20, "vocab_size": 154880}
GLM5 = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": 6144,
        "num_hidden_layers": 78, "num_attention_heads": 64, "vocab_size": 154880}

# zai-org/GLM-4.5-Air (slime's models/glm4.5-106B-A12B.sh): GLM-4.5's architecture, smaller, no q/k norm
GLM45_AIR = {**GLM45, "hidden_size": 4096, "intermediate_size": 10944, "moe_intermediate_size": 1408,
             "num_hidden_layers": 46, "n_routed_experts": 128, "first_k_dense_replace": 1,
             "routed_scaling_factor": 1.0, "use_qk_norm": False}

#: script -> the config.json its --hf-checkpoint holds
REAL = {
    "scripts/run-deepseek-r1.sh": DEEPSEEK_R1, "scripts/run-kimi-k2-Instruct.sh": KIMI_K2,
    "scripts/run-kimi-k2-Thinking.sh": KIMI_K2_THINKING, "scripts/run-glm4.7-355B-A32B.sh": GLM45,
    "scripts/run-moonlight-16B-A3B.sh": MOONLIGHT, "scripts/run-qwen3-next-80B-A3B.sh": QWEN3_NEXT,
    "scripts/run-qwen3.5-27B.sh": QWEN35_27B_TEXT, "scripts/run-glm4.7-30B-A3B.sh": GLM47_FLASH,
    "scripts/run-glm5-744B-A40B.sh": GLM5, "scripts/run-glm5.2-744B-A40B.sh": GLM5,
    "scripts/run-qwen3.5-35B-A3B-sft.sh": QWEN35_27B_TEXT,
}
# Kimi-K2 in bf16 (this config.json has no fp8 quantization_config): ~2 TB of weights over engines of 16 H100s, and
# the trainer's parameters stay on the GPU while it sleeps (backends/sleep_tiers.py: tier 1 is not built)
OVER_MEMORY = {"scripts/run-kimi-k2-Instruct.sh", "scripts/run-kimi-k2-Thinking.sh"}
DRY_RUNS = ("scripts/run-deepseek-r1.sh", "scripts/run-kimi-k2-Instruct.sh", "scripts/run-kimi-k2-Thinking.sh",
            "scripts/run-glm4.7-355B-A32B.sh", "scripts/run-moonlight-16B-A3B.sh")


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def local_argv(script: str, root: Path, config: dict) -> list[str]:
    """The script's argv with its paths under ``root``: the checkpoint dir holds ``config``, the data files a
    line each (nothing else of the argv changes)."""
    argv = []
    for arg in SCRIPTS["scripts"][script]["argv"]:
        for var in ("$BASE_DIR", "$BASE_FOLDER"):
            arg = arg.replace(var, str(root))
        argv.append(str(root) + arg[len("/root"):] if arg.startswith("/root/") else arg)
    hf = Path(argv[argv.index("--hf-checkpoint") + 1])
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "config.json").write_text(json.dumps(config))
    for arg in argv:
        if arg.endswith(".jsonl"):  # the prompt and eval sets
            Path(arg).parent.mkdir(parents=True, exist_ok=True)
            Path(arg).write_text(json.dumps({"prompt": "1+1?", "label": "2"}) + "\n")
    return argv


def dry_run(argv: list[str], capsys) -> tuple[int, str]:
    from megatron_rl.train import main

    code = main(argv + ["--dry-run"])
    out, err = capsys.readouterr()
    return code, out + err


# -- real shapes -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("script", DRY_RUNS)
def test_the_script_dry_runs_unchanged_on_the_real_config(script, tmp_path, capsys):
    """GLM-4.5 (GLM-4.7's script), DeepSeek-V3 (R1's), Kimi-K2 (Instruct, Thinking) and Moonlight: every flag
    as slime wrote it, checked against the published config.json, planned on the scripts' real layout."""
    argv = local_argv(script, tmp_path, REAL[script])
    if script in OVER_MEMORY:  # the memory estimate's verdict (plan/fit.py) refuses it, naming the engine's shortfall
        code, out = dry_run(argv, capsys)
        assert code == 2 and "verdict: does NOT fit H100-80G" in out, out
        assert "engine weights + trainer residual on rank" in out and "no room for a KV cache" in out, out
        argv = argv + ["--allow-over-memory"]
    code, out = dry_run(argv, capsys)
    assert code == 0 and "dry run: configuration valid" in out and "SGLang engine(s) of" in out, out
    errors = collect_errors(parse_config(argv, validate=False))
    assert all("cannot take effect here" in e or "has no sglang package" in e or "quant_method='fp8'" in e
               for e in errors), errors  # a real run here: only what this machine lacks (and R1's fp8 weights)


def test_uneven_first_and_last_stages_reach_the_plan(tmp_path):
    """--decoder-first/last-pipeline-num-layers (slime's GLM-5.2 script gives both) are planned as megatron-core
    splits the layers: Kimi-K2-Thinking's 61 layers over PP 8 with a 5-layer last stage, and with a first
    stage of 5 too (51 for the 6 middle stages is refused, 6 x 8 + 2 x 6.5 fits neither)."""
    from megatron_rl.config.megatron_flags import megatron_core_kwargs
    from megatron_rl.plan.memory import MegatronLayout

    argv = local_argv("scripts/run-kimi-k2-Thinking.sh", tmp_path, KIMI_K2_THINKING) + ["--dry-run"]
    both = argv + ["--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "6"]
    cfg = parse_config(both, validate=False)
    assert not [e for e in collect_errors(cfg) if not is_not_built_yet(e) and "cannot take effect" not in e]
    kw = megatron_core_kwargs(cfg)["transformer"]
    assert (kw["num_layers_in_first_pipeline_stage"], kw["num_layers_in_last_pipeline_stage"]) == (7, 6)
    layout = MegatronLayout(world=256, tp=8, pp=8, cp=4, ep=32, first_stage_layers=7, last_stage_layers=6)
    assert [len(layout.chunk_layers(61, s, 0)) for s in range(8)] == [7, 8, 8, 8, 8, 8, 8, 6]
    assert layout.chunk_layers(61, 1, 0) == range(7, 15)
    with pytest.raises(ConfigError, match=r"--decoder-first-pipeline-num-layers 5 and "
                                          r"--decoder-last-pipeline-num-layers 5 leave 51 of num_hidden_layers=61 "
                                          r"for the other 6 pipeline stage\(s\)"):
        parse_config(argv + ["--decoder-first-pipeline-num-layers", "5"])


def test_qwen3_next_and_qwen35_scripts_are_refused_for_cp_over_gated_delta_net(tmp_path, capsys):
    """Every flag of slime's Qwen3-Next and Qwen3.5-27B scripts is accepted and agrees with config.json
    (--spec names slime's plugin of the family, --use-gated-attention is --attention-output-gate); their
    context parallelism over gated delta-net layers is refused, by name."""
    for script in ("scripts/run-qwen3-next-80B-A3B.sh", "scripts/run-qwen3.5-27B.sh"):
        argv = local_argv(script, tmp_path / script.split("/")[-1], REAL[script])
        code, out = dry_run(argv, capsys)
        assert code != 0 and "--context-parallel-size 4 with a qwen3_" in out and "gated delta-net" in out, out
        cfg = parse_config(argv, validate=False)
        assert cfg.architecture.attention_output_gate and cfg.architecture.spec[0].startswith("slime_plugins")
        assert not [e for e in collect_errors(cfg) if "does not match" in e or "--spec" in e]


def test_a_spec_of_another_family_is_refused_naming_both(tmp_path):
    argv = local_argv("scripts/run-qwen3-next-80B-A3B.sh", tmp_path, QWEN3_NEXT)
    i = argv.index("--spec")
    argv[i + 1:i + 3] = ["slime_plugins.models.qwen3_5", "get_qwen3_5_spec"]
    errors = collect_errors(parse_config(argv + ["--dry-run"], validate=False))
    assert any("--spec slime_plugins.models.qwen3_5 get_qwen3_5_spec is slime's layer spec for model_type "
               "qwen3_5_text / qwen3_5_moe_text" in e and "'qwen3_next'" in e for e in errors), errors


def test_the_multimodal_qwen35_checkpoint_is_refused_naming_its_text_model(tmp_path, capsys):
    argv = local_argv("scripts/run-qwen3.5-27B.sh", tmp_path, QWEN35_27B)
    code, out = dry_run(argv, capsys)
    assert code != 0 and "model_type 'qwen3_5' is a multimodal checkpoint" in out, out


@pytest.mark.parametrize("script, refused", [
    ("scripts/run-glm5-744B-A40B.sh", ("--enable-experimental", "--allgather-cp", "--data-pad-size-multiplier",
                                       "--prefill-num-servers")),
    ("scripts/run-glm5.2-744B-A40B.sh", ("--enable-experimental", "--allgather-cp", "--data-pad-size-multiplier")),
    ("scripts/run-qwen3.5-35B-A3B-sft.sh", ("--num-epoch", "--loss-mask-type",
                                            "--disable-compute-advantages-and-returns", "--lr-warmup-fraction")),
])
def test_scripts_of_what_is_not_built_are_refused_with_the_reason(script, refused, tmp_path):
    """GLM-5's DSA scripts and slime's SFT script: each flag with no counterpart here is refused with its
    reason (the one docs/migrating-from-slime.md gives), not a bare "unknown flag"."""
    from megatron_rl.config.slime_args import NOT_BUILT

    argv = local_argv(script, tmp_path, REAL[script])
    with pytest.raises(ConfigError) as exc:
        parse_config(argv + ["--dry-run"])
    for flag in refused:
        assert f"unknown flag {flag}: slime's flag is not built here ({NOT_BUILT[flag]})" in str(exc.value), flag
    if "sft" in script:  # with the flags of slime's SFT gone, its loss is refused by name too
        argv = [a for i, a in enumerate(argv) if a not in refused and argv[i - 1] not in refused]
        with pytest.raises(ConfigError, match="--loss-type sft_loss: refused. slime's SFT"):
            parse_config(argv + ["--dry-run"])


def test_glm47_flash_is_refused_for_its_model_type(tmp_path, capsys):
    """GLM-4.7-Flash (MLA + MoE, model_type glm4_moe_lite): every flag is known, the family has no bridge."""
    argv = local_argv("scripts/run-glm4.7-30B-A3B.sh", tmp_path, GLM47_FLASH)
    code, out = dry_run(argv, capsys)
    assert code != 0 and "config.json's model_type 'glm4_moe_lite' has no bridge" in out, out


def test_slime_own_sglang_flags_do_not_reach_sglang(tmp_path):
    """--sglang-server-concurrency is slime's (sglang.launch_server has no such flag): it is a flag here, never
    passed to the servers; slime's --sglang-config (server groups) is refused with the reason."""
    from megatron_rl.rollout.sglang.launcher import _pass_through_args

    argv = local_argv("scripts/run-kimi-k2-Instruct.sh", tmp_path, KIMI_K2)
    cfg = parse_config(argv + ["--dry-run"], validate=False)
    assert cfg.rollout.sglang_server_concurrency == 1024
    assert "--server-concurrency" not in _pass_through_args(cfg.rollout.sglang_args)
    errors = collect_errors(parse_config(argv + ["--dry-run", "--sglang-config", "groups.yaml"], validate=False))
    assert any(e.startswith("--sglang-config is slime's flag, not SGLang's: slime's YAML of SGLang server groups")
               for e in errors), errors


@pytest.mark.parametrize("script, config", [
    ("scripts/models/deepseek-v3.sh", {k: v for k, v in DEEPSEEK_R1.items() if k != "quantization_config"}), ("scripts/models/glm4.5-355B-A32B.sh", GLM45),
    ("scripts/models/glm4.5-106B-A12B.sh", GLM45_AIR)])
def test_model_scripts_state_the_real_configs(script, config, tmp_path):
    """slime's MODEL_ARGS files without a run script here agree flag for flag with the published config.json."""
    from megatron_rl.config.architecture import architecture_errors

    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = parse_config(SCRIPTS["scripts"][script]["argv"] + ["--hf-checkpoint", str(tmp_path)], validate=False)
    assert architecture_errors(cfg) == []


def test_sglang_server_concurrency_bounds_the_requests_through_a_router():
    """slime's N per engine: through a router in front of 2 engines, 2 x N per-sample requests in flight
    (unset: 64 in all)."""
    from megatron_rl.plan.engines import plan_engine_placement
    from megatron_rl.rollout.sglang.engine import SGLangEngine

    placement = plan_engine_placement(num_gpus=4, gpus_per_engine=2, colocate=True, num_nodes=1, gpus_per_node=4,
                                      devices_per_node=None)
    placement = placement.with_urls(["http://127.0.0.1:9", "http://127.0.0.1:10"], ["", ""]).with_router(
        "http://127.0.0.1:11")
    for given, in_flight in ((["--sglang-server-concurrency", "8"], 16), ([], 64)):
        cfg = parse_config(["--rollout-backend", "sglang", "--rollout-num-gpus-per-engine", "2",
                            "--actor-num-gpus-per-node", "4", "--colocate", *given], validate=False)
        engine = SGLangEngine.from_config(cfg, placement)
        try:
            assert engine._router_pool is not None and engine._router_pool._max_workers == in_flight
        finally:
            engine.close()


# -- tiny configs of the families ----------------------------------------------------------------------------
#: what a slime user's models/*.sh states for the tiny model of each family (models/hf_tiny.py)
_TINY_COMMON = {"--num-layers": ["4"], "--hidden-size": ["64"], "--ffn-hidden-size": ["128"],
                "--num-attention-heads": ["4"], "--vocab-size": ["250"], "--rotary-base": ["10000"], "--norm-epsilon": ["1e-6"],
                "--num-experts": ["4"], "--moe-ffn-hidden-size": ["32"], "--moe-router-topk": ["2"],
                "--moe-shared-expert-intermediate-size": ["32"], "--moe-layer-freq": ["[0]*1+[1]*3"]}
TINY_MODEL_ARGS = {
    "glm4_moe": {**_TINY_COMMON, "--num-query-groups": ["2"], "--kv-channels": ["16"],
                 "--moe-router-topk-scaling-factor": ["1.5"]},
    "deepseek_v3": {**_TINY_COMMON, "--kv-channels": ["16"], "--q-lora-rank": ["32"], "--kv-lora-rank": ["16"],
                    "--qk-head-dim": ["16"], "--qk-pos-emb-head-dim": ["8"], "--v-head-dim": ["12"],
                    "--rotary-scaling-factor": ["4"], "--mscale-all-dim": ["0.8"], "--moe-router-num-groups": ["2"],
                    "--moe-router-group-topk": ["1"], "--moe-router-topk-scaling-factor": ["2.5"]},
}
# Kimi-K2's family is DeepSeek-V3's architecture under model_type kimi_k2, one expert group
TINY_MODEL_ARGS["kimi_k2"] = {**TINY_MODEL_ARGS["deepseek_v3"], "--moe-router-num-groups": ["1"]}
# Qwen3-Next / Qwen3.5: gated delta-net and gated attention layers, partial RoPE; Qwen3-Next's first layer dense
TINY_MODEL_ARGS["qwen3_next"] = {**_TINY_COMMON, "--num-query-groups": ["2"], "--kv-channels": ["16"],
                                 "--moe-shared-expert-intermediate-size": ["48"], "--moe-layer-freq": ["[0,1,1,1]"]}
TINY_MODEL_ARGS["qwen3_5_text"] = TINY_MODEL_ARGS["qwen3_next"]
#: the layout scaled to 4 layers, 4 heads, 2 KV groups, 4 experts: 8 ranks of TP 2, PP 2 (a 1-layer last stage
#: where the script makes it uneven), EP 4, engines of 2 GPUs
TINY_LAYOUT = {"--actor-num-nodes": ["1"], "--actor-num-gpus-per-node": ["8"], "--tensor-model-parallel-size": ["2"],
               "--pipeline-model-parallel-size": ["2"], "--context-parallel-size": ["1"],
               "--expert-model-parallel-size": ["4"], "--decoder-last-pipeline-num-layers": ["1"],
               "--rollout-num-gpus-per-engine": ["2"]}
TINY = {"scripts/run-glm4.7-355B-A32B.sh": "glm4_moe", "scripts/run-deepseek-r1.sh": "deepseek_v3",
        "scripts/run-kimi-k2-Instruct.sh": "kimi_k2", "scripts/run-kimi-k2-Thinking.sh": "kimi_k2",
        # CP 1 (TINY_LAYOUT): context parallelism over gated delta-net layers is not built
        "scripts/run-qwen3-next-80B-A3B.sh": "qwen3_next", "scripts/run-qwen3.5-27B.sh": "qwen3_5_text"}


def restated(argv: list[str], values: dict[str, list[str]]) -> list[str]:
    """``argv`` with the values of the flags in ``values`` replaced (each flag keeps its place; none is added
    or dropped)."""
    out, i = [], 0
    while i < len(argv):
        out.append(argv[i])
        if argv[i] in values:
            n = 1
            while i + n < len(argv) and not argv[i + n].startswith("--"):
                n += 1
            out += values[argv[i]]
            i += n
        else:
            i += 1
    return out


def tiny_config_json(family: str) -> dict:
    from megatron_rl.models.hf_tiny import tiny_config

    if family == "kimi_k2":
        return {**tiny_config("deepseek_v3").to_dict(), "model_type": "kimi_k2", "n_group": 1, "topk_group": 1}
    return tiny_config(family).to_dict()


@pytest.mark.parametrize("script", sorted(TINY))
def test_the_script_dry_runs_on_a_tiny_config_of_its_family(script, tmp_path, capsys):
    """The same flags on a tiny model of the family as transformers writes its config.json (rope_parameters,
    not the hub files' rope_scaling): the slime-specific flags (--moe-router-pre-softmax, --mscale,
    --moe-layer-freq's [0]*N+[1]*M, the router flags) agree with it, and the plan fits."""
    family = TINY[script]
    dense = {"--expert-model-parallel-size": ["1"]} if family == "qwen3_5_text" else {}
    argv = restated(local_argv(script, tmp_path, tiny_config_json(family)),
                    {**TINY_MODEL_ARGS[family], **TINY_LAYOUT, **dense})
    assert [a for a in argv if a.startswith("--")] == [
        a for a in SCRIPTS["scripts"][script]["argv"] if a.startswith("--")]  # the same flags, in order
    code, out = dry_run(argv, capsys)
    assert code == 0 and "dry run: configuration valid" in out and "model: 4 layers, 4 heads" in out, out
    assert (":d2p2t2" if dense else ":d2p2t2e4") in out, out


# -- docs/migrating-from-slime.md against slime ---------------------------------------------------------------
def test_every_flag_of_slime_arguments_py_has_a_row():
    from megatron_rl.config.migration import all_slime_flags

    listed = set(all_slime_flags())
    missing = [f for f in ARGUMENTS["flags"] if f not in listed]
    assert not missing, (f"flags of slime's arguments.py (THUDM/slime {ARGUMENTS['commit'][:7]}) missing from "
                         f"docs/migrating-from-slime.md: {missing}")
    assert len(ARGUMENTS["flags"]) > 150  # the extraction found slime's parser


def test_every_flag_of_slime_scripts_has_a_row():
    from megatron_rl.config.migration import all_slime_flags

    listed = set(all_slime_flags())
    used = {a for s in SCRIPTS["scripts"].values() for a in s["argv"] if a.startswith("--")}
    passed_to_sglang = {a for a in used if a.startswith("--sglang-") and a not in listed}
    assert not used - listed - passed_to_sglang, sorted(used - listed - passed_to_sglang)

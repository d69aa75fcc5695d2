"""Megatron-LM architecture and training flags: checked against config.json,
mapped onto megatron-core, refused with the reason where they cannot take effect.

Configs are written as config.json only (validation and the planner read nothing else), except
where the bridge itself is asked for its megatron ``TransformerConfig``.
"""

from __future__ import annotations

import json

import pytest

from megatron_rl.config import parse_config
from megatron_rl.config.architecture import ARCHITECTURE, UNUSED, megatron_view
from megatron_rl.config.schema import parse_moe_layer_freq
from megatron_rl.errors import ConfigError
from megatron_rl.models.families import BRIDGES
from megatron_rl.models.hf_tiny import VL_FAMILIES, tiny_config


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch):
    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def hf_dir(tmp_path, family, **patch):
    d = tmp_path / f"{family}{len(list(tmp_path.iterdir()))}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**tiny_config(family).to_dict(), **patch}))
    return str(d)


def stated_argv(hf: dict) -> list[str]:
    """The Megatron flags that state exactly what config.json ``hf`` describes (a slime MODEL_ARGS)."""
    view = {k: v for k, (_, v) in megatron_view(hf).items()}
    argv = ["--group-query-attention"]
    for row in ARCHITECTURE:
        value = view.get(row.field)
        if row.field in ("group_query_attention", "use_rotary_position_embeddings") or value is None or (
                value is UNUSED):
            continue
        flag = "--" + row.field.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, tuple):  # --spec MODULE FUNCTION
            argv += [flag, *value]
        elif value is not False:
            argv += [flag, str(value) if not isinstance(value, list) else str(value)]
    return argv


@pytest.mark.parametrize("family", sorted(BRIDGES))
def test_megatron_view_agrees_with_the_bridge(family):
    """config/architecture.py reads config.json as the bridge builds the model (the reference)."""
    import torch.nn.functional as F

    from megatron_rl.models import get_bridge
    from megatron_rl.models.parallel import ParallelLayout

    hf = tiny_config(family).to_dict()
    bridge = get_bridge(hf)
    tc = bridge.transformer_config(ParallelLayout())
    view = {k: v for k, (_, v) in megatron_view(hf).items()}
    assert (view["num_layers"], view["hidden_size"], view["num_attention_heads"], view["num_query_groups"],
            view["vocab_size"]) == (tc.num_layers, tc.hidden_size, tc.num_attention_heads, tc.num_query_groups,
                                    bridge.vocab_size)
    assert view["multi_latent_attention"] == tc.multi_latent_attention
    # MLA: rotary_scaling_factor; a YaRN GQA model (gpt-oss): yarn_rotary_scaling_factor
    # gemma3_text, gemma4_text: their layers apply their own RoPE (per layer type); megatron's factor is unread
    assert view["rotary_scaling_factor"] == (UNUSED if family in ("gemma3_text", "gemma4_text") else getattr(
        tc, "rotary_scaling_factor", getattr(tc, "yarn_rotary_scaling_factor", 1.0)))
    assert view["position_embedding_type"] == bridge.position_embedding_type
    if tc.multi_latent_attention:  # megatron's MLA never reads kv_channels: any --kv-channels states nothing
        assert view["kv_channels"] is UNUSED
        # without YaRN (glm_moe_dsa's default RoPE) megatron's MLA scales by mscale(factor 1) = 1: mscale unread
        mscales = (UNUSED, UNUSED) if tc.rope_type == "rope" else (tc.mscale, tc.mscale_all_dim)
        assert (view["q_lora_rank"], view["kv_lora_rank"], view["qk_head_dim"], view["qk_pos_emb_head_dim"],
                view["v_head_dim"], view["mscale"], view["mscale_all_dim"]) == (
            tc.q_lora_rank, tc.kv_lora_rank, tc.qk_head_dim, tc.qk_pos_emb_head_dim, tc.v_head_dim, *mscales)
    else:
        assert view["kv_channels"] == tc.kv_channels
    assert view["ffn_hidden_size"] == tc.ffn_hidden_size and view["norm_epsilon"] == tc.layernorm_epsilon
    assert view["normalization"] == tc.normalization and view["swiglu"] == (tc.gated_linear_unit and tc.activation_func is F.silu)
    assert view["disable_bias_linear"] == (not tc.add_bias_linear) and view["add_qkv_bias"] == tc.add_qkv_bias
    assert view["qk_layernorm"] == tc.qk_layernorm and view["rotary_base"] == bridge.rope_theta
    assert view["attention_output_gate"] == tc.attention_output_gate
    assert view["apply_layernorm_1p"] == (bridge.final_norm().__name__ == "GemmaRMSNorm")  # its gain is 1 + w
    assert view["untie_embeddings_and_output_weights"] == (not bridge.tie_word_embeddings)
    if bridge.moe:
        assert (view["num_experts"], view["moe_ffn_hidden_size"], view["moe_router_topk"],
                view["moe_router_score_function"]) == (tc.num_moe_experts, tc.moe_ffn_hidden_size,
                                                       tc.moe_router_topk, tc.moe_router_score_function)
        assert view["moe_layer_freq"] == tc.moe_layer_freq
        assert view["moe_shared_expert_intermediate_size"] == (tc.moe_shared_expert_intermediate_size or 0)
        assert view["moe_shared_expert_gate"] == tc.moe_shared_expert_gate
        assert (view["moe_router_enable_expert_bias"], view["moe_router_topk_scaling_factor"],
                view["moe_router_num_groups"], view["moe_router_group_topk"]) == (
            tc.moe_router_enable_expert_bias, tc.moe_router_topk_scaling_factor or 1.0,
            tc.moe_router_num_groups or 1, tc.moe_router_group_topk or 1)
        pre_softmax = view["moe_router_pre_softmax"]  # read by megatron for a softmax router only
        assert pre_softmax is UNUSED if tc.moe_router_score_function == "sigmoid" else (
            pre_softmax == tc.moe_router_pre_softmax)
    else:
        assert "num_experts" not in view


@pytest.mark.parametrize("family", sorted(set(BRIDGES) - set(VL_FAMILIES)))  # a VL run: refused (test_vlm.py)
def test_flags_stating_the_config_are_accepted(family, tmp_path):
    hf = tiny_config(family).to_dict()
    cfg = parse_config(["--hf-checkpoint", hf_dir(tmp_path, family), *stated_argv(hf)])
    assert cfg.architecture.num_layers == hf["num_hidden_layers"]


def test_every_mismatch_is_listed_with_flag_values_and_file(tmp_path):
    path = hf_dir(tmp_path, "qwen3_moe")
    with pytest.raises(ConfigError) as exc:
        parse_config(["--hf-checkpoint", path, "--rotary-base", "1000000", "--norm-epsilon", "1e-5",
                      "--moe-router-topk", "8", "--moe-layer-freq", "[0, 1, 1, 1]",
                      "--untie-embeddings-and-output-weights"])
    lines = str(exc.value).splitlines()[1:]
    assert len(lines) == 4, lines  # untie matches (tiny qwen3_moe is untied)
    src = f"{path}/config.json"
    assert any(f"--rotary-base 1000000 does not match {src}: rope_theta gives 10000;" in x for x in lines)
    assert any(f"--norm-epsilon 1e-05 does not match {src}: rms_norm_eps gives 1e-06;" in x for x in lines)
    assert "--moe-router-topk 8" in str(exc.value) and "num_experts_per_tok gives 2" in str(exc.value)
    with pytest.raises(ConfigError, match=r"--moe-layer-freq \[0, 1, 1, 1\] makes layers 1, 2, 3 MoE but .* "
                                          r"makes layers 0-3 \(all\) MoE"):
        parse_config(["--hf-checkpoint", path, "--moe-layer-freq", "[0, 1, 1, 1]"])


def test_gqa_flags_follow_megatron(tmp_path):
    """Megatron-LM: --num-query-groups counts only with --group-query-attention, whose default is 1 group."""
    path = hf_dir(tmp_path, "qwen2")  # 2 KV heads
    with pytest.raises(ConfigError, match="--num-query-groups 2 without --group-query-attention"):
        parse_config(["--hf-checkpoint", path, "--num-query-groups", "2"])
    with pytest.raises(ConfigError, match=r"--group-query-attention without --num-query-groups \(Megatron: 1 "
                                          r"group\) does not match .*num_key_value_heads gives 2"):
        parse_config(["--hf-checkpoint", path, "--group-query-attention"])
    assert parse_config(["--hf-checkpoint", path, "--group-query-attention", "--num-query-groups", "2"])


def test_vocab_size_compares_padded_sizes(tmp_path):
    tp2 = ["--hf-checkpoint", hf_dir(tmp_path, "qwen2", vocab_size=151936), "--actor-num-gpus-per-node", "2",
           "--tensor-model-parallel-size", "2"]
    assert parse_config([*tp2, "--vocab-size", "151936"])
    assert parse_config([*tp2, "--vocab-size", "152000"])  # TP 2: both pad to the same 152064 rows
    with pytest.raises(ConfigError, match=r"multiple of 128 x TP 2 = 256\): 151643 pads to 151808, 151936 pads to "
                                          r"152064; give --vocab-size 151936"):
        parse_config([*tp2, "--vocab-size", "151643"])
    with pytest.raises(ConfigError, match=r"152000 pads to 152064, 151936 pads to 151936"):  # TP 1: 151936 is even
        parse_config(["--hf-checkpoint", tp2[1], "--vocab-size", "152000"])


@pytest.mark.parametrize("text, want", [("1", 1), ("2", 2), ("[1, 0, 1]", [1, 0, 1]),
                                        ("([0]*1+[1]*3)", [0, 1, 1, 1])])
def test_moe_layer_freq_forms(text, want):
    assert parse_moe_layer_freq(text) == want


@pytest.mark.parametrize("text", ["__import__('os')", "[2, 1]", "abc", "[1]*x"])
def test_moe_layer_freq_is_data_not_code(text, tmp_path):
    with pytest.raises(ConfigError, match="--moe-layer-freq"):
        parse_config(["--hf-checkpoint", hf_dir(tmp_path, "qwen3_moe"), "--moe-layer-freq", text])


def test_dry_run_without_the_checkpoint_plans_from_the_flags(tmp_path, capsys):
    from megatron_rl.train import main

    gone = str(tmp_path / "not-here")
    shape = ["--num-layers", "4", "--num-attention-heads", "4", "--group-query-attention", "--num-query-groups",
             "2", "--vocab-size", "250"]
    assert main(["--hf-checkpoint", gone, *shape, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"model: 4 layers, 4 heads, 2 KV groups, vocab 250, from the architecture flags: --hf-checkpoint {gone} " \
           "is not on this machine" in out
    with pytest.raises(ConfigError, match="no config.json there"):  # a real run needs the checkpoint
        parse_config(["--hf-checkpoint", gone, *shape])
    with pytest.raises(ConfigError, match="no config.json there"):  # and so does a dry run without the shape
        parse_config(["--hf-checkpoint", gone, "--num-layers", "4", "--dry-run"])
    with pytest.raises(ConfigError, match="num_key_value_heads=2 .* not divisible by t=4"):  # the plan is checked
        parse_config(["--hf-checkpoint", gone, *shape, "--actor-num-gpus-per-node", "4",
                      "--tensor-model-parallel-size", "4", "--dry-run"])


def test_a_model_type_without_a_bridge_is_refused_by_validation_and_dry_run(tmp_path, capsys):
    """``--dry-run`` said "configuration valid" for an HF dir whose model_type no bridge builds (the real run
    failed 20+ s in, once the model was built). The table validation reads is the bridges' own."""
    from megatron_rl.config.architecture import BRIDGED_MODEL_TYPES, MULTIMODAL_MODEL_TYPES
    from megatron_rl.models import MULTIMODAL_WRAPPERS
    from megatron_rl.models.families import BRIDGES_BY_MODEL_TYPE
    from megatron_rl.train import main

    assert sorted(BRIDGED_MODEL_TYPES) == sorted(BRIDGES_BY_MODEL_TYPE)
    assert MULTIMODAL_MODEL_TYPES == MULTIMODAL_WRAPPERS
    unknown = hf_dir(tmp_path, "llama", model_type="gpt_neox")
    assert main(["--hf-checkpoint", unknown, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert [line for line in err.splitlines() if line.startswith("error:")] == [
        f"error: --hf-checkpoint {unknown}: config.json's model_type 'gpt_neox' has no bridge (supported: "
        f"{', '.join(BRIDGED_MODEL_TYPES)}); convert the model to one of these families or add a bridge "
        "(models/families.py)"], err
    with pytest.raises(ConfigError, match="model_type 'qwen3_5' is a multimodal checkpoint"):
        parse_config(["--hf-checkpoint", hf_dir(tmp_path, "qwen3", model_type="qwen3_5")])
    assert main(["--hf-checkpoint", hf_dir(tmp_path, "llama"), "--dry-run"]) == 0


def test_uneven_last_pipeline_stage(tmp_path):
    path = hf_dir(tmp_path, "qwen3")  # 4 layers
    pp2 = ["--hf-checkpoint", path, "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size", "2"]
    cfg = parse_config([*pp2, "--decoder-last-pipeline-num-layers", "1"])
    assert cfg.parallel.decoder_last_pipeline_num_layers == 1
    with pytest.raises(ConfigError, match="--decoder-last-pipeline-num-layers 4 leaves 0 of num_hidden_layers=4"):
        parse_config([*pp2, "--decoder-last-pipeline-num-layers", "4"])
    with pytest.raises(ConfigError,
                       match=r"--decoder-last-pipeline-num-layers 1: needs --pipeline-model-parallel-size"):
        parse_config(["--hf-checkpoint", path, "--decoder-last-pipeline-num-layers", "1"])


def test_bridge_builds_megatron_config_with_the_mapped_flags(tmp_path):
    """The flags reach megatron-core's TransformerConfig through the backend's overrides, which
    megatron-core accepts (uneven PP included: the even-split check is megatron-core's then)."""
    from megatron.core.transformer.enums import AttnBackend

    from megatron_rl.backends.megatron.settings import layout_from_config, transformer_config_overrides
    from megatron_rl.models import get_bridge

    path = hf_dir(tmp_path, "qwen3_moe", router_aux_loss_coef=0.001)
    cfg = parse_config(["--hf-checkpoint", path, "--actor-num-gpus-per-node", "2", "--pipeline-model-parallel-size",
                        "2", "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "1",
                        "--moe-aux-loss-coeff", "0",
                        "--moe-router-dtype", "fp64", "--hidden-dropout", "0.1", "--attention-backend", "local",
                        "--deterministic-mode", "--moe-token-drop-policy", "probs"])
    tc = get_bridge(path).transformer_config(layout_from_config(cfg), **transformer_config_overrides(cfg))
    assert tc.num_layers_in_first_pipeline_stage == 3
    assert (tc.num_layers_in_last_pipeline_stage, tc.moe_aux_loss_coeff, tc.moe_router_load_balancing_type,
            tc.moe_router_dtype, tc.hidden_dropout, tc.attention_backend, tc.deterministic_mode) == (
        1, 0.0, "none", "fp64", 0.1, AttnBackend.local, True)
    default = get_bridge(path).transformer_config(layout_from_config(cfg))
    assert default.moe_aux_loss_coeff == 0.001 and default.hidden_dropout == 0.0  # unset: config.json's


@pytest.mark.parametrize("argv, match", [
    (["--moe-token-dispatcher-type", "allgather"], "--moe-token-dispatcher-type allgather: allgather does not "
                                                   "support variable sequence lengths"),
    (["--moe-token-drop-policy", "position"], "--moe-token-drop-policy position: only matters with an expert "
                                              "capacity factor"),
    (["--attention-dropout", "1.5"], r"--attention-dropout 1.5 is out of range: it must lie in \[0, 1\)"),
    (["--moe-aux-loss-coeff", "-1"], r"--moe-aux-loss-coeff -1 is out of range: it must lie in \[0, inf\)"),
    (["--overlap-cpu-optimizer-d2h-h2d", "--dry-run"], "--overlap-cpu-optimizer-d2h-h2d: overlaps the hybrid CPU "
                                                       "optimizer's copies, which only exist with "
                                                       "--optimizer-cpu-offload"),
    (["--moe-router-load-balancing-type", "sinkhorn"], "--moe-router-load-balancing-type sinkhorn: Sinkhorn "
                                                        "routing balances the training tokens' scores"),
    (["--moe-router-load-balancing-type", "seq_aux_loss"], "seq_aux_loss: with config.json's router_aux_loss_coef "
                                                            "it would be a live loss, and megatron-core computes "
                                                            "the sequence-wise loss over a packed micro-batch"),
    (["--moe-aux-loss-coeff", "0.01", "--moe-router-load-balancing-type", "global_aux_loss"],
     "with --moe-aux-loss-coeff 0.01 it would be a live loss, and megatron-core's global tracker"),
    (["--moe-router-bias-update-rate", "0.001"], "--moe-router-bias-update-rate 0.001: a non-zero rate makes "
                                                 "megatron-core move the router's expert bias"),
    (["--moe-enable-deepep", "--dry-run"], "--moe-enable-deepep: megatron-core uses DeepEP only in the flex "
                                           "dispatcher; add --moe-token-dispatcher-type flex"),
    (["--moe-router-group-topk", "1"], "--moe-router-group-topk 1 without --moe-router-num-groups"),
    (["--q-lora-rank", "8"], "--q-lora-rank without --multi-latent-attention"),
    (["--multi-latent-attention", "--kv-lora-rank", "8"], "--kv-lora-rank 8 describes multi-latent attention but "
                                                          ".*has none \\(model_type qwen3_moe\\)"),
])
def test_values_megatron_core_would_reject_are_refused(argv, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        parse_config(["--hf-checkpoint", hf_dir(tmp_path, "qwen3_moe"), *argv])


def test_mla_kv_channels_and_sigmoid_pre_softmax_state_nothing(tmp_path):
    """megatron's MLA never reads --kv-channels and its sigmoid router never reads --moe-router-pre-softmax:
    slime's kimi-k2.sh (--kv-channels 64) and deepseek-v3.sh (128) both pass, as on Megatron-LM; a softmax
    router's --moe-router-pre-softmax is its norm_topk_prob false."""
    ds = hf_dir(tmp_path, "deepseek_v3")
    for kv in ("64", "128"):
        parse_config(["--hf-checkpoint", ds, "--kv-channels", kv, "--moe-router-pre-softmax"])
    assert parse_config(["--hf-checkpoint", hf_dir(tmp_path, "qwen3_moe", norm_topk_prob=False),
                         "--moe-router-pre-softmax"]).architecture.moe_router_pre_softmax
    with pytest.raises(ConfigError, match="--moe-router-pre-softmax does not match .*norm_topk_prob gives a "
                                          "softmax over the top-k logits"):
        parse_config(["--hf-checkpoint", hf_dir(tmp_path, "qwen3_moe"), "--moe-router-pre-softmax"])


def test_a_quantized_checkpoint_is_refused_for_a_real_run(tmp_path):
    path = hf_dir(tmp_path, "deepseek_v3", quantization_config={"quant_method": "fp8", "fmt": "e4m3"})
    with pytest.raises(ConfigError, match="quantization_config quant_method='fp8' .*fp8_cast_bf16.py"):
        parse_config(["--hf-checkpoint", path])
    assert parse_config(["--hf-checkpoint", path, "--dry-run"]).mode.dry_run
    from megatron_rl.errors import BridgeError
    from megatron_rl.models import get_bridge

    with pytest.raises(BridgeError, match="unsupported: quantization_config quant_method='fp8'"):
        get_bridge(path)  # the converters and the backend refuse it too


def test_num_steps_per_rollout_sets_the_global_batch(tmp_path):
    base = ["--hf-checkpoint", hf_dir(tmp_path, "qwen3_moe"), "--rollout-batch-size", "4", "--n-samples-per-prompt",
            "4"]
    cfg = parse_config([*base, "--num-steps-per-rollout", "2"])
    assert (cfg.batching.effective_global_batch_size, cfg.batching.optimizer_steps_per_rollout) == (8, 2)
    assert parse_config([*base, "--num-steps-per-rollout", "2", "--global-batch-size", "8"])
    with pytest.raises(ConfigError, match="--num-steps-per-rollout 3 does not divide .* = 16 samples"):
        parse_config([*base, "--num-steps-per-rollout", "3"])
    with pytest.raises(ConfigError, match="--num-steps-per-rollout 2 with --global-batch-size 4: 2 steps of 4"):
        parse_config([*base, "--num-steps-per-rollout", "2", "--global-batch-size", "4"])


def test_moe_knobs_on_a_dense_model_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--moe-router-dtype fp32 configures MoE layers, but the model has no "
                                          "experts"):
        parse_config(["--hf-checkpoint", hf_dir(tmp_path, "qwen3"), "--moe-router-dtype", "fp32"])


def test_dry_run_lists_what_the_real_run_needs(tmp_path, capsys):
    from megatron_rl.train import main

    argv = ["--hf-checkpoint", hf_dir(tmp_path, "qwen3_moe"), "--moe-permute-fusion", "--attention-backend", "flash"]
    with pytest.raises(ConfigError, match="--moe-permute-fusion cannot take effect here: it needs a CUDA GPU"):
        parse_config(argv)
    assert main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "needs: --moe-permute-fusion takes effect only with a CUDA GPU and transformer-engine >= 2.1" in out
    assert "needs: --attention-backend flash takes effect only with a CUDA GPU and transformer-engine" in out


def test_routing_replay_is_refused_where_it_cannot_run(tmp_path):
    """R2 needs MoE layers, the megatron backend and the old-log-prob pass it records in."""
    dense = hf_dir(tmp_path, "qwen3")
    with pytest.raises(ConfigError, match="--use-routing-replay configures MoE layers, but the model has no experts"):
        parse_config(["--hf-checkpoint", dense, "--use-routing-replay"])
    moe = hf_dir(tmp_path, "qwen3_moe")
    with pytest.raises(ConfigError, match="--use-routing-replay is a megatron-core setting; --train-backend fsdp"):
        parse_config(["--hf-checkpoint", moe, "--use-routing-replay", "--train-backend", "fsdp"])
    with pytest.raises(ConfigError, match="--use-routing-replay: records the routes in the old-log-prob pass, which "
                                          "--use-rollout-logprobs skips"):
        parse_config(["--hf-checkpoint", moe, "--use-routing-replay", "--use-rollout-logprobs"])
    assert parse_config(["--hf-checkpoint", moe, "--use-routing-replay"]).megatron.use_routing_replay


def test_rollout_routing_replay_needs_an_engine_that_returns_routes(tmp_path):
    """R3 replays what the engine recorded: the embedded engine (in the trainer's processes or its own) and
    SGLang return routes, and a generate function passes on its calls' routes (the agent loop does). No
    old-log-prob pass is needed (--use-rollout-logprobs is fine)."""
    moe = hf_dir(tmp_path, "qwen3_moe")
    r3 = ["--hf-checkpoint", moe, "--use-rollout-routing-replay"]
    cfg = parse_config([*r3, "--use-rollout-logprobs"])
    assert cfg.megatron.use_rollout_routing_replay and cfg.embedded_placement == "all"
    assert parse_config([*r3, "--async-mode", "full"]).embedded_placement == "process"
    assert parse_config([*r3, "--custom-generate-function-path", "megatron_rl.rollout.agent:generate"])
    with pytest.raises(ConfigError, match="--use-rollout-routing-replay configures MoE layers"):
        parse_config(["--hf-checkpoint", hf_dir(tmp_path, "qwen3"), "--use-rollout-routing-replay"])


def test_moe_tensor_parallel_without_expert_parallel_at_etp1_is_refused(tmp_path):
    """megatron-core 0.16.1 reduces the experts' gradients over DP only when EP is 1; with TP > 1 and ETP 1
    each TP rank's copy of an expert saw other tokens (docs/parity.md): wrong gradients, so refused."""
    moe = hf_dir(tmp_path, "qwen3_moe")
    base = ["--hf-checkpoint", moe, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
            "--sequence-parallel"]
    with pytest.raises(ConfigError, match="--expert-tensor-parallel-size 1 and --expert-model-parallel-size 1 trains "
                                          "an MoE model with wrong expert gradients"):
        parse_config(base + ["--expert-tensor-parallel-size", "1"])
    assert parse_config(base + ["--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"])
    assert parse_config(base)  # ETP defaults to TP
    assert parse_config(["--hf-checkpoint", hf_dir(tmp_path, "qwen3"), "--actor-num-gpus-per-node", "2",
                         "--tensor-model-parallel-size", "2", "--expert-tensor-parallel-size", "1"])  # dense


def test_gpt_oss_expert_tensor_parallelism_is_refused(tmp_path):
    """gpt-oss's experts have fc2 biases, which megatron-core 0.16.1 would add once per expert-TP rank."""
    path = hf_dir(tmp_path, "gpt_oss")
    base = ["--hf-checkpoint", path, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
            "--sequence-parallel"]
    for extra in ([], ["--expert-tensor-parallel-size", "2"]):  # ETP defaults to TP
        with pytest.raises(ConfigError, match="expert tensor parallelism 2 .* with a gpt_oss model"):
            parse_config(base + extra)
    assert parse_config(base + ["--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"])


def test_qwen3_next_context_parallelism_is_refused(tmp_path):
    """Qwen3-Next's gated delta-net layers carry a recurrent state along the sequence that is not handed from
    one CP rank to the next: refused in validation, before any worker starts."""
    path = hf_dir(tmp_path, "qwen3_next")
    with pytest.raises(ConfigError, match="--context-parallel-size 2 with a qwen3_next model: its gated delta-net"):
        parse_config(["--hf-checkpoint", path, "--actor-num-gpus-per-node", "2", "--context-parallel-size", "2"])
    assert parse_config(["--hf-checkpoint", path, "--actor-num-gpus-per-node", "2"])
    assert parse_config(["--hf-checkpoint", hf_dir(tmp_path, "qwen3"), "--actor-num-gpus-per-node", "2",
                         "--context-parallel-size", "2"])


def test_minimax_m2_tensor_parallelism_beyond_its_key_heads_is_refused(tmp_path):
    """MiniMax-M2's key norm spans all key heads: a key head replicated over TP ranks would count once per copy."""
    path = hf_dir(tmp_path, "minimax_m2", num_key_value_heads=1)
    base = ["--hf-checkpoint", path, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2",
            "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"]
    with pytest.raises(ConfigError, match=r"--tensor-model-parallel-size 2 > num_key_value_heads=1 with a minimax_m2 "
                                          r"model: .* pass --tensor-model-parallel-size <= 1"):
        parse_config(base)
    assert parse_config([base[0], hf_dir(tmp_path, "minimax_m2"), *base[2:]])  # 2 key heads: TP2 fits

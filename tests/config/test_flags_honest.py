"""No flag is accepted and then ignored: every config field is read somewhere outside megatron_rl/config/.

Why: an audit found flags (``--fp8-format``, ``--log-probs-chunk-size``,
``--update-weight-disk-dir``, now read by the disk transport) that passed validation and reached nothing. This guard
walks every field of the schema (``iter_fields``) and looks, by AST (so comments,
strings and docstrings do not count), for an attribute access ``.<field_name>`` or a
``getattr(obj, "<field_name>")`` in the Python source of megatron_rl/ (config/
excluded: declaring, parsing and validating a flag is not using it), tools/ and scripts/.

A field read only by a derived property of the schema (``effective_global_batch_size``
reads ``global_batch_size``) counts as read when that property is read outside config/
(transitively: properties reading properties).

The match is by attribute name (``opt = cfg.optimizer; opt.lr`` is found, and so is an
unrelated ``.lr``): it catches a flag read NOWHERE, the failure seen; it does not prove
the right object is read.

``ALLOWED`` lists the justified exceptions. Each reason is checked, not just stated: the
entry's proof runs (a flag refused whenever set must raise ConfigError naming it; a flag
consumed while parsing must visibly set what it claims), and an entry whose field is
read after all, or that names no field, fails, so the list cannot go stale.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from megatron_rl.config.schema import iter_fields

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("megatron_rl", "tools", "scripts")
CONFIG = REPO / "megatron_rl" / "config"
SCHEMA = CONFIG / "schema.py"


def _refused(argv):
    """Proof for a flag that is refused whenever set: parsing ``argv`` raises ConfigError naming it."""
    return ("refused", argv)


# field -> (why nothing outside megatron_rl/config/ needs to read it, proof)
ALLOWED: dict[str, tuple[str, tuple]] = {
    "use_wandb": (
        "slime's W&B switch: logging to W&B here is on exactly when --wandb-project is given (infra/tracking), "
        "so --use-wandb adds nothing then, and without --wandb-project it is refused in validation",
        _refused(["--use-wandb"])),
    "balance_data": (
        "slime's token balancing over DP ranks: the dynamic packer (data/packing.plan_dynamic_micro_batches) always "
        "balances token counts with --use-dynamic-batch-size, so the flag restates it; without that flag it is "
        "refused in validation",
        _refused(["--balance-data"])),
    "loss_type": (
        "slime's loss selector: policy_loss is the only loss built (what the Spec computes); custom_loss and "
        "sft_loss are refused in validation with the reason",
        _refused(["--loss-type", "custom_loss"])),
    "custom_loss_function_path": (
        "slime's custom loss hook, refused in validation: its fn(args, batch, logits, sum_of_sample_mean) contract "
        "has per-micro-batch normalisation, the losses here are normalised over the whole step",
        _refused(["--custom-loss-function-path", "my_loss:fn"])),
    "custom_pg_loss_reducer_function_path": (
        "slime's per-micro-batch pg_loss reducer, refused in validation: the denominators here are global",
        _refused(["--custom-pg-loss-reducer-function-path", "my_reducer:get"])),
    "custom_tis_function_path": (
        "slime's TIS hook, refused in validation naming the flags that do its built-ins (--use-tis, --tis-mode)",
        _refused(["--custom-tis-function-path", "my_tis:fn"])),
    "critic_save": (
        "slime's separate critic save dir, refused in validation: the critic goes into each --save checkpoint",
        _refused(["--critic-save", "/tmp/critic"])),
    "save_hf": (
        "slime's HF export at every save, refused in validation naming tools/convert_ckpt.py dist-to-hf (and slime's "
        "tools/convert_torch_dist_to_hf.py over it) for a saved checkpoint",
        _refused(["--save-hf", "/tmp/hf_{rollout_id}"])),
    "keep_old_actor": (
        "slime's copy of the generating weights for the old log-probs, refused in validation naming "
        "--use-rollout-logprobs / --use-tis / --use-rs",
        _refused(["--keep-old-actor"])),
    "critic_num_nodes": (
        "slime's critic placement: the critic runs on the actor's ranks (as slime's, which sets it to the actor's "
        "count), so the actor's value says nothing new and any other is refused in validation",
        _refused(["--advantage-estimator", "ppo", "--critic-num-nodes", "2"])),
    "critic_num_gpus_per_node": (
        "slime's critic placement: the critic runs on the actor's ranks, so the actor's value says nothing new and "
        "any other is refused in validation",
        _refused(["--advantage-estimator", "ppo", "--critic-num-gpus-per-node", "2"])),
    "no_position_embedding": (
        "Megatron-LM's add_position_embedding false: every family a bridge builds encodes positions in attention "
        "(RoPE / YaRN) and none has a learned position table, so the flag restates the model",
        ("sets", ["--no-position-embedding"], lambda cfg: cfg.architecture.no_position_embedding)),
    "make_vocab_size_divisible_by": (
        "read by the --vocab-size check (config/architecture.py): Megatron-LM's padding multiple for the stated "
        "vocab; the embedding here is padded to 128 x TP and its padding rows are sliced off before every softmax",
        _refused(["--vocab-size", "300", "--make-vocab-size-divisible-by", "64"])),
    "allocation": (
        "consumed while parsing: config/placement.apply_allocation turns it into the parallel-size, placement "
        "and rollout-size flags (which the trainer reads) and refuses flags that disagree with it",
        ("sets", ["--allocation", "megatron:t2p2", "--actor-num-gpus-per-node", "4"],
         lambda cfg: (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) == (2, 2))),
}


def _source_files():
    for top in SOURCES:
        for path in sorted((REPO / top).rglob("*.py")):
            if not path.is_relative_to(CONFIG):
                yield path


def _attribute_names(tree: ast.AST) -> set[str]:
    """Every ``x.<name>`` and ``getattr(x, "<name>"[, d])`` under ``tree``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            names.add(node.args[1].value)
    return names


def _schema_properties() -> dict[str, set[str]]:
    """``property name -> attribute names its body reads``, for every property in schema.py."""
    props: dict[str, set[str]] = {}
    for cls in ast.walk(ast.parse(SCHEMA.read_text())):
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and any(
                    isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list):
                props.setdefault(fn.name, set()).update(_attribute_names(fn))
    return props


def read_names() -> set[str]:
    """Attribute names read outside config/, closed over the schema properties they read."""
    read: set[str] = set()
    for path in _source_files():
        read |= _attribute_names(ast.parse(path.read_text(), filename=str(path)))
    props = _schema_properties()
    grew = True
    while grew:
        grew = False
        for name, uses in props.items():
            if name in read and not uses <= read:
                read |= uses
                grew = True
    return read


@pytest.fixture(scope="module")
def read():
    return read_names()


def test_the_scan_sees_the_sources(read):
    files = list(_source_files())
    assert any(p.parts[-2:] == ("megatron", "backend.py") for p in files)
    assert any(p.parts[-2] == "tools" for p in files) and not any(p.is_relative_to(CONFIG) for p in files)
    assert {"initialize", "optimizer_cpu_offload"} <= read
    # derived: global_batch_size is read through the effective_global_batch_size property
    assert "global_batch_size" in _schema_properties()["effective_global_batch_size"]


def test_every_flag_is_read_outside_config(read):
    unread = [f"--{f.name.replace('_', '-')} ({group}.{f.name})" for group, _, f in iter_fields()
              if f.name not in read and f.name not in ALLOWED and f.name not in REGISTRY_PROOFS]
    assert not unread, ("flags accepted but read nowhere outside megatron_rl/config/ (wire them, refuse them, "
                        "or add them to ALLOWED with a checked reason): " + ", ".join(unread))


def test_allow_list_is_current(read):
    fields = {f.name for _, _, f in iter_fields()}
    assert not set(ALLOWED) - fields, f"ALLOWED names no flag: {sorted(set(ALLOWED) - fields)}"
    assert not set(ALLOWED) & read, f"ALLOWED entries that are read after all: {sorted(set(ALLOWED) & read)}"


@pytest.mark.parametrize("field", sorted(ALLOWED))
def test_allow_list_reasons_hold(field, tmp_path, monkeypatch):
    from megatron_rl.config import parse_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    reason, proof = ALLOWED[field]
    assert reason.strip()
    argv = ["--hf-checkpoint", build_tiny_hf_model("qwen2", tmp_path / "hf"), *proof[1]]
    if proof[0] in ("refused", "refused-as"):  # refused-as: the flag's spelling is not the field's name
        flag = proof[2] if proof[0] == "refused-as" else "--" + field.replace("_", "-")
        with pytest.raises(ConfigError, match=flag):
            parse_config(argv)
    else:
        assert proof[2](parse_config(argv)), (field, reason)


# -- The Megatron-LM flag tables: proven by behaviour, not by an attribute read --------
# config/architecture.py's flags are compared with config.json (the HF config builds the model);
# config/megatron_flags.py's reach megatron-core through the backend's config construction by a
# table, so no ``.field`` read exists to find. Each field instead has a proof here, run below:
#   ("refused", family, config.json patch, argv): a value that disagrees with config.json is refused
#       by name (and the values config.json implies are accepted: test_matching_architecture_flags);
#   ("arrives", family, argv, target, key, value): the backend's megatron-core kwargs carry it;
#   ("needs", family, argv): on this CPU-only machine a real run refuses it by name, --dry-run accepts it.
REGISTRY_PROOFS: dict[str, tuple] = {
    "num_layers": ("refused", "qwen2", {}, ["--num-layers", "99"]),
    "hidden_size": ("refused", "qwen2", {}, ["--hidden-size", "99"]),
    "ffn_hidden_size": ("refused", "qwen2", {}, ["--ffn-hidden-size", "99"]),
    "num_attention_heads": ("refused", "qwen2", {}, ["--num-attention-heads", "99"]),
    "group_query_attention": ("refused", "qwen2", {}, ["--group-query-attention"]),  # 1 group vs 2
    "num_query_groups": ("refused", "qwen2", {}, ["--group-query-attention", "--num-query-groups", "3"]),
    "kv_channels": ("refused", "qwen2", {}, ["--kv-channels", "99"]),
    "vocab_size": ("refused", "qwen2", {}, ["--vocab-size", "99999"]),
    "swiglu": ("refused", "qwen2", {"hidden_act": "gelu"}, ["--swiglu"]),
    "normalization": ("refused", "qwen2", {}, ["--normalization", "LayerNorm"]),
    "norm_epsilon": ("refused", "qwen2", {}, ["--norm-epsilon", "1e-5"]),
    "rotary_base": ("refused", "qwen2", {}, ["--rotary-base", "500000"]),
    "rotary_percent": ("refused", "qwen2", {}, ["--rotary-percent", "0.5"]),
    "position_embedding_type": ("refused", "qwen2", {}, ["--position-embedding-type", "learned_absolute"]),
    "use_rotary_position_embeddings": ("refused", "qwen2", {}, ["--use-rotary-position-embeddings",
                                                                "--position-embedding-type", "none"]),
    "disable_bias_linear": ("refused", "qwen2", {"mlp_bias": True}, ["--disable-bias-linear"]),
    "add_qkv_bias": ("refused", "qwen3", {}, ["--add-qkv-bias"]),
    "qk_layernorm": ("refused", "qwen2", {}, ["--qk-layernorm"]),
    "attention_output_gate": ("refused", "qwen3", {}, ["--attention-output-gate"]),
    "apply_layernorm_1p": ("refused", "qwen2", {}, ["--apply-layernorm-1p"]),
    "moe_shared_expert_gate": ("refused", "glm4_moe", {}, ["--moe-shared-expert-gate"]),
    "untie_embeddings_and_output_weights": ("refused", "qwen2", {"tie_word_embeddings": True},
                                            ["--untie-embeddings-and-output-weights"]),
    "num_experts": ("refused", "qwen3_moe", {}, ["--num-experts", "7"]),
    "moe_ffn_hidden_size": ("refused", "qwen3_moe", {}, ["--moe-ffn-hidden-size", "7"]),
    "moe_router_topk": ("refused", "qwen3_moe", {}, ["--moe-router-topk", "3"]),
    "moe_layer_freq": ("refused", "qwen3_moe", {}, ["--moe-layer-freq", "2"]),
    "moe_router_score_function": ("refused", "qwen3_moe", {}, ["--moe-router-score-function", "sigmoid"]),
    "moe_shared_expert_intermediate_size": ("refused", "glm4_moe", {}, ["--moe-shared-expert-intermediate-size",
                                                                        "7"]),
    "moe_router_pre_softmax": ("refused", "qwen3_moe", {}, ["--moe-router-pre-softmax"]),  # norm_topk_prob true
    "moe_router_enable_expert_bias": ("refused", "qwen3_moe", {}, ["--moe-router-enable-expert-bias"]),
    "moe_router_topk_scaling_factor": ("refused", "glm4_moe", {}, ["--moe-router-topk-scaling-factor", "2.5"]),
    "moe_router_num_groups": ("refused", "glm4_moe", {}, ["--moe-router-num-groups", "4"]),
    "moe_router_group_topk": ("refused", "glm4_moe", {}, ["--moe-router-num-groups", "2",
                                                          "--moe-router-group-topk", "2"]),
    "rotary_scaling_factor": ("refused", "qwen2", {}, ["--rotary-scaling-factor", "40"]),
    "multi_latent_attention": ("refused", "qwen2", {}, ["--multi-latent-attention"]),
    "q_lora_rank": ("refused", "deepseek_v3", {}, ["--multi-latent-attention", "--q-lora-rank", "1536"]),
    "kv_lora_rank": ("refused", "deepseek_v3", {}, ["--multi-latent-attention", "--kv-lora-rank", "512"]),
    "qk_head_dim": ("refused", "deepseek_v3", {}, ["--multi-latent-attention", "--qk-head-dim", "128"]),
    "qk_pos_emb_head_dim": ("refused", "deepseek_v3", {}, ["--multi-latent-attention", "--qk-pos-emb-head-dim",
                                                           "64"]),
    "v_head_dim": ("refused", "deepseek_v3", {}, ["--multi-latent-attention", "--v-head-dim", "128"]),
    "mscale": ("refused", "deepseek_v3", {}, ["--multi-latent-attention", "--mscale", "0.7"]),
    "mscale_all_dim": ("refused", "deepseek_v3", {}, ["--multi-latent-attention", "--mscale-all-dim", "1.0"]),
    "attention_dropout": ("arrives", "qwen2", ["--attention-dropout", "0.25"], "transformer", "attention_dropout",
                          0.25),
    "hidden_dropout": ("arrives", "qwen2", ["--hidden-dropout", "0.25"], "transformer", "hidden_dropout", 0.25),
    "attention_softmax_in_fp32": ("arrives", "qwen2", ["--attention-softmax-in-fp32"], "transformer",
                                  "attention_softmax_in_fp32", True),
    "accumulate_allreduce_grads_in_fp32": ("arrives", "qwen2", ["--accumulate-allreduce-grads-in-fp32"], "ddp",
                                           "grad_reduce_in_fp32", True),
    "calculate_per_token_loss": ("arrives", "qwen2", ["--calculate-per-token-loss"], "transformer",
                                 "calculate_per_token_loss", True),
    "attention_backend": ("needs", "qwen2", ["--attention-backend", "flash"]),
    "deterministic_mode": ("arrives", "qwen2", ["--deterministic-mode"], "transformer", "deterministic_mode", True),
    "moe_router_dtype": ("arrives", "qwen3_moe", ["--moe-router-dtype", "fp64"], "transformer", "moe_router_dtype",
                         "fp64"),
    "moe_token_dispatcher_type": ("arrives", "qwen3_moe", ["--moe-token-dispatcher-type", "alltoall"],
                                  "transformer", "moe_token_dispatcher_type", "alltoall"),
    "moe_grouped_gemm": ("needs", "qwen3_moe", ["--moe-grouped-gemm"]),
    "moe_enable_deepep": ("needs", "qwen3_moe", ["--moe-token-dispatcher-type", "flex", "--moe-enable-deepep"]),
    "moe_permute_fusion": ("needs", "qwen3_moe", ["--moe-permute-fusion"]),
    "moe_aux_loss_coeff": ("arrives", "qwen3_moe", ["--moe-aux-loss-coeff", "0.5"], "transformer",
                           "moe_aux_loss_coeff", 0.5),
    "moe_router_load_balancing_type": ("arrives", "qwen3_moe", ["--moe-aux-loss-coeff", "0",
                                                                "--moe-router-load-balancing-type", "seq_aux_loss"],
                                       "transformer", "moe_router_load_balancing_type", "seq_aux_loss"),
    "moe_router_bias_update_rate": ("arrives", "glm4_moe", ["--moe-router-bias-update-rate", "0"], "transformer",
                                    "moe_router_bias_update_rate", 0.0),
    "no_rope_fusion": ("arrives", "qwen2", ["--no-rope-fusion"], "transformer", "apply_rope_fusion", False),
    "moe_token_drop_policy": ("arrives", "qwen3_moe", ["--moe-token-drop-policy", "probs"], "transformer",
                              "moe_token_drop_policy", "probs"),
    "use_routing_replay": ("arrives", "qwen3_moe", ["--use-routing-replay"], "transformer",
                           "moe_enable_routing_replay", True),
    "use_rollout_routing_replay": ("arrives", "qwen3_moe", ["--use-rollout-routing-replay"], "transformer",
                                   "moe_enable_routing_replay", True),
    "decoder_last_pipeline_num_layers": ("arrives", "qwen2", ["--actor-num-gpus-per-node", "2",
                                                              "--pipeline-model-parallel-size", "2",
                                                              "--decoder-last-pipeline-num-layers", "1"],
                                         "transformer", "num_layers_in_last_pipeline_stage", 1),
    "decoder_first_pipeline_num_layers": ("arrives", "qwen2", ["--actor-num-gpus-per-node", "2",
                                                               "--pipeline-model-parallel-size", "2",
                                                               "--decoder-first-pipeline-num-layers", "3"],
                                          "transformer", "num_layers_in_first_pipeline_stage", 3),
    "no_masked_softmax_fusion": ("arrives", "qwen2", ["--no-masked-softmax-fusion"], "transformer",
                                 "masked_softmax_fusion", False),
    "no_check_for_nan_in_loss_and_grad": ("arrives", "qwen2", ["--no-check-for-nan-in-loss-and-grad"], "ddp",
                                          "check_for_nan_in_grad", False),
    "max_position_embeddings": ("refused", "qwen2", {}, ["--max-position-embeddings", "1024"]),
    "no_gradient_accumulation_fusion": ("arrives", "qwen2", ["--no-gradient-accumulation-fusion"], "transformer",
                                        "gradient_accumulation_fusion", False),
    "transformer_impl": ("needs", "qwen2", ["--transformer-impl", "transformer_engine"]),
    "spec": ("refused", "qwen3", {}, ["--spec", "slime_plugins.models.qwen3_next", "get_qwen3_next_spec"]),
    "mtp_num_layers": ("arrives", "glm4_moe", ["--mtp-num-layers", "1"], "transformer", "mtp_num_layers", 1),
    "enable_mtp_training": ("refused", "glm4_moe", {}, ["--mtp-num-layers", "1", "--enable-mtp-training",
                                                        "--lora-rank", "4"]),
    "mtp_loss_scaling_factor": ("refused", "glm4_moe", {}, ["--mtp-loss-scaling-factor", "0.1"]),
    "overlap_cpu_optimizer_d2h_h2d": ("needs", "qwen2", ["--use-distributed-optimizer",
                                                         "--use-precision-aware-optimizer",
                                                         "--optimizer-cpu-offload",
                                                         "--overlap-cpu-optimizer-d2h-h2d"]),
}


def test_registry_proofs_cover_the_tables_exactly():
    from megatron_rl.config.architecture import ARCHITECTURE_FIELDS
    from megatron_rl.config.megatron_flags import MEGATRON_FLAG_FIELDS

    assert set(REGISTRY_PROOFS) == set(ARCHITECTURE_FIELDS) | set(MEGATRON_FLAG_FIELDS)


def _hf_dir(tmp_path, family, patch):
    """A checkpoint dir holding only config.json (validation reads nothing else)."""
    import json

    from megatron_rl.models.hf_tiny import tiny_config

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**tiny_config(family).to_dict(), **patch}))
    return str(d)


@pytest.mark.parametrize("field", sorted(REGISTRY_PROOFS))
def test_registry_flag_proofs_hold(field, tmp_path, monkeypatch):
    from megatron_rl.config import parse_config
    from megatron_rl.errors import ConfigError

    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    kind, family, *rest = REGISTRY_PROOFS[field]
    flag = "--" + field.replace("_", "-")
    patch = rest[0] if kind == "refused" else {}
    argv = ["--hf-checkpoint", _hf_dir(tmp_path, family, patch), *(rest[1] if kind == "refused" else rest[0])]
    if kind == "refused":
        with pytest.raises(ConfigError, match=re.escape(flag)):
            parse_config(argv)
    elif kind == "needs":
        with pytest.raises(ConfigError, match=re.escape(flag) + ".* cannot take effect here"):
            parse_config(argv)
        assert parse_config([*argv, "--dry-run"]).mode.dry_run
    else:
        from megatron_rl.backends.megatron.settings import (ddp_config_kwargs, optimizer_config_kwargs,
                                                           transformer_config_overrides)
        import torch

        target, key, value = rest[1:]
        cfg = parse_config(argv)
        got = {"transformer": transformer_config_overrides(cfg), "ddp": ddp_config_kwargs(cfg),
               "optimizer": optimizer_config_kwargs(cfg, torch.float32)}[target]
        assert got[key] == value, (field, got)


@pytest.mark.parametrize("family,argv,why", [
    ("glm4_moe", ["--mtp-num-layers", "2"], "config.json's num_nextn_predict_layers is 1"),
    ("qwen2", ["--mtp-num-layers", "1"], "the checkpoint has no multi-token-prediction layers"),
])
def test_mtp_num_layers_other_than_the_checkpoints_is_refused(family, argv, why, tmp_path, monkeypatch):
    from megatron_rl.config import parse_config
    from megatron_rl.errors import ConfigError

    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    hf = _hf_dir(tmp_path, family, {})
    with pytest.raises(ConfigError, match=re.escape(f"--mtp-num-layers {argv[1]}") + ".*" + re.escape(why)):
        parse_config(["--hf-checkpoint", hf, *argv])
    assert parse_config(["--hf-checkpoint", hf, "--mtp-num-layers", "0"])


@pytest.mark.parametrize("argv, why", [
    ([], "needs --mtp-num-layers"),
    (["--mtp-num-layers", "1", "--lora-rank", "4"], "not built with LoRA"),
    (["--mtp-num-layers", "1", "--train-backend", "fsdp"], "transformers' models have no MTP layers"),
])
def test_enable_mtp_training_refuses_what_it_is_not_built_for(argv, why, tmp_path, monkeypatch):
    from megatron_rl.config import parse_config
    from megatron_rl.errors import ConfigError

    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    hf = _hf_dir(tmp_path, "glm4_moe", {})
    with pytest.raises(ConfigError, match=re.escape("--enable-mtp-training") + ".*" + re.escape(why)):
        parse_config(["--hf-checkpoint", hf, "--enable-mtp-training", *argv])
    cfg = parse_config(["--hf-checkpoint", hf, "--mtp-num-layers", "1", "--enable-mtp-training",
                        "--mtp-loss-scaling-factor", "0.5"])
    assert cfg.megatron.enable_mtp_training and cfg.megatron.mtp_loss_scaling_factor == 0.5


@pytest.mark.parametrize("layout", [
    ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
     "--expert-tensor-parallel-size", "1"],
    ["--context-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"], ["--expert-model-parallel-size", "2"],
])
def test_enable_mtp_training_takes_every_parallel_layout(layout, tmp_path, monkeypatch):
    """TP (+SP), CP, EP and PP each equal one process (tests/dist/test_parity_layouts.py, glm4_moe_mtp_*)."""
    from megatron_rl.config import parse_config

    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    hf = _hf_dir(tmp_path, "glm4_moe", {})
    cfg = parse_config(["--hf-checkpoint", hf, "--mtp-num-layers", "1", "--enable-mtp-training",
                        "--actor-num-gpus-per-node", "2", *layout])
    assert cfg.megatron.enable_mtp_training

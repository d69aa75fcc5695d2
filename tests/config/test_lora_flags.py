"""``--lora-*``'s validation: LoRA runs on the megatron backend's local layer spec; what it cannot do yet is
refused before any worker starts, naming the flag and the fix (config/validate.py ``_check_lora``)."""

import importlib.util

import pytest

from megatron_rl.config import parse_config
from megatron_rl.config.validate import collect_errors


@pytest.fixture
def argv(tiny_hf_models):
    def make(*extra):
        return ["--hf-checkpoint", tiny_hf_models("qwen2"), *extra]
    return make


def errors(argv):
    return collect_errors(parse_config(argv, validate=False))


def test_lora_flags_are_read_and_accepted(argv):
    cfg = parse_config(argv("--lora-rank", "8", "--lora-alpha", "16", "--lora-dropout", "0.05",
                            "--lora-target-modules", "q_proj", "self_attn.v_proj", "down_proj"), validate=False)
    assert (cfg.lora.lora_rank, cfg.lora.lora_alpha, cfg.lora.lora_dropout) == (8, 16.0, 0.05)
    assert cfg.lora.lora_target_modules == ["q_proj", "self_attn.v_proj", "down_proj"]
    if importlib.util.find_spec("transformer_engine") is None:
        assert collect_errors(cfg) == []
    assert parse_config(argv(), validate=False).lora.lora_rank == 0  # off by default


def test_shaping_flags_without_a_rank_are_refused(argv):
    found = errors(argv("--lora-alpha", "32", "--lora-target-modules", "q_proj"))
    assert any("--lora-alpha shapes LoRA adapters, which are off: add --lora-rank R" in e for e in found), found
    assert any(e.startswith("--lora-target-modules shapes LoRA adapters") for e in found), found


def test_what_lora_cannot_do_yet_is_named(argv, tmp_path, tiny_hf_models):
    found = errors(argv("--lora-rank", "4", "--lora-target-modules", "qkv_proj", "o_proj"))
    assert any("--lora-target-modules qkv_proj: adaptable are q_proj" in e for e in found), found
    found = errors(argv("--lora-rank", "4", "--lora-target-modules", "all-linear", "q_proj"))
    assert any("all-linear already names every linear" in e for e in found), found
    assert errors(argv("--lora-rank", "4", "--train-backend", "fsdp")) == []  # PEFT's adapters (peft is installed)
    (tmp_path / "ref").mkdir()
    found = errors(argv("--lora-rank", "4", "--ref-load", str(tmp_path / "ref")))
    assert any("--ref-load with --lora-rank: a LoRA run's frozen weights are its base model" in e for e in found)
    moe = ["--hf-checkpoint", tiny_hf_models("qwen3_moe")]
    found = errors(moe + ["--lora-rank", "4"])
    assert any("--lora-target-modules all-linear on an MoE model: adapters on expert linears" in e for e in found)
    assert errors(moe + ["--lora-rank", "4", "--lora-target-modules", "q_proj", "o_proj"]) == [] or \
        importlib.util.find_spec("transformer_engine") is not None
    found = errors(["--hf-checkpoint", tiny_hf_models("deepseek_v3"), "--lora-rank", "4", "--lora-target-modules",
                    "o_proj"])
    assert any("deepseek_v3 model: adapters on multi-latent attention" in e for e in found), found
    found = errors(["--hf-checkpoint", tiny_hf_models("qwen3_next"), "--lora-rank", "4", "--lora-target-modules",
                    "o_proj"])
    assert any("qwen3_next model: adapters on its gated attention" in e for e in found), found
    found = errors(argv("--lora-rank", "-1"))
    assert any("--lora-rank -1 must be >= 0" in e for e in found), found
    found = errors(argv("--lora-rank", "4", "--lora-dropout", "1.0"))
    assert any("--lora-dropout" in e and "[0, 1)" in e for e in found), found


def test_lora_load_must_be_a_plain_peft_adapter_with_the_runs_settings(argv, tmp_path):
    import json

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    found = errors(argv("--lora-rank", "4", "--lora-load", str(adapter)))
    assert any(f"--lora-load {adapter}: no adapter_config.json or adapter_model.safetensors there" in e
               for e in found), found
    (adapter / "adapter_model.safetensors").write_bytes(b"")
    config = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["v_proj", "q_proj"]}
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    found = [e for e in errors(argv("--lora-rank", "4", "--lora-load", str(adapter))) if "--lora-load" in e]
    assert any("its r is 8: pass --lora-rank 8" in e for e in found), found
    assert any("its lora_alpha is 16: pass --lora-alpha 16" in e for e in found), found
    assert any("its target_modules are q_proj v_proj: pass --lora-target-modules q_proj v_proj" in e for e in found)
    ok = argv("--lora-rank", "8", "--lora-alpha", "16", "--lora-target-modules", "self_attn.q_proj", "v_proj",
              "--lora-load", str(adapter))
    assert not [e for e in errors(ok) if "--lora-load" in e]
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    assert any("only plain LoRA adapters load" in e for e in errors(ok)), errors(ok)
    found = errors(argv("--lora-load", str(adapter)))
    assert any("--lora-load shapes LoRA adapters, which are off" in e for e in found), found


def test_lora_sync_adapter_needs_an_adapter_run_and_an_engine_that_takes_one(argv):
    assert parse_config(argv("--lora-rank", "4"), validate=False).lora.lora_sync == "merged"  # the default
    found = errors(argv("--lora-sync", "adapter"))
    assert any("--lora-sync adapter sends LoRA adapters to the engine, and this run trains none: add --lora-rank R"
               in e for e in found), found
    for transport in ("tensor", "disk"):
        assert not [e for e in errors(argv("--lora-rank", "4", "--lora-sync", "adapter",
                                           "--update-weight-transport", transport)) if "--lora-sync" in e]
    assert not [e for e in errors(argv("--lora-rank", "4", "--lora-sync", "adapter", "--embedded-engine-ranks",
                                       "process")) if "--lora-sync" in e]  # its own process: disk
    sglang = ("--lora-rank", "4", "--lora-sync", "adapter", "--rollout-backend", "sglang",
              "--rollout-engine-urls", "http://127.0.0.1:1")
    assert not [e for e in errors(argv(*sglang, "--update-weight-transport", "disk")) if "--lora-sync" in e]
    found = errors(argv(*sglang, "--update-weight-transport", "distributed", "--check-weight-update-equal"))
    assert any("--lora-sync adapter with SGLang and --update-weight-transport distributed: the adapter goes to "
               "SGLang as a PEFT dir (/load_lora_adapter) over the disk transport" in e for e in found), found
    assert any("--lora-sync adapter with SGLang and --check-weight-update-equal" in e for e in found), found
    from megatron_rl.errors import ConfigError

    with pytest.raises(ConfigError, match="--lora-sync: invalid choice: 'adapters'"):
        parse_config(argv("--lora-rank", "4", "--lora-sync", "adapters"), validate=False)


def test_sglang_launch_serves_the_runs_adapters(argv):
    """The launcher starts SGLang with --enable-lora, the run's rank and target modules under --lora-sync adapter."""
    from megatron_rl.rollout.sglang.launcher import lora_server_args

    cfg = parse_config(argv("--lora-rank", "8", "--lora-sync", "adapter", "--lora-target-modules", "self_attn.q_proj",
                            "v_proj"), validate=False)
    assert lora_server_args(cfg) == ["--enable-lora", "--max-lora-rank", "8", "--lora-target-modules", "q_proj",
                                     "v_proj"]
    cfg = parse_config(argv("--lora-rank", "8", "--lora-sync", "adapter"), validate=False)
    assert lora_server_args(cfg)[-2:] == ["--lora-target-modules", "all"]  # all-linear is SGLang's "all"
    assert lora_server_args(parse_config(argv("--lora-rank", "8"), validate=False)) == []  # merged: a plain server


def test_modules_to_save_follow_peft_names_and_are_checked_against_the_checkpoint(argv, tiny_hf_models):
    cfg = parse_config(argv("--lora-rank", "8", "--lora-modules-to-save", "embed_tokens", "norm"), validate=False)
    assert cfg.lora.lora_modules_to_save == ["embed_tokens", "norm"]
    assert not [e for e in collect_errors(cfg) if "--lora-modules-to-save" in e]
    assert parse_config(argv(), validate=False).lora.lora_modules_to_save == []  # off by default
    found = errors(argv("--lora-modules-to-save", "embed_tokens"))
    assert any("--lora-modules-to-save shapes LoRA adapters, which are off: add --lora-rank R" in e for e in found)
    found = errors(argv("--lora-rank", "8", "--lora-modules-to-save", "q_proj", "proj", "wte"))
    assert any("--lora-modules-to-save q_proj: picks the linear(s) q_proj, which LoRA adapts" in e for e in found)
    assert any(e.startswith("--lora-modules-to-save proj: picks the linear(s) down_proj, gate_proj, k_proj, o_proj, "
                            "q_proj, up_proj, v_proj") for e in found), found
    assert any("--lora-modules-to-save wte: picks no module of" in e for e in found), found
    assert not [e for e in errors(argv("--lora-rank", "8", "--lora-modules-to-save", "lm_head"))
                if "--lora-modules-to-save" in e]  # untied: an output layer of its own
    tied = ["--hf-checkpoint", tiny_hf_models("qwen2", tie_word_embeddings=True), "--lora-rank", "8"]
    found = errors([*tied, "--lora-modules-to-save", "lm_head"])
    assert any("--lora-modules-to-save lm_head: this model's output layer is its embedding (tie_word_embeddings); "
               "name embed_tokens" in e for e in found), found
    assert not [e for e in errors([*tied, "--lora-modules-to-save", "embed_tokens", "lm_head"])
                if "--lora-modules-to-save" in e]
    found = errors(argv("--lora-rank", "4", "--lora-sync", "adapter", "--rollout-backend", "sglang",
                        "--rollout-engine-urls", "http://127.0.0.1:1", "--update-weight-transport", "disk",
                        "--lora-modules-to-save", "embed_tokens"))
    assert any("--lora-sync adapter with SGLang and --lora-modules-to-save embed_tokens" in e for e in found), found

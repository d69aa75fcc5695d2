"""Flag parsing, YAML merging, pass-through and every validation error path."""

import dataclasses
import re

import pytest

from megatron_rl.config import build_parser, collect_errors, parse_config, parse_duration, validate_config
from megatron_rl.config import docs as config_docs
from megatron_rl.errors import ConfigError


@pytest.fixture
def hf_dir(tiny_hf_models):
    return tiny_hf_models("qwen2")


def base(hf_dir, *extra):
    return ["--hf-checkpoint", hf_dir, *extra]


def test_design_flag_names_are_accepted_verbatim(hf_dir):
    """Every flag DESIGN.md lists must parse with its Megatron/slime spelling."""
    parser = build_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    design_flags = """--tensor-model-parallel-size --pipeline-model-parallel-size --context-parallel-size
    --expert-model-parallel-size --expert-tensor-parallel-size --sequence-parallel --optimizer --lr
    --optimizer-cpu-offload --use-precision-aware-optimizer --use-distributed-optimizer --use-dynamic-batch-size
    --max-tokens-per-gpu --micro-batch-size --global-batch-size --recompute-granularity --offload-train
    --offload-rollout --colocate --hf-checkpoint --load --save --save-interval --save-max-to-keep --ref-load
    --opd-teacher-load --train-backend --fp8-format --fp16 --bf16 --grad-clip --rollout-num-gpus
    --rollout-num-gpus-per-engine --update-weight-transport --update-weight-buffer-size --debug-train-only
    --debug-rollout-only --load-debug-rollout-data --wall-time-limit --wall-time-reserve --wandb-project
    --wandb-resume-id --tensorboard-dir --allocation""".split()
    assert not [f for f in design_flags if f not in known]


def test_parse_values_and_derived(hf_dir):
    cfg = parse_config(base(hf_dir, "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "8",
                            "--pipeline-model-parallel-size", "2", "--lr", "3e-6", "--clip-grad", "0.5",
                            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
                            "--use-dynamic-batch-size", "--max-tokens-per-gpu", "4096", "--bf16"))
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.data_parallel_size == 2  # 8 / (2*2*1)
    assert cfg.optimizer.lr == 3e-6 and cfg.optimizer.grad_clip == 0.5
    assert cfg.batching.optimizer_steps_per_rollout == 2
    assert cfg.precision.params_dtype == "bfloat16"
    assert cfg.has_rollout_engine and cfg.has_training
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.parallel.tensor_model_parallel_size = 4


def test_sglang_pass_through(hf_dir):
    # parsed as SGLang will receive them; validation refuses them while no SGLang engine is launched by us
    cfg = parse_config(base(hf_dir, "--sglang-mem-fraction-static", "0.7", "--sglang-enable-dp-attention",
                            "--sglang-log-level=warning"), validate=False)
    assert cfg.rollout.sglang_args == {"mem_fraction_static": "0.7", "enable_dp_attention": True,
                                       "log_level": "warning"}


@pytest.mark.parametrize("extra, match", [
    (["--rollout-num-gpus", "2"], "--rollout-num-gpus 2 places SGLang engines on their own GPUs"),
    (["--rollout-num-gpus-per-engine", "2"], "--rollout-num-gpus-per-engine 2 sizes SGLang engines"),
    (["--sglang-mem-fraction-static", "0.7", "--sglang-log-level=warning"],
     "--sglang-log-level --sglang-mem-fraction-static: pass-through arguments of SGLang servers"),
])
def test_sglang_only_knobs_are_refused_with_the_embedded_engine(hf_dir, extra, match):
    """They were accepted and read nowhere (the embedded engine is one in-process engine). Without
    --rollout-backend (auto) the same flags select SGLang, as in slime's scripts."""
    with pytest.raises(ConfigError, match=match):
        parse_config(base(hf_dir, "--rollout-backend", "embedded", *extra))
    assert parse_config(base(hf_dir, *extra), validate=False).rollout.rollout_backend == "sglang"
    assert parse_config(base(hf_dir), validate=False).rollout.rollout_backend == "embedded"


def test_yaml_config_and_cli_precedence(hf_dir, tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text(f"hf-checkpoint: {hf_dir}\ntensor_model_parallel_size: 2\nactor-num-gpus-per-node: 4\n"
                 "lr: 1.0e-5\nsglang-mem-fraction-static: 0.5\nsequence_parallel: true\n")
    cfg = parse_config(["--config", str(y), "--lr", "2e-5"], validate=False)  # sglang-*: parsed, refused later
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.parallel.sequence_parallel is True
    assert cfg.optimizer.lr == 2e-5  # CLI wins
    assert cfg.rollout.sglang_args == {"mem_fraction_static": 0.5}


@pytest.mark.parametrize("text,match", [
    ("tensor-model-parallel-sise: 2\n", "unknown key 'tensor-model-parallel-sise'; did you mean 'tensor_model_parallel_size'"),
    ("lr: fast\n", "key 'lr' = 'fast'"),
    ("colocate: 3\n", "key 'colocate' must be true or false"),
    ("- a\n- b\n", "expected a mapping"),
])
def test_yaml_errors(tmp_path, text, match):
    y = tmp_path / "bad.yaml"
    y.write_text(text)
    with pytest.raises(ConfigError, match=match):
        parse_config(["--config", str(y)])


def test_yaml_missing_file():
    with pytest.raises(ConfigError, match="--config /no/such.yaml: no such file"):
        parse_config(["--config", "/no/such.yaml"])


def test_unknown_flag_suggests(hf_dir):
    with pytest.raises(ConfigError, match=r"unknown flag --tensor-model-parall-size \(did you mean "
                                          r"--tensor-model-parallel-size\?\)$"):
        parse_config(base(hf_dir, "--tensor-model-parall-size", "2"))


def test_bad_choice_and_type(hf_dir):
    with pytest.raises(ConfigError, match="--train-backend: invalid choice: 'deepspeed'"):
        parse_config(base(hf_dir, "--train-backend", "deepspeed"))
    with pytest.raises(ConfigError, match="--lr: invalid float value: 'x'"):
        parse_config(base(hf_dir, "--lr", "x"))


@pytest.mark.parametrize("extra,match", [
    (["--tensor-model-parallel-size", "3"], "world size 1 .* not divisible by TP x PP x CP = 3 x 1 x 1 = 3"),
    (["--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size 0 must be >= 1"),
    (["--virtual-pipeline-model-parallel-size", "2"], "needs --pipeline-model-parallel-size > 1"),
    (["--actor-num-gpus-per-node", "4", "--expert-model-parallel-size", "3"],
     "--expert-model-parallel-size 3 x expert TP 1 = 3 does not divide the 4 ranks"),
    (["--train-backend", "fsdp", "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"],
     "--train-backend fsdp shards over data parallelism only; --tensor-model-parallel-size 2 must be 1"),
    (["--use-dynamic-batch-size"], "--use-dynamic-batch-size needs --max-tokens-per-gpu"),
    (["--max-tokens-per-gpu", "100"], "--max-tokens-per-gpu only applies with --use-dynamic-batch-size"),
    (["--rollout-batch-size", "3", "--n-samples-per-prompt", "2", "--global-batch-size", "4"],
     "= 6 samples per rollout is not divisible by --global-batch-size 4"),
    (["--actor-num-gpus-per-node", "4", "--rollout-batch-size", "6", "--n-samples-per-prompt", "1",
      "--global-batch-size", "6", "--micro-batch-size", "1"],
     "--global-batch-size 6 is not divisible by --micro-batch-size 1 x data-parallel size 4"),
    (["--bf16", "--fp16"], "--bf16 and --fp16 are mutually exclusive"),
    (["--fp8-format", "e4m3"], "--fp8-format e4m3 needs transformer-engine"),
    (["--optimizer-cpu-offload"], "--optimizer-cpu-offload needs --use-precision-aware-optimizer"),
    (["--use-distributed-optimizer", "--optimizer-cpu-offload"],
     "--optimizer-cpu-offload needs --use-precision-aware-optimizer, as in Megatron-LM"),
    (["--optimizer-offload-fraction", "0.5"], "--optimizer-offload-fraction 0.5 has no effect without"),
    (["--optimizer-offload-fraction", "0"], r"--optimizer-offload-fraction 0 is out of range: it must lie in \(0, 1\]"),
    (["--lr", "0"], r"--lr 0 is out of range: it must lie in \(0, inf\)"),
    (["--grad-clip", "-1"], r"--grad-clip -1 is out of range: it must lie in \[0, inf\)"),
    (["--debug-train-only"], "--debug-train-only has no engine to generate with"),
    (["--debug-rollout-only", "--load-debug-rollout-data", "r/{rollout_id}.pt"], "mutually exclusive"),
    (["--load-debug-rollout-data", "r/data.pt"], "must contain '{rollout_id}'"),
    (["--save-interval", "5"], "--save-interval needs --save ROOT"),
    (["--save-max-to-keep", "2"], "--save-max-to-keep needs --save ROOT"),
    (["--opd-kl-coef", "0.5"], "--opd-kl-coef 0.5 needs a teacher"),
    (["--eval-interval", "5"], "--eval-interval needs --eval-prompt-data"),
    (["--rm-type", "math", "--custom-rm-path", "m:f"], "mutually exclusive; pick one reward"),
    (["--custom-rm-path", "my_rewards"], "must be module:function"),
    (["--prompt-data", "/no/prompts.jsonl"], "--prompt-data /no/prompts.jsonl: no such file"),
    # --use-kl-loss --kl-loss-coef 0 is slime's logged-only KL (tests/config/test_slime_eval_and_algorithm.py)
    (["--kl-loss-coef", "0.1"], "--kl-loss-coef 0.1 weights the KL loss term, which only exists with --use-kl-loss"),
    (["--use-kl-loss", "--kl-loss-coef", "-1"], r"--kl-loss-coef -1 is out of range: it must lie in \[0, inf\)"),
    (["--eps-clip", "0"], r"--eps-clip 0 is out of range: it must lie in \(0, inf\)"),
    (["--eps-clip-c", "0.5"], r"--eps-clip-c 0.5 is out of range: it must lie in \(1, inf\)"),
    (["--wall-time-limit", "10m", "--wall-time-reserve", "15m"], "leaves no time inside --wall-time-limit 600s"),
    (["--rollout-top-p", "0"], r"--rollout-top-p 0 is out of range: it must lie in \(0, 1\]"),
    (["--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2"], "not divisible by --rollout-num-gpus-per-engine 2"),
    (["--rollout-backend", "sglang", "--rollout-num-gpus", "1", "--update-weight-transport", "tensor"],
     "--update-weight-transport tensor hands CUDA IPC handles to engines on the SAME GPUs: it needs --colocate"),
])
def test_validation_errors_name_the_flag(hf_dir, extra, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(base(hf_dir, *extra))


def test_all_errors_are_reported_together(hf_dir):
    with pytest.raises(ConfigError) as exc:
        parse_config(base(hf_dir, "--bf16", "--fp16", "--save-interval", "3"))
    msg = str(exc.value)
    assert msg.startswith("invalid configuration:")
    assert "--bf16 and --fp16" in msg and "--save-interval needs --save" in msg


def test_missing_model_and_bad_hf_dir(tmp_path):
    with pytest.raises(ConfigError, match="no model to train: give --hf-checkpoint"):
        parse_config([])
    with pytest.raises(ConfigError, match=f"--hf-checkpoint {tmp_path}: no config.json there"):
        parse_config(["--hf-checkpoint", str(tmp_path)])


def test_slime_mode_semantics(hf_dir):
    cfg = parse_config(base(hf_dir, "--load-debug-rollout-data", "r/{rollout_id}.pt"))
    assert cfg.mode.train_only and not cfg.has_rollout_engine and cfg.has_training
    cfg = parse_config(base(hf_dir, "--colocate"))
    assert cfg.memory.effective_offload_train and cfg.memory.effective_offload_rollout
    assert cfg.memory.offload_train is False  # derived, not written back
    cfg = parse_config(base(hf_dir, "--debug-rollout-only"))
    assert cfg.has_rollout_engine and not cfg.has_training


def test_parse_duration():
    assert parse_duration("7d") == 7 * 86400
    assert parse_duration("90m") == 5400
    assert parse_duration("12h") == 43200
    assert parse_duration("30") == 30.0
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration("soon")


def test_input_is_not_mutated(hf_dir):
    argv = base(hf_dir, "--sglang-x", "1", "--colocate")
    before = list(argv)
    parse_config(argv, validate=False)
    assert argv == before


def test_collect_errors_is_empty_for_defaults(hf_dir):
    assert collect_errors(parse_config(base(hf_dir))) == []


def test_flags_doc_is_current():
    """docs/flags.md must be regenerated (python -m megatron_rl.config.docs) whenever a flag changes."""
    assert config_docs.DOC_PATH.read_text() == config_docs.render(), \
        "docs/flags.md is stale: run python -m megatron_rl.config.docs"


def test_model_shape_is_checked_through_the_planner(tiny_hf_models):
    hf = tiny_hf_models("qwen3_moe")  # 4 heads, 2 KV groups, 4 layers, 4 experts
    ok = parse_config(["--hf-checkpoint", hf, "--actor-num-gpus-per-node", "2", "--tensor-model-parallel-size", "2"])
    assert ok.parallel.tensor_model_parallel_size == 2
    with pytest.raises(ConfigError, match="4"):  # 2 KV groups are not divisible by TP 4
        parse_config(["--hf-checkpoint", hf, "--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "4"])
    with pytest.raises(ConfigError, match="layers"):
        parse_config(["--hf-checkpoint", hf, "--actor-num-gpus-per-node", "3", "--pipeline-model-parallel-size", "3",
                      "--rollout-batch-size", "3", "--n-samples-per-prompt", "1"])


def test_allocation_string_errors_name_the_flag(hf_dir):
    with pytest.raises(ConfigError, match="--allocation"):
        parse_config(base(hf_dir, "--allocation", "sglang:d0"))
    # the engines the string places are launched by this run (separate GPUs: the distributed transport); this
    # interpreter has no sglang package, so a real run is refused naming it
    no_sglang = "launches python -m sglang.launch_server with this interpreter, but .* has no sglang package"
    with pytest.raises(ConfigError, match=no_sglang):
        parse_config(base(hf_dir, "--allocation", "sglang:d2t4+megatron:d2t2", "--update-weight-transport",
                          "distributed"))
    with pytest.raises(ConfigError, match=no_sglang):
        parse_config(base(hf_dir, "--allocation", "sglang:d2t2|megatron:d2t2", "--update-weight-transport",
                          "distributed"))
    cfg = parse_config(base(hf_dir, "--allocation", "megatron:d2t2"))  # the embedded engine needs no component
    assert cfg.placement.allocation == "megatron:d2t2" and cfg.rollout.rollout_backend == "embedded"


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_allocation_engine_must_be_the_rollout_backend(hf_dir, engine):
    """An allocation naming SGLang/vLLM engines used to run the embedded engine in their place, silently."""
    with pytest.raises(ConfigError) as exc:
        parse_config(base(hf_dir, "--allocation", f"{engine}:d2|megatron:d2", "--rollout-backend", "embedded"))
    assert (f"--allocation '{engine}:d2|megatron:d2' places {engine} rollout engines but --rollout-backend is "
            "embedded") in str(exc.value)


NOT_YET = "not built in this version"
URLS = ["--rollout-engine-urls", "http://127.0.0.1:30000"]
EXTERNAL = ["--rollout-backend", "sglang", *URLS, "--update-weight-transport", "disk",
            "--update-weight-disk-dir", "/tmp/mrl-test-weights"]
BY_URL = "with --rollout-engine-urls: the servers of --rollout-engine-urls run where you started them; this run does not place them"


@pytest.mark.parametrize("extra,match", [
    # what this version does not build
    # the engines this run launches (tests/rollout/test_sglang_launcher.py starts them)
    (["--rollout-backend", "sglang", "--colocate", "--sglang-tp-size", "2"], "--sglang-tp-size: set by "
                                                                              "--rollout-num-gpus-per-engine"),
    (["--rollout-backend", "sglang", "--rollout-num-gpus", "1", "--sglang-port", "1"],
     "--sglang-port: set by the launcher (a free port per engine) for each engine this run launches; drop it"),
    (["--rollout-backend", "sglang", "--rollout-num-gpus", "1", "--sglang-device", "cpu",
      "--check-weight-update-equal"], "--check-weight-update-equal with --sglang-device cpu: SGLang compares the "
                                      "first update inside the server (/weights_checker), and its compare moves "
                                      "tensors to CUDA"),
    (["--update-weight-transport", "distributed"], "--update-weight-transport distributed broadcasts into SGLang "
                                                    "server processes over a process group, but --rollout-backend "
                                                    "embedded runs its engine inside the driver rank: there is no "
                                                    "server process to join the group"),
    ([*EXTERNAL, "--update-weight-transport", "distributed"], "--update-weight-disk-dir /tmp/mrl-test-weights is "
                                                              "only used by --update-weight-transport disk, not "
                                                              "distributed"),
    (["--rollout-backend", "sglang", *URLS, "--update-weight-transport", "tensor"],
     "--update-weight-transport tensor with --rollout-engine-urls: the tensor transport into SGLang servers this "
     "run did not start is " + NOT_YET),
    (["--rollout-backend", "sglang", "--colocate", "--update-weight-transport", "distributed"],
     "--update-weight-transport distributed with --colocate: NCCL cannot join two processes on the same GPU"),
    (["--load-debug-rollout-data", "r/{rollout_id}.pt", "--rollout-backend", "sglang"], "--rollout-backend sglang: "
                                                                                     "a train-only run"),
    # what the fsdp backend does not build yet
    (["--train-backend", "fsdp", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"],
     "--optimizer-offload-fraction with --train-backend fsdp: FSDP2's CPUOffloadPolicy"),
    (["--train-backend", "fsdp", "--recompute-granularity", "selective"], "--recompute-granularity selective with "
                                                                          "--train-backend fsdp: selective recompute"),
    (["--train-backend", "fsdp", "--opd-teacher-load", "/tmp", "--opd-kl-coef", "1"],
     "--opd-teacher-load /tmp with --train-backend fsdp: only HF model directories (config.json + *.safetensors) "
     "load into the fsdp backend yet, not torch_dist checkpoints; convert it (tools/convert_ckpt.py dist-to-hf)"),
    (["--train-backend", "fsdp", "--attention-dropout", "0.1"], "--attention-dropout 0.1 is a megatron-core "
                                                                "setting; --train-backend fsdp does not read it"),
    # slime's running-router flags: the router is given as the engine URL here
    (["--rollout-backend", "sglang", "--sglang-router-ip", "10.0.0.5", "--sglang-router-port", "3000"],
     "--sglang-router-ip --sglang-router-port (slime's running sglang-router): give the router as "
     "--rollout-engine-urls http://10.0.0.5:3000 instead"),
    ([*EXTERNAL, "--sglang-router-port", "3000"], "--sglang-router-port (slime's running sglang-router): give the "
                                                  "router as --rollout-engine-urls http://IP:3000"),
    (["--rollout-router", "on"], "--rollout-router on puts an sglang-router in front of the SGLang engines this "
                                 "run launches; the embedded engine starts none: drop it"),
    ([*EXTERNAL, "--rollout-router", "on"], "this run starts none: drop it (a router of yours is found by its URL: "
                                            "give its address as --rollout-engine-urls)"),
    # the disk transport's directory
    (["--update-weight-transport", "disk"], "--update-weight-transport disk needs --update-weight-disk-dir DIR"),
    (["--update-weight-transport", "disk", "--update-weight-disk-dir", __file__],
     f"--update-weight-disk-dir {__file__} exists and is not a directory"),
    (["--update-weight-disk-dir", "/tmp/w"], "--update-weight-disk-dir /tmp/w is only used by "
                                              "--update-weight-transport disk, not tensor"),
    # external servers: the URLs, and what means nothing for servers this run neither starts nor places
    (["--rollout-backend", "embedded", *URLS], "--rollout-engine-urls http://127.0.0.1:30000 names SGLang servers, "
                                               "but --rollout-backend is embedded"),
    ([*EXTERNAL[:2], "--rollout-engine-urls", "localhost", *EXTERNAL[4:]],  # (slime's host:port is http://host:port)
     "--rollout-engine-urls http://localhost: not a server address; write http://host:port"),
    ([*EXTERNAL, "--rollout-engine-urls", "http://a:1", "http://a:1"], "lists http://a:1 more than once"),
    ([*EXTERNAL, "--colocate"], "--colocate " + BY_URL),
    ([*EXTERNAL, "--offload-train"], "--offload-train " + BY_URL),
    ([*EXTERNAL, "--offload-rollout"], "--offload-rollout " + BY_URL),
    ([*EXTERNAL, "--use-fault-tolerance"], "--use-fault-tolerance restarts SGLang engines this run launches, and "
                                           "servers of --rollout-engine-urls are yours to restart"),
    (["--use-fault-tolerance"], "--use-fault-tolerance restarts SGLang engines this run launches, and "
                                "--rollout-backend embedded runs inside the driver rank"),
    (["--rollout-backend", "sglang", "--actor-num-nodes", "2", "--actor-num-gpus-per-node", "1", "--colocate",
      "--rollout-num-gpus-per-engine", "2", "--use-fault-tolerance"],
     "--use-fault-tolerance with engines of --rollout-num-gpus-per-engine 2, more than a node's 1: restarting an "
     "engine that spans nodes needs every node's part restarted together"),
    ([*EXTERNAL, "--rollout-num-gpus", "2"], "--rollout-num-gpus 2 places SGLang engines on their own GPUs; the "
                                             "servers of --rollout-engine-urls run where you started them"),
    ([*EXTERNAL, "--rollout-num-gpus-per-engine", "2"], "--rollout-num-gpus-per-engine 2 sizes SGLang engines"),
    ([*EXTERNAL, "--sglang-mem-fraction-static", "0.5"], "--sglang-mem-fraction-static: pass-through arguments of "
                                                         "SGLang servers; this run starts none"),
    ([*EXTERNAL, "--allocation", "sglang:d1|megatron:d1"], "--allocation sglang:d1|megatron:d1 places SGLang engines "
                                                           "on GPUs; with --rollout-engine-urls"),
    # where the embedded engine runs: only for it, and "all" only where every rank trains and generates
    ([*EXTERNAL, "--embedded-engine-ranks", "driver"], "--embedded-engine-ranks driver places the embedded engine, "
                                                       "but --rollout-backend is sglang"),
    (["--embedded-engine-ranks", "all", "--debug-rollout-only"], "--embedded-engine-ranks all puts an engine replica "
                                                                 "on every trainer rank, but this run has no trainer"),
    (["--embedded-engine-ranks", "all", "--debug-train-only", "--load-debug-rollout-data", "/tmp/r_{rollout_id}.pt"],
     "--embedded-engine-ranks all puts an engine replica on every trainer rank, but this run generates nothing"),
])
def test_unimplemented_engine_and_transports_are_refused_in_validation(hf_dir, extra, match, capsys):
    """Refused before any worker starts, ``--dry-run`` included (they used to pass and fail after the build)."""
    from megatron_rl.train import main

    with pytest.raises(ConfigError, match=re.escape(match)):
        parse_config(base(hf_dir, *extra))
    assert main(base(hf_dir, "--dry-run", *extra)) == 2
    out = capsys.readouterr()
    assert match in out.err and "dry run: configuration valid" not in out.out


def test_external_sglang_and_disk_are_accepted(hf_dir, tmp_path, capsys):
    """--rollout-backend sglang with running servers + the disk or the distributed transport; the disk
    transport with the embedded engine; --dry-run says the servers are not started here (and plans no GPUs for them)."""
    from megatron_rl.train import main

    ext = [*EXTERNAL[:-1], str(tmp_path / "w"), "--rollout-engine-urls", "http://10.0.0.5:30000",
           "https://[::1]:8443"]
    cfg = parse_config(base(hf_dir, *ext))
    assert cfg.rollout.rollout_engine_urls == ["http://10.0.0.5:30000", "https://[::1]:8443"]
    assert (cfg.sync.update_weight_transport, cfg.sync.update_weight_disk_dir) == ("disk", str(tmp_path / "w"))
    assert parse_config(base(hf_dir, *ext, "--debug-rollout-only")).has_training is False
    distributed = parse_config(base(hf_dir, *EXTERNAL[:4], "--update-weight-transport", "distributed"))
    assert (distributed.sync.update_weight_transport, distributed.sync.update_weight_disk_dir) == ("distributed", None)
    embedded = parse_config(base(hf_dir, "--update-weight-transport", "disk", "--update-weight-disk-dir",
                                 str(tmp_path / "new" / "w")))
    assert embedded.rollout.rollout_backend == "embedded" and embedded.sync.update_weight_transport == "disk"
    assert main(base(hf_dir, *ext, "--dry-run")) == 0
    out = capsys.readouterr().out
    assert "rollout: external SGLang servers, not started or placed by this run: http://10.0.0.5:30000" in out
    assert "total GPU demand: 1" in out and "no rollout engine" not in out


def test_embedded_engine_replicas_follow_the_run(hf_dir):
    """--embedded-engine-ranks auto: a replica on every rank when the run generates and trains."""
    assert parse_config(base(hf_dir)).embedded_replicas
    assert not parse_config(base(hf_dir, "--embedded-engine-ranks", "driver")).embedded_replicas
    assert not parse_config(base(hf_dir, "--debug-rollout-only")).embedded_replicas
    assert not parse_config(base(hf_dir, *EXTERNAL)).embedded_replicas


def test_refused_engine_still_gets_its_layout_checked(tiny_hf_models):
    """The planner still runs on a config whose engine is refused: a bad layout is reported with the refusal."""
    hf = tiny_hf_models("qwen3_moe")  # 2 KV groups: TP 4 is invalid
    with pytest.raises(ConfigError) as exc:
        parse_config(["--hf-checkpoint", hf, "--actor-num-gpus-per-node", "4", "--tensor-model-parallel-size", "4",
                      "--rollout-backend", "sglang", "--colocate", "--sglang-port", "1",
                      "--update-weight-transport", "disk", "--update-weight-disk-dir", "/tmp/mrl-test-weights"])
    msg = str(exc.value)
    assert msg.startswith("invalid configuration:") and "--sglang-port: set by the launcher" in msg
    assert len(msg.splitlines()) == 3  # the layout error and the refusal


# -- --allocation against the flags and the real world size --------
def test_allocation_sets_the_sizes_no_flag_gave(hf_dir, tiny_hf_models):
    """``--allocation megatron:d1t2`` used to train at TP 1 on 1 rank: now it is TP 2 on 2 ranks."""
    def sizes(cfg):
        p = cfg.parallel
        return (cfg.precision.train_backend, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                p.context_parallel_size, p.expert_model_parallel_size, p.expert_tensor_parallel_size,
                cfg.placement.actor_num_nodes, cfg.placement.actor_num_gpus_per_node)
    assert sizes(parse_config(base(hf_dir, "--allocation", "megatron:d1t2"))) == ("megatron", 2, 1, 1, 1, None, 1, 2)
    # the mapping itself (and --train-backend fsdp validates since the fsdp backend was built)
    fsdp = parse_config(base(hf_dir, "--allocation", "fsdp:d2p1t1"), validate=False)
    assert sizes(fsdp) == ("fsdp", 1, 1, 1, 1, None, 1, 2)
    validate_config(fsdp)
    assert sizes(parse_config(base(hf_dir, "--allocation", "megatron:d2p2", "--actor-num-nodes", "2",
                                   "--rollout-batch-size", "4"))) == ("megatron", 1, 2, 1, 1, None, 2, 2)
    moe = tiny_hf_models("qwen3_moe")
    hybrid = parse_config(["--hf-checkpoint", moe, "--allocation", "megatron:(attn:d2t2|ffn:d1t2e2)"])
    assert sizes(hybrid) == ("megatron", 2, 1, 1, 2, 2, 1, 4)
    flat = parse_config(["--hf-checkpoint", moe, "--allocation", "megatron:d2t2e2"])  # flat form: expert-TP 1
    assert sizes(flat) == ("megatron", 2, 1, 1, 2, 1, 1, 4)


@pytest.mark.parametrize("alloc, extra, match", [
    ("fsdp:d2p1t1", ["--train-backend", "megatron"],
     "--allocation 'fsdp:d2p1t1' trains the actor with fsdp but --train-backend is megatron"),
    ("megatron:d1t2", ["--tensor-model-parallel-size", "1"],
     "gives the actor t2 (tensor parallel) but --tensor-model-parallel-size is 1; drop --tensor-model-parallel-size"),
    ("megatron:d1p2", ["--pipeline-model-parallel-size", "1", "--actor-num-gpus-per-node", "2"],
     "gives the actor p2 (pipeline parallel) but --pipeline-model-parallel-size is 1"),
    ("megatron:d1t2", ["--actor-num-gpus-per-node", "4"],
     "gives the actor d*t*p*c = 2 ranks but --actor-num-nodes 1 x --actor-num-gpus-per-node 4 = 4"),
    ("sglang:d2", [], "--allocation 'sglang:d2' has no training component (megatron or fsdp) but this run trains"),
])
def test_allocation_and_flags_that_disagree_are_refused_by_name(hf_dir, alloc, extra, match):
    with pytest.raises(ConfigError) as exc:
        parse_config(base(hf_dir, "--allocation", alloc, *extra))
    assert match in str(exc.value)


def test_multi_policy_allocation_is_refused_by_the_trainer(hf_dir, capsys):
    """check_plan reports AReaL's multi-agent plan as valid; the trainer says it trains one policy per run."""
    from megatron_rl.train import main

    alloc = "vllm[rollout1]:d2t2 + fsdp[actor1]:d4 + vllm[rollout2]:d4 + fsdp[actor2]:d4"
    with pytest.raises(ConfigError,
                       match=r"trains 2 policies \(actor1, actor2\); this engine trains one policy per run"):
        parse_config(base(hf_dir, "--allocation", alloc))
    assert main(base(hf_dir, "--allocation", alloc, "--dry-run")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --allocation") and "one policy per run" in err[0]


def test_ranks_torchrun_launched_must_match_the_flags(hf_dir, monkeypatch):
    """WORLD_SIZE / LOCAL_WORLD_SIZE (set by torchrun) are the real world; validation used to trust the flags."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="torchrun launched WORLD_SIZE=2 rank.s. but the run is sized for "
                                          "--actor-num-nodes 1 x --actor-num-gpus-per-node 1 = 1 rank"):
        parse_config(base(hf_dir))
    assert parse_config(base(hf_dir, "--actor-num-gpus-per-node", "2")).actor_world_size == 2
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE=2 rank.s. per node but --actor-num-gpus-per-node is 4"):
        parse_config(base(hf_dir, "--actor-num-gpus-per-node", "4"))
    cfg = parse_config(base(hf_dir, "--allocation", "megatron:d4"))  # 2 nodes x 2, from torchrun's node size
    assert (cfg.placement.actor_num_nodes, cfg.placement.actor_num_gpus_per_node) == (2, 2)


def test_run_outside_torchrun_is_one_rank(hf_dir, monkeypatch, capsys, tmp_path):
    """``--allocation megatron:d1t2`` without torchrun used to train at TP 1 on 1 rank and exit 0."""
    from megatron_rl.train import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    tiny = ["--num-rollout", "1", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
            "--rollout-max-response-len", "4", "--output-dir", str(tmp_path / "run")]
    assert main(base(hf_dir, "--allocation", "megatron:d1t2", *tiny)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: this is a single process (not launched by torchrun")
    assert "= 2 ranks (from --allocation 'megatron:d1t2'); launch it with torchrun --nproc-per-node 2" in err[0]


@pytest.mark.parametrize("alloc, extra, match", [
    ("sglang:d2|megatron:d2", ["--rollout-num-gpus", "4"],
     "--allocation 'sglang:d2|megatron:d2' gives all rollout engines' GPUs = 2 but --rollout-num-gpus is 4"),
    ("sglang:d2t2|megatron:d2t2", ["--rollout-num-gpus-per-engine", "1"],
     "gives one engine's t*p = 2 but --rollout-num-gpus-per-engine is 1"),
    ("sglang:d2+megatron:d2", ["--colocate"],
     "--colocate puts the rollout engines on the actor's GPUs but --allocation 'sglang:d2+megatron:d2' places them"),
    ("megatron:d2", ["--rollout-num-gpus", "2"],
     "--allocation 'megatron:d2' has no rollout engine but --rollout-num-gpus is 2"),
])
def test_allocation_and_rollout_flags_that_disagree_are_refused(hf_dir, alloc, extra, match):
    with pytest.raises(ConfigError) as exc:
        parse_config(base(hf_dir, "--allocation", alloc, *extra))
    assert match in str(exc.value)


def test_allocation_sets_the_rollout_sizes_no_flag_gave():
    from megatron_rl.config.placement import apply_allocation

    values = {g: {} for g in ("model", "parallel", "precision", "placement", "rollout")}
    values["placement"]["allocation"] = "sglang:d2t2|megatron:d2t2"
    apply_allocation(values)
    r = values["rollout"]
    assert (r["rollout_num_gpus"], r["rollout_num_gpus_per_engine"], r["rollout_backend"]) == (4, 2, "sglang")


def test_allocation_numbers_are_ascii_and_bounded_in_the_trainer(hf_dir):
    """Full-width digits were accepted, a 5001-digit size raised a raw ValueError; now a named refusal,
    listed with the other errors."""
    with pytest.raises(ConfigError, match="--allocation: bad allocation 'megatron:d\uff12' at column 11: "
                                          "'\uff12' is not an ASCII digit"):
        parse_config(base(hf_dir, "--allocation", "megatron:d\uff12"))
    with pytest.raises(ConfigError) as exc:
        parse_config(base(hf_dir, "--allocation", "megatron:d" + "9" * 5001, "--lr", "-1"))
    msg = str(exc.value)
    assert "--lr -1 is out of range: it must lie in (0, inf)" in msg and "data parallel size d<5001 digits> is too large" in msg


def test_dry_run_plans_the_embedded_engine_next_to_an_allocation_actor(hf_dir, capsys):
    """``--allocation megatron:d1t2`` with the embedded engine used to print "training only: no rollout
    engine will be started"; the engine runs in the driver, on the actor's devices, as the flags path plans it."""
    from megatron_rl.train import main

    assert main(base(hf_dir, "--allocation", "megatron:d1t2", "--dry-run")) == 0
    out = capsys.readouterr().out
    assert "allocation: sglang[rollout]:d2|megatron:d1t2" in out and "no rollout engine" not in out
    assert main(base(hf_dir, "--allocation", "megatron:d1t2", "--dry-run",
                     "--load-debug-rollout-data", "r/{rollout_id}.pt")) == 0
    out = capsys.readouterr().out
    assert "allocation: megatron:d1t2" in out and "training only: no rollout engine will be started" in out

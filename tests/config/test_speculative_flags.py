"""--speculative-*: refused by name where the draft cannot run (no MTP layers, a tree, a trainer that cannot sync
the MTP layers, ...), accepted where it can, and given to a launched SGLang engine under SGLang's own names."""

import pytest

from megatron_rl.config import collect_errors, parse_config
from megatron_rl.rollout.sglang.launcher import sglang_speculative_args


@pytest.fixture(scope="module")
def mtp_dir(tiny_hf_models):
    return tiny_hf_models("deepseek_v3", mtp=True)


def errors(*argv):
    return "\n".join(collect_errors(parse_config(list(argv), validate=False)))


def test_accepted_with_the_mtp_layers_on_the_trainer(mtp_dir):
    ok = errors("--hf-checkpoint", mtp_dir, "--speculative-algorithm", "NEXTN", "--mtp-num-layers", "1",
                "--enable-mtp-training")
    assert "speculative" not in ok


@pytest.mark.parametrize("extra, match", [
    (["--speculative-eagle-topk", "4"], "--speculative-eagle-topk 4: the embedded engine drafts a chain"),
    (["--speculative-num-steps", "2", "--speculative-num-draft-tokens", "5"],
     "--speculative-num-draft-tokens 5: a chain of --speculative-num-steps 2 verifies 3 tokens"),
    (["--use-rollout-routing-replay"], "--speculative-algorithm NEXTN with --use-rollout-routing-replay"),
])
def test_embedded_engine_refusals_name_the_flag(mtp_dir, extra, match):
    assert match in errors("--hf-checkpoint", mtp_dir, "--speculative-algorithm", "NEXTN", "--mtp-num-layers", "1",
                           *extra)


def test_model_and_trainer_refusals(mtp_dir, tiny_hf_models):
    assert "has no MTP layers" in errors("--hf-checkpoint", tiny_hf_models("qwen2"), "--speculative-algorithm",
                                         "EAGLE")
    assert "add --mtp-num-layers 1" in errors("--hf-checkpoint", mtp_dir, "--speculative-algorithm", "NEXTN")
    assert "--speculative-num-steps 5 needs --speculative-algorithm" in errors(
        "--hf-checkpoint", mtp_dir, "--speculative-num-steps", "5")


def test_sglang_gets_sglangs_names(mtp_dir):
    cfg = parse_config(["--hf-checkpoint", mtp_dir, "--speculative-algorithm", "NEXTN", "--speculative-num-steps",
                        "2"], validate=False)
    assert sglang_speculative_args(cfg.rollout) == ["--speculative-algorithm", "NEXTN", "--speculative-num-steps",
                                                    "2", "--speculative-eagle-topk", "1",
                                                    "--speculative-num-draft-tokens", "3"]
    both = errors("--hf-checkpoint", mtp_dir, "--rollout-backend", "sglang", "--speculative-algorithm", "NEXTN",
                  "--sglang-speculative-algorithm", "EAGLE")
    assert "give them one way, not both" in both

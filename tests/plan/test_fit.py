"""The fit verdict (plan/fit.py), the GPU-path activation terms (plan/activations.py, te kernels) and the engine GPU
(plan/engine_memory.py) on published configs, figures computed by hand here; the fixes' figures equal a fresh
estimate of the flags each names; tools/check_plan.py's exit codes. The CPU path's terms are measured against
megatron-core in tests/plan/test_activations.py."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.plan.activations import ActivationFlags, logits_peak, stage_activations
from megatron_rl.plan.engine_memory import EngineSpec, engine_rows, kv_bytes_per_token
from megatron_rl.plan.memory import GIB, MegatronLayout, ModelArch

REPO = Path(__file__).resolve().parents[2]
LLAMA3_70B = dict(model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                  num_attention_heads=64, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
LLAMA3_8B = dict(LLAMA3_70B, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)


def test_llama3_70b_te_layer_by_hand():
    """TP 8 with sequence parallelism, 8192 tokens, bf16: h 8192, 8 query heads and 1 KV group of 128 per rank, FFN
    3584 per rank, 1024 tokens per rank in the SP regions. Per layer: input norm 1024 x (2 h + 4) = 16,781,312;
    qkv input 1024 x 2 h = 16,777,216; q, k, v 8192 x 2 x 128 x (8 + 2) = 20,971,520, output 8192 x 2 x 128 x 8 =
    16,777,216, lse 8192 x 4 x 8 = 262,144; pre-MLP norm 16,781,312; fc1 input 1024 x 2 h = 16,777,216, fc1 output
    8192 x 2 x 2 x 3584 = 117,440,512, fc2 input 8192 x 2 x 3584 = 58,720,256: 281,288,704 bytes."""
    arch = ModelArch.from_hf_config(LLAMA3_70B)
    lay = MegatronLayout(world=64, tp=8, pp=4)
    fl = ActivationFlags(tokens=8192, sequence_parallel=True)
    per_layer = 281_288_704
    first = stage_activations(arch, lay, fl, 0)
    assert first.per_microbatch == 20 * per_layer + 8192 * 8  # + the token ids
    assert first.in_flight == 4 and first.logits == 0 and first.recompute_working == 0
    # an output layer that is not a plain projection (logprob_path "loss_rows"): its logits whole
    rows_fl = ActivationFlags(tokens=8192, sequence_parallel=True, logprob_path="loss_rows")
    last = stage_activations(arch, lay, rows_fl, 3)
    # final norm (SP) + the output layer's gathered input; logits [8192, 129024 / 8] kept and their gradient (bf16),
    # two fp32 chunk temporaries capped at 64 MiB
    assert last.per_microbatch == 20 * per_layer + 16_781_312 + 8192 * 2 * 8192
    assert last.logits == logits_peak(arch, lay, rows_fl) == 2 * 8192 * 16128 * 2 + 2 * 64 * 2 ** 20
    assert last.in_flight == 1 and last.peak == last.per_microbatch + last.logits
    # response-only log-probs: the loss rows at half the tokens halve the kept logits and their gradient
    half = stage_activations(arch, lay, dataclasses.replace(rows_fl, response_share=0.5), 3)
    assert half.logits == last.logits and half.logits_response == 2 * 4096 * 16128 * 2 + 2 * 64 * 2 ** 20
    # the default: the projection inside the log-prob op, 64 MiB // (4 x 16128) = 1040 rows a chunk. Its backward
    # holds the most: the fp32 weight-grad accumulator 4 x 16128 x 8192, the hidden rows' gradient 8192 x 8192 x 2,
    # 20 bytes per row of statistics, and the larger of one chunk's working set (bf16 logits and two fp32
    # temporaries, 1040 x 16128 x (2 + 8)) and a chunk's bf16 gradient with its bf16 [V/TP, h] weight product
    # (1040 x 16128 x 2 + 2 x 16128 x 8192): here the product, h being large
    fixed = 4 * 16128 * 8192 + 8192 * 8192 * 2 + 8192 * 20
    chunked = stage_activations(arch, lay, fl, 3)
    assert chunked.per_microbatch == last.per_microbatch
    assert chunked.logits == fixed + 1040 * 16128 * 2 + 2 * 16128 * 8192  # 0.89 GiB
    # at 8192 rows the op's [V/TP, h] buffers outweigh the logits it never keeps (0.62 GiB whole); at 65,536 rows
    # (a long trace) it holds 1.77 GiB where the whole logits take 4.06 GiB
    assert chunked.logits > last.logits
    long = ActivationFlags(tokens=65536, sequence_parallel=True)
    assert logits_peak(arch, lay, long) < logits_peak(arch, lay, dataclasses.replace(long, logprob_path="loss_rows")) / 2
    # --log-probs-chunk-size 4096: the chunk's working set, 4096 x 16128 x 10, is the larger one
    big = stage_activations(arch, lay, dataclasses.replace(fl, logprob_chunk_rows=4096), 3)
    assert big.logits == fixed + 4096 * 16128 * 10
    # full recompute, one layer per unit: each layer keeps its (SP) input, one layer re-materialised in its backward
    full = stage_activations(arch, lay, ActivationFlags(tokens=8192, sequence_parallel=True,
                                                        recompute_granularity="full"), 1)
    assert full.per_microbatch == 20 * 1024 * 2 * 8192 and full.recompute_working == per_layer
    assert full.peak == 3 * full.per_microbatch + per_layer


def test_interleaved_first_stage_holds_more_microbatches():
    arch = ModelArch.from_hf_config(LLAMA3_70B)
    s0 = stage_activations(arch, MegatronLayout(world=64, tp=8, pp=4, vpp=5), ActivationFlags(tokens=4096), 0)
    assert s0.in_flight == 4 * (1 + 3 / 20)


def test_kv_cache_per_token_and_the_engine_pool():
    """Qwen3-30B-A3B on an engine of TP 8: 48 layers x K and V x one KV head (4 groups replicated over 8 ranks) x 128
    x 2 bytes = 24,576 B per token. DeepSeek-V3's MLA: 61 layers x (512 + 64) x 2 = 70,272 B on every TP rank."""
    qwen = ModelArch(model_type="qwen3_moe", hidden=2048, heads=32, groups=4, head_dim=128, vocab=151936, layers=48,
                     ffn=6144, experts=128, moe_ffn=768, moe_layers=(1,) * 48, topk=8)
    assert kv_bytes_per_token(qwen, 8) == 24_576 and kv_bytes_per_token(qwen, 2) == 48 * 2 * 2 * 128 * 2
    ds = ModelArch(model_type="deepseek_v3", hidden=7168, heads=128, groups=128, head_dim=56, vocab=129280,
                   layers=61, ffn=18432, mla=(1536, 512, 128, 64, 128))
    assert kv_bytes_per_token(ds, 8) == 61 * 576 * 2
    spec = EngineSpec(qwen, tp=8, mem_fraction=0.7)
    rows, pool = engine_rows(spec, 79.6 * GIB)
    weights = rows[0].device
    assert pool == 0.7 * 79.6 * GIB - weights and rows[1].device == pool
    assert f"{pool / 24_576:,.0f} tokens" in rows[1].note


def _cfg(tmp_path, *extra):
    from megatron_rl.config import parse_config

    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(LLAMA3_8B))
    return parse_config(["--hf-checkpoint", str(d), "--debug-train-only", "--load-debug-rollout-data",
                         str(tmp_path / "r{rollout_id}.pt"), "--bf16", "--use-dynamic-batch-size",
                         "--max-tokens-per-gpu", "4096", "--actor-num-gpus-per-node", "2", *extra])


def test_each_fix_is_a_fresh_estimate_of_the_flags_it_names(tmp_path):
    """Llama-3-8B on 2 H100s at DP 2 without the distributed optimizer: 154.69 GiB at the peak (its logits
    peak 3.00 GiB: the chunked log-prob op's fp32 [V, h] weight-gradient accumulator and bf16 [V, h] product, 2.94 GiB
    at TP 1, outweigh the 4,096 rows' logits it never keeps). Every fix listed
    gives the plan's figure when its flags are parsed and estimated from scratch; the list runs from the most
    headroom to the least."""
    from megatron_rl.config.static_memory import fit_report, fit_with_fixes
    from megatron_rl.plan.fit import format_fit

    fit, _, fixes = fit_with_fixes(_cfg(tmp_path))
    assert [s.describe() for s in fit.shortfalls()] == [
        "trainer on rank 0's GPU (train: static + activation peak) needs 154.69 GiB, the GPU has 79.60 GiB: "
        "75.09 GiB short"]
    assert [flag for flag, _ in fixes] == ["--optimizer-cpu-offload --use-precision-aware-optimizer",
                                           "--tensor-model-parallel-size 2"]
    heads = [new.headroom() for _, new in fixes]
    assert heads == sorted(heads, reverse=True)
    for flag, new in fixes:
        fresh, _ = fit_report(_cfg(tmp_path, *flag.split()))
        assert fresh is not None and fresh.heaviest() == new.heaviest() and not fresh.shortfalls()
    text = "\n".join(format_fit(fit, fixes))
    assert "verdict: does NOT fit H100-80G: 79.6 GiB:" in text
    assert "2. --tensor-model-parallel-size 2: peak 79.41 GiB (static 67.31 GiB + activations 12.10 GiB)" in text


def run(*args):
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "check_plan.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stdout, proc.stderr


def test_check_plan_fit_verdict_and_exit_codes(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA3_8B))
    base = ("megatron:d2", "--model-config", str(cfg), "--bf16", "--max-tokens-per-gpu", "4096")
    rc, out, err = run(*base)
    assert rc == 2 and "verdict: does NOT fit H100-80G" in out and "2. --tensor-model-parallel-size 2" in out
    assert "the plan does not fit the GPU's memory" in err and "--allow-over-memory" in err
    rc, out, err = run(*base, "--allow-over-memory")
    assert rc == 0 and "check_plan: warning: the plan does not fit" in err
    rc, out, err = run(*base, "--json", "--gpu-type", "H200-141G", "--use-distributed-optimizer")
    mem = json.loads(out)["memory"][0]
    assert rc == 0 and mem["fits"] and mem["headroom_bytes"] == pytest.approx(140.4 * GIB - mem["peak"]["total_bytes"])
    assert mem["activations"]["actor"][0]["logits_bytes"] > 0 and mem["fixes"] == []


def test_colocated_phases_of_one_gpu():
    """A trainer rank and an engine shard on one GPU: train = static + activation peak + the sleeping engine's
    reserve; sync = the sleeping trainer's parameters + the engine's weights + one bucket + the reserve; generate =
    the parameters + the weights + the pool, which is what the fraction leaves, + the reserve (fraction x GPU +
    reserve in all)."""
    from megatron_rl.plan.engine_memory import ENGINE_RESERVE_GIB, colocated_phases, engine_weight_bytes

    arch = ModelArch.from_hf_config(LLAMA3_8B)
    spec = EngineSpec(arch, tp=2, mem_fraction=0.7)
    gpu, reserve, weights = 79.6 * GIB, ENGINE_RESERVE_GIB * GIB, engine_weight_bytes(arch, 2)
    (train, sync, generate), pool = colocated_phases(20 * GIB, 10 * GIB, 4 * GIB, spec, gpu, 0.5 * GIB)
    assert train.total == 30 * GIB + reserve
    assert sync.total == 4 * GIB + weights + 0.5 * GIB + reserve
    assert pool == 0.7 * gpu - weights - 4 * GIB and generate.total == pytest.approx(0.7 * gpu + reserve)

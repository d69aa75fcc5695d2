"""LoRA adapters on megatron-core (megatron_rl/models/lora.py) equal HF PEFT's on the HF model, at every
layout, in ONE 2-rank torchrun (scripts/lora_worker.py re-initialises megatron's groups per layout).

PEFT's adapter gets random A and B, our adapters load its tensors (each rank its slice), and per layout:
logits equal HF + PEFT (fp32), with the adapters disabled they equal the plain HF model (the reference
policy of a LoRA run), every adapter tensor's gradient through megatron DDP equals PEFT's autograd of the
same loss, no base parameter has a gradient, grad buffer or optimizer state, and after one optimizer
step the base weights are bitwise unchanged while the adapters moved. Layouts: DP2 (the reference), TP2,
TP2 + sequence parallel with the distributed optimizer and a partial target list (q_proj, v_proj,
down_proj: the fused linears' other parts stay unadapted), PP2, and EP2 on an MoE model (attention
adapters; expert linears are refused, tests/models/test_lora.py). ~40 s. TP2 x PP2 in a 4-rank launch.
"""

import pytest

from _util import read_json

pytestmark = pytest.mark.dist

LOGIT_TOL = 1e-5
GRAD_RTOL = 1e-5


def _two_rank_entries(tiny_hf_models):
    qwen2, qwen3, llama, moe = (tiny_hf_models(f) for f in ("qwen2", "qwen3", "llama", "qwen3_moe"))
    return [  # name:family:hf_dir:tp,pp,ep,sp,distopt:targets
        f"dp2:qwen2:{qwen2}:1,1,1,0,0:all-linear",
        f"tp2:qwen2:{qwen2}:2,1,1,0,0:all-linear",
        f"tp2_sp_distopt:qwen3:{qwen3}:2,1,1,1,1:q_proj+v_proj+down_proj",
        f"pp2:llama:{llama}:1,2,1,0,0:all-linear",
        f"ep2:qwen3_moe:{moe}:1,1,2,0,0:q_proj+k_proj+v_proj+o_proj",
    ]


def _four_rank_entries(tiny_hf_models):
    """TP2 x PP2 on 4 ranks: column/row-parallel adapter slices on each pipeline stage."""
    return [f"tp2_pp2:llama:{tiny_hf_models('llama')}:2,2,1,0,0:all-linear"]


def shared_launch(ctx):
    """The 2- and 4-rank jobs of this file's layouts in the group's launches (tests/_launches.py):
    {ranks: (results, entries)}."""
    out = ctx.tmp_path_factory.mktemp("lora")
    entries = {2: _two_rank_entries(ctx.tiny_hf_models), 4: _four_rank_entries(ctx.tiny_hf_models)}
    yield {n: [("lora", [out / f"r{n}.json", *e])] for n, e in entries.items()}
    return {n: (read_json(out / f"r{n}.json"), e) for n, e in entries.items()}


def test_lora_layouts_equal_peft(shared_launch_state):
    check(*shared_launch_state[2])


def test_lora_tp2_pp2_equals_peft(shared_launch_state):
    check(*shared_launch_state[4], pp_stages=2, tp=2)


def check(results, entries, pp_stages=1, tp=1):
    assert set(results) == {e.split(":")[0] for e in entries}
    for name, ranks in results.items():
        for rec in ranks:
            print(name, {k: v for k, v in rec.items() if k != "layout"})
            assert rec["vs_peft"] <= LOGIT_TOL and rec["disabled_vs_hf"] <= LOGIT_TOL, (name, rec)
            assert rec["adapter_moves_logits"] > 0.1, (name, rec)  # the adapters are not a no-op
            assert rec["grad_max_abs_diff"] <= GRAD_RTOL * max(1.0, rec["grad_max_abs"]), (name, rec)
            assert rec["trainable_are_adapters"] and rec["base_grads"] == 0, (name, rec)
            assert rec["grad_buffer_params"] == rec["optimizer_params"] == rec["adapter_params"] > 0, (name, rec)
            assert rec["optim_ok"] and rec["base_unchanged"] and rec["adapters_moved"], (name, rec)
            # --lora-sync adapter: the TP/PP-gathered adapters are PEFT's, and the engine's float32 merge of them
            # is the trainer's merged export bit for bit
            assert rec["gathered_adapters_equal"] and rec["engine_merge_max_diff"] == 0.0, (name, rec)
        # every PEFT tensor is held somewhere: all of them on each rank, or split between the PP stages
        held = [r["adapter_tensors_here"] for r in ranks]
        want = ranks[0]["peft_tensors"]
        stages = 2 if name == "pp2" else pp_stages
        assert sum(held) == want * len(held) // stages and len(set(held)) == 1, (name, held, want)

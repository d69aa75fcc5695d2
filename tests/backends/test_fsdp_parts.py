"""The FSDP backend's pure parts: the padding fallback and megatron's optimizer semantics."""

import math

import pytest
import torch

from megatron_rl.backends.fsdp.optim import MegatronLRSchedule, clip_grad_norm, param_groups
from megatron_rl.backends.fsdp.padding import unpack_to_rows
from megatron_rl.backends.loss_rows import padded_loss_rows, select_hf_rows
from megatron_rl.data.packing import pack_samples
from megatron_rl.data.types import Sample


def _samples():
    return [Sample(group_index=0, prompt_ids=[5, 6, 7], response_ids=[8, 9]),
            Sample(group_index=0, prompt_ids=[11], response_ids=[12, 13, 14, 15]),
            Sample(group_index=1, prompt_ids=[21, 22], response_ids=[23])]


def test_padded_rows_pick_the_packed_response_positions():
    """Each response token's logits row in the padded layout is the one the packed layout picks."""
    mb = pack_samples(_samples(), [2, 0, 1])
    rows = unpack_to_rows(mb, pad_token_id=0)
    assert rows.input_ids.tolist() == [[21, 22, 23, 0, 0], [5, 6, 7, 8, 9], [11, 12, 13, 14, 15]]
    assert rows.attention_mask.sum(1).tolist() == [3, 5, 5]
    # stand-in "hidden states": the token at each position, so a picked row says where it came from
    loss_rows = padded_loss_rows(mb, rows.response_rows, rows.response_cols, rows.input_ids.shape[1])
    padded = select_hf_rows(loss_rows)(rows.input_ids[..., None].float())[0]
    packed = mb.gather_response(mb.tokens[:, None].float())
    assert torch.equal(padded, packed)
    # and each picked position is the one right before its target token
    assert padded[:, 0].long().tolist() == [22, 7, 8, 11, 12, 13, 14]
    assert mb.response_target_ids.tolist() == [23, 8, 9, 12, 13, 14, 15]


def test_empty_micro_batch_is_one_pad_row_with_no_response():
    mb = pack_samples(_samples(), [])
    rows = unpack_to_rows(mb, pad_token_id=0)
    assert rows.input_ids.tolist() == [[0]] and rows.attention_mask.tolist() == [[1]]
    loss_rows = padded_loss_rows(mb, rows.response_rows, rows.response_cols, 1)
    assert loss_rows.empty and loss_rows.rows.tolist() == [0]  # the one placeholder row the lm_head still runs


def test_param_groups_follow_megatron_no_decay_rule():
    lin, norm = torch.nn.Linear(3, 4), torch.nn.LayerNorm(4)
    named = [("layer.proj.weight", lin.weight), ("layer.proj.bias", lin.bias), ("norm.weight", norm.weight)]
    decay, no_decay = param_groups(named)
    assert decay["params"] == [lin.weight] and decay["wd_mult"] == 1.0
    assert no_decay["params"] == [lin.bias, norm.weight] and no_decay["wd_mult"] == 0.0


@pytest.mark.parametrize("style,warmup,decay", [("constant", 0, 10), ("constant", 3, 10), ("linear", 2, 10),
                                                ("cosine", 0, 8), ("cosine", 3, 8),
                                                ("inverse-square-root", 2, 10)])
def test_lr_schedule_equals_megatron_optimizer_param_scheduler(style, warmup, decay):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    def optimizer():
        w = torch.nn.Parameter(torch.zeros(2, 2))
        b = torch.nn.Parameter(torch.zeros(2))
        return torch.optim.AdamW([{"params": [w], "wd_mult": 1.0}, {"params": [b], "wd_mult": 0.0}], lr=1.0)

    ours_opt, theirs_opt = optimizer(), optimizer()
    ours = MegatronLRSchedule(ours_opt, max_lr=1e-3, min_lr=1e-5, warmup_steps=warmup, decay_steps=decay,
                              decay_style=style, weight_decay=0.1)
    # the arguments MegatronBackend.initialize passes
    theirs = OptimizerParamScheduler(theirs_opt, init_lr=0.0 if warmup else 1e-3, max_lr=1e-3, min_lr=1e-5,
                                     lr_warmup_steps=warmup, lr_decay_steps=max(decay, warmup + 1),
                                     lr_decay_style=style, start_wd=0.1, end_wd=0.1, wd_incr_steps=1,
                                     wd_incr_style="constant")
    for _ in range(decay + 3):
        for g0, g1 in zip(ours_opt.param_groups, theirs_opt.param_groups):
            assert g0["lr"] == pytest.approx(g1["lr"], rel=1e-12, abs=0)
            assert g0["weight_decay"] == g1["weight_decay"]
        ours.step()
        theirs.step(increment=1)


def test_grad_clip_follows_megatron_rule():
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.tensor([3.0, 4.0, 0.0, 0.0])
    assert clip_grad_norm([p], 1.0) == pytest.approx(5.0)
    assert p.grad.norm().item() == pytest.approx(5.0 / (5.0 + 1e-6))
    p.grad = torch.tensor([0.3, 0.4, 0.0, 0.0])
    assert clip_grad_norm([p], 1.0) == pytest.approx(0.5) and torch.equal(p.grad, torch.tensor([0.3, 0.4, 0, 0]))
    p.grad = torch.tensor([math.inf, 0.0, 0.0, 0.0])
    assert not math.isfinite(clip_grad_norm([p], 1.0))  # the backend skips the step

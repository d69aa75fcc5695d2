"""Logits only at loss rows (backends/loss_rows.py): which rows, where their results land, the hook."""

import pytest
import torch

from megatron_rl.backends.fsdp.padding import unpack_to_rows
from megatron_rl.backends.loss_rows import keep_rows, packed_loss_rows, padded_loss_rows, select_hf_rows
from megatron_rl.data.packing import pack_samples
from megatron_rl.data.types import Sample
from megatron_rl.models import cp_utils


def _agentic_samples():
    """Multi-turn shapes: observation spans (mask 0) inside responses, one sample with no loss at all."""
    return [Sample(group_index=0, prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11, 12, 13],
                   loss_mask=[1, 1, 0, 0, 1, 1]),
            Sample(group_index=0, prompt_ids=[21], response_ids=[22, 23, 24], loss_mask=[0, 0, 0]),
            Sample(group_index=1, prompt_ids=[31, 32], response_ids=[33, 34, 35, 36, 37])]


def test_packed_rows_are_the_loss_positions_and_results_land_response_aligned():
    mb = pack_samples(_agentic_samples(), [0, 1, 2])
    rows = packed_loss_rows(mb)
    keep = mb.loss_mask != 0
    assert rows.count == int(keep.sum()) == 9
    assert torch.equal(rows.rows, mb.response_positions[keep])
    assert torch.equal(rows.targets, mb.response_target_ids[keep])
    # each kept row's next token is its target: the row predicts exactly the token that carries loss
    assert torch.equal(mb.tokens[rows.rows + 1], rows.targets)
    per_row = rows.targets.double()
    back = rows.to_response(per_row)
    assert back.shape == mb.loss_mask.shape
    assert torch.equal(back[keep], per_row) and not back[~keep].any()


def test_to_response_carries_gradients_to_the_kept_rows_only():
    mb = pack_samples(_agentic_samples(), [0, 2])
    rows = packed_loss_rows(mb)
    values = torch.randn(rows.rows.numel(), requires_grad=True)
    weights = torch.randn(mb.loss_mask.numel())
    (rows.to_response(values) * weights).sum().backward()
    assert torch.equal(values.grad, weights[mb.loss_mask != 0])


def test_micro_batch_without_loss_keeps_one_placeholder_row():
    mb = pack_samples(_agentic_samples(), [1])
    rows = packed_loss_rows(mb)
    assert rows.empty and rows.rows.tolist() == [0] and rows.targets.tolist() == [0]
    placeholder = torch.tensor([3.0], requires_grad=True)
    out = rows.to_response(placeholder)
    assert out.tolist() == [0.0, 0.0, 0.0]
    # still a function of the placeholder row: the rank backpropagates through its model like its peers
    # (a CP rank whose shard has no loss row would otherwise skip the backward's CP collectives and hang)
    out.sum().backward()
    assert placeholder.grad is not None and placeholder.grad.tolist() == [0.0]
    shard = rows.to_rows(placeholder, 4)
    assert shard.tolist() == [0.0] * 4 and shard.grad_fn is not None


@pytest.mark.parametrize("cp", [2, 3])
def test_cp_shards_split_the_loss_rows_exactly_once(cp):
    """Under CP each rank keeps the loss rows in its shard; the CP all-gather of the per-row results
    (to_rows, then the gathered order) reassembles every loss row's value, once."""
    mb = pack_samples(_agentic_samples(), [0, 1, 2], pad_to_multiple=2 * cp)
    full = packed_loss_rows(mb)
    value_of_position = torch.arange(mb.num_tokens, dtype=torch.float64) + 100.0
    shards, seen = [], []
    for r in range(cp):
        local_index = cp_utils.cp_local_index(mb.cu_seqlens, r, cp)
        rows = packed_loss_rows(mb, local_index)
        global_rows = local_index[rows.rows[:rows.count]]
        seen += global_rows.tolist()
        assert torch.equal(mb.tokens[global_rows + 1], rows.targets[:rows.count])
        shards.append(rows.to_rows(value_of_position[global_rows] if rows.count else torch.zeros(1),
                                   mb.num_tokens // cp))
    assert sorted(seen) == sorted(full.rows.tolist())
    gathered = cp_utils.unshard_packed_from_cp(shards, mb.cu_seqlens)
    got = mb.gather_response(gathered)
    keep = mb.loss_mask != 0
    assert torch.equal(got[keep], value_of_position[full.rows]) and not got[~keep].any()


def test_padded_rows_match_the_packed_rows():
    mb = pack_samples(_agentic_samples(), [2, 0, 1])
    padded = unpack_to_rows(mb)
    rows = padded_loss_rows(mb, padded.response_rows, padded.response_cols, padded.input_ids.shape[1])
    picked = select_hf_rows(rows)(padded.input_ids[..., None])[0, :, 0]
    assert torch.equal(picked, mb.tokens[packed_loss_rows(mb).rows])


def test_keep_rows_feeds_the_layer_the_selected_rows_and_removes_its_hook():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 32, bias=False)
    mb = pack_samples(_agentic_samples(), [0, 2])
    padded = unpack_to_rows(mb)
    hidden = torch.randn(*padded.input_ids.shape, 8)
    rows = padded_loss_rows(mb, padded.response_rows, padded.response_cols, padded.input_ids.shape[1])
    with keep_rows(head, select_hf_rows(rows)):
        kept = head(hidden)
    full = head(hidden).reshape(-1, 32)[rows.rows]
    assert kept.shape == (1, rows.rows.numel(), 32)
    torch.testing.assert_close(kept[0], full, rtol=0, atol=1e-6)
    assert not head._forward_pre_hooks
    with pytest.raises(RuntimeError, match="boom"), keep_rows(head, select_hf_rows(rows)):
        raise RuntimeError("boom")
    assert not head._forward_pre_hooks


def _hf_rows_output(model, mb, spec, projected: bool):
    """The FSDP backend's two ways of the loss rows' log-probs + entropy under an HF model (backends/fsdp)."""
    from megatron_rl.backends.loss_rows import pack_output, project_rows, unpack_output

    padded = unpack_to_rows(mb, pad_token_id=0)
    rows = padded_loss_rows(mb, padded.response_rows, padded.response_cols, padded.input_ids.shape[1])
    lm_head, select = model.get_output_embeddings(), select_hf_rows(rows)
    if projected:
        def forward(hidden):
            return pack_output(spec.extract_model_output_from_hidden(select(hidden)[0], lm_head.weight,
                                                                     rows.targets)).unsqueeze(0)

        with project_rows(lm_head, forward):
            out = unpack_output(model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits)
        assert "forward" not in lm_head.__dict__  # restored
    else:
        with keep_rows(lm_head, select):
            logits = model(input_ids=padded.input_ids, attention_mask=padded.attention_mask).logits
        out = spec.extract_model_output(logits[0].float(), rows.targets)
    return rows.to_response(out.logprobs), rows.to_response(out.entropy)


def test_projected_lm_head_equals_its_loss_rows_logits(tiny_hf_models):
    """An HF model's ``lm_head`` replaced by the chunked projection (ops/linear_logprob.py, 3 rows a chunk):
    log-probs and entropy bitwise the loss-rows logits path's in bf16, gradients within bf16 rounding;
    ``lm_head_is_plain`` admits a plain head and refuses a hooked one and a soft-capping family."""
    import transformers

    from megatron_rl.algorithms.config import PolicyGradientConfig
    from megatron_rl.algorithms.spec import PolicyGradientSpec
    from megatron_rl.backends.fsdp.backend import lm_head_is_plain

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_models("qwen2"), dtype=torch.bfloat16)
    spec = PolicyGradientSpec(PolicyGradientConfig(logprob_chunk_size=3))
    mb = pack_samples(_agentic_samples(), [0, 1, 2])
    got = []
    for projected in (False, True):
        model.zero_grad()
        lp, ent = _hf_rows_output(model, mb, spec, projected)
        (lp.sum() + ent.sum()).backward()
        got.append((lp.detach(), ent.detach(), model.lm_head.weight.grad.float(),
                    model.model.norm.weight.grad.float()))
    (lp0, e0, gw0, gn0), (lp1, e1, gw1, gn1) = got
    assert torch.equal(lp0, lp1) and torch.equal(e0, e1) and lp0.any()
    assert torch.equal(gn0, gn1)  # the hidden rows' gradient is the logits path's bit for bit
    assert ((gw0 - gw1).abs() <= gw0.abs() * 2 ** -7 + gw0.abs().max() * 2 ** -8).all()

    assert lm_head_is_plain(model, model.lm_head)
    handle = model.lm_head.register_forward_hook(lambda module, inputs, output: output * 2)
    assert not lm_head_is_plain(model, model.lm_head)
    handle.remove()
    gemma = transformers.AutoModelForCausalLM.from_pretrained(tiny_hf_models("gemma3_text"))
    assert not lm_head_is_plain(gemma, gemma.lm_head)  # soft-caps its logits after lm_head

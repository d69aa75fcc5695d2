"""Multi-token-prediction layers of deepseek_v3 / glm4_moe checkpoints on megatron-core's MTP block, one
process: MTP logits equal a reference built from transformers' own modules (fp32, <= 1e-5), the main
logits are unchanged, load -> export is bit-exact with the MTP tensors, and bad inputs are refused by
name. (The 2-rank layouts: tests/dist/test_parity_layouts.py, entries ``*_mtp_*``.)"""

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_rl.errors import BridgeError, CheckpointError
from megatron_rl.models import get_bridge

MTP_FAMILIES = ["glm4_moe", "deepseek_v3"]
LOGIT_TOL = 1e-5


@pytest.fixture(scope="module")
def single_rank():
    from megatron_rl.models.parallel import ParallelLayout, initialize_parallel

    layout = ParallelLayout()
    initialize_parallel(layout, seed=0)
    return layout


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mtp_logits_match_the_reference_and_export_is_bit_exact(single_rank, tiny_hf_models, family):
    from _mtp_reference import MtpReference

    from megatron_rl.models import mtp, parity

    path = tiny_hf_models(family, mtp=True)
    bridge = get_bridge(path, mtp_num_layers=1)
    chunks = bridge.build_model(single_rank)
    bridge.load_hf_weights(chunks, path)
    for c in chunks:
        c.eval()
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, bridge.vocab_size, (n,), generator=gen) for n in (13, 7)]
    got = mtp.mtp_logits(chunks, seqs, bridge.vocab_size)
    ref = MtpReference(path)
    for seq, depths in zip(seqs, got):
        assert len(depths) == 1
        want = ref.logits(seq)
        assert (depths[0][:-1] - want).abs().max().item() <= LOGIT_TOL
        assert want.abs().max().item() > 1.0  # the comparison is of real logits, not near-zeros
    # the MTP block built but off: the main logits are HF's, with no MTP compute and no labels
    main = parity.megatron_run(chunks, [parity.Microbatch(seqs, [torch.ones(len(s)) for s in seqs])],
                               bridge.vocab_size, packed=False)
    for seq, logits in zip(seqs, main):
        assert (logits - ref.main(seq[None]).logits[0]).abs().max().item() <= LOGIT_TOL
    exported = dict(bridge.export_hf_weights(chunks))
    source = load_file(os.path.join(path, "model.safetensors"))
    assert set(exported) == set(source)
    assert all(torch.equal(exported[n], source[n]) for n in source)
    # the weight sync of frozen MTP layers leaves them out (the engine keeps its own)
    synced = {n for n, _ in bridge.export_hf_weights(chunks, include_mtp=False)}
    assert synced == {n for n in source if not n.startswith("model.layers.4.")}
    # a drafting engine (--speculative-algorithm) takes the export with the MTP layers by the names it holds: every
    # name the trainer sends is one of its tensors (or an alias of one), and the update covers all of them
    from megatron_rl.rollout import EmbeddedEngine
    from megatron_rl.rollout.speculative import SpeculativeConfig

    engine = EmbeddedEngine(path, speculative=SpeculativeConfig(num_steps=1))
    assert set(engine.param_map.names()) <= set(exported) and all(n in engine.param_map for n in exported)
    engine._weights_loaded = False  # as after a release without backup: the update must cover every tensor
    engine.update_weights(list(exported.items()), version=1)
    assert engine.health().ok


def test_mtp_refusals_name_the_values(single_rank, tiny_hf_models, tmp_path):
    path = tiny_hf_models("glm4_moe", mtp=True)
    with pytest.raises(BridgeError, match=r"--mtp-num-layers 2 but config\.json's num_nextn_predict_layers is 1"):
        get_bridge(path, mtp_num_layers=2)
    # without MTP: the checkpoint's MTP layers are skipped (as transformers does) and not exported
    plain = get_bridge(path)
    chunks = plain.build_model(single_rank)
    plain.load_hf_weights(chunks, path)
    assert not any(n.startswith("model.layers.4.") for n, _ in plain.export_hf_weights(chunks))
    # an MTP copy of the embedding that differs from the main one cannot be shared: refused by name
    bridge = get_bridge(path, mtp_num_layers=1)
    chunks = bridge.build_model(single_rank)
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    tensors["model.layers.4.embed_tokens.weight"][3] += 1.0
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.4\.embed_tokens\.weight differs from "
                                              r"model\.embed_tokens\.weight"):
        bridge.load_hf_weights(chunks, str(bad))
    # the copies are optional: a checkpoint without them loads, and the export writes them
    del tensors["model.layers.4.embed_tokens.weight"], tensors["model.layers.4.shared_head.head.weight"]
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    bridge.load_hf_weights(chunks, str(bad))
    exported = dict(bridge.export_hf_weights(chunks))
    assert torch.equal(exported["model.layers.4.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert torch.equal(exported["model.layers.4.shared_head.head.weight"], tensors["lm_head.weight"])


def test_routing_replay_leaves_the_mtp_layers_router_to_route_on_its_own(single_rank, tiny_hf_models):
    """An MoE MTP layer under routing replay: its router is not among the replayed ones (the engine reports routes
    of the decoder's MoE layers only), R3 maps the decoder's routers onto the engine's layer axis, and a forward
    with the MTP loss (--enable-mtp-training) runs while the decoder's routers record, the MTP router routing on
    its own."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    from megatron_rl.backends.megatron.routing_replay import RoutingReplay, moe_pattern
    from megatron_rl.models import parity

    path = tiny_hf_models("glm4_moe", mtp=True)
    bridge = get_bridge(path, mtp_num_layers=1)
    chunks = bridge.build_model(single_rank, moe_enable_routing_replay=True)
    bridge.load_hf_weights(chunks, path)
    config = chunks[0].config
    replay = RoutingReplay.attach(chunks, ps, single_rank, int(config.moe_router_topk), moe_pattern=moe_pattern(config))
    mtp_routers = [m for n, m in chunks[0].named_modules() if n.startswith("mtp.") and hasattr(m, "router_replay")]
    assert len(mtp_routers) == 1 and mtp_routers[0].router_replay is not None
    assert all(r.router is not mtp_routers[0] for r in replay.routers)
    assert replay.rollout_layers == [0, 1, 2]  # the decoder's 3 MoE layers (layer 0 is dense)
    for r in replay.routers:
        r.router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, bridge.vocab_size, (n,), generator=gen) for n in (9, 6)]
    losses: list = []
    try:
        with torch.no_grad():
            parity.megatron_run(chunks, [parity.Microbatch(seqs, [torch.ones(len(s)) for s in seqs])],
                                bridge.vocab_size, packed=True, mtp_loss_factor=1.0, mtp_losses=losses)
        assert len(losses) == 1 and losses[0] > 1.0
        assert all(r.router.router_replay.get_recorded_indices().shape == (15, config.moe_router_topk)
                   for r in replay.routers)
        assert mtp_routers[0].router_replay.get_recorded_indices() is None
    finally:
        replay.end_pass()


def test_mtp_targets_of_the_context_parallel_ranks_partition_the_one_process_targets():
    """Under CP each rank keeps the MTP rows of its shard (as positions of its shard): mapped back to packed
    positions, the ranks' rows are the one-process rows, each once, with the same targets and weights."""
    from megatron_rl.models import cp_utils, mtp

    cu = torch.tensor([0, 12, 20])  # two sequences, padded to a multiple of 2 x CP
    lengths = torch.tensor([5, 3])  # response tokens at the end of each sequence (the last real token unused)
    positions = torch.tensor([5, 6, 7, 8, 9, 15, 16, 17])
    ids, mask = torch.arange(100, 108), torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    one = mtp.mtp_targets(cu, lengths, positions, ids, mask, 2, 4.0, 50, 0.5)
    for d in range(2):
        got = []
        for rank in range(2):
            local = cp_utils.cp_local_index(cu, rank, 2)
            part = mtp.mtp_targets(cu, lengths, positions, ids, mask, 2, 4.0, 50, 0.5, local_index=local,
                                   cp_group="cp")
            assert part.cp_size == 2 and part.cp_group == "cp"
            got += list(zip(local[part.rows[d]].tolist(), part.ids[d].tolist(), part.weights[d].tolist()))
        assert sorted(got) == sorted(zip(one.rows[d].tolist(), one.ids[d].tolist(), one.weights[d].tolist()))
        assert len(got) == len(one.rows[d]) > 0

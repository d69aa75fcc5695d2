"""Speculative decoding in the embedded engine with the checkpoint's MTP head as the draft (rollout/speculative.py):
the draft is the MTP reference built from transformers' modules, greedy equals the plain engine token for token,
sampled tokens follow the target's law (chi-square on a vocab of 8), reported log-probs are the target's, the
draft's weights move with a weight sync, and what it cannot do is refused by name."""

import math

import pytest
import torch

from megatron_rl.errors import ConfigError
from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams
from megatron_rl.rollout.sampling import inverse_cdf, sampling_distribution
from megatron_rl.rollout.speculative import SPEC_METADATA_KEY, SpeculativeConfig, accept_drafts

FAMILY = "deepseek_v3"


def chi2_critical(df: int, z: float = 3.7190) -> float:
    """The chi-square quantile at 1 - 1e-4 (z: the normal's), Wilson-Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2(counts: torch.Tensor, expected: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic and its degrees of freedom, cells expecting < 5 pooled into one."""
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().view(1)]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum().view(1)]) if small.any() else expected
    return float(((obs - exp) ** 2 / exp.clamp(min=1e-12)).sum()), len(obs) - 1


def requests(lengths, vocab=250, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [GenerateRequest(prompt_ids=torch.randint(0, vocab, (n,), generator=gen).tolist(), group_index=i)
            for i, n in enumerate(lengths)]


@pytest.fixture(scope="module")
def engines(tiny_hf_models):
    path = tiny_hf_models(FAMILY, mtp=True)
    return path, EmbeddedEngine(path), EmbeddedEngine(path, speculative=SpeculativeConfig(num_steps=3))


def test_accept_reject_rule_draws_the_target_law():
    """The rule alone, prefix-free laws (p at each depth fixed): every emitted token follows p of its depth."""
    gen = torch.Generator().manual_seed(0)
    vocab, k, rows = 6, 2, 20000
    sampling = SamplingParams(temperature=0.9, top_p=0.9, top_k=5)
    p = sampling_distribution(torch.randn(k + 1, vocab, generator=gen) * 1.5, sampling)
    q = sampling_distribution(torch.randn(k, vocab, generator=gen) * 1.5, sampling)
    u = torch.rand(rows, 2 * k + 1, generator=gen, dtype=torch.float64)
    drafts = torch.stack([inverse_cdf(q[j].expand(rows, -1), u[:, j]) for j in range(k)], dim=1)
    accepted, nxt = accept_drafts(p.expand(rows, -1, -1), q.expand(rows, -1, -1), drafts, u[:, k:2 * k], u[:, 2 * k])
    first = torch.where(accepted > 0, drafts[:, 0], nxt)
    stat, df = chi2(torch.bincount(first, minlength=vocab).double(), p[0] * rows)
    assert stat < chi2_critical(df), (stat, df)
    later = accepted > 0  # the token after an accepted d_1: d_2 or the draw at depth 1
    second = torch.where(accepted[later] > 1, drafts[later, 1], nxt[later])
    stat, df = chi2(torch.bincount(second, minlength=vocab).double(), p[1] * int(later.sum()))
    assert stat < chi2_critical(df), (stat, df)
    assert 0 < (accepted == 0).sum() and 0 < (accepted == k).sum()  # both the residual and the bonus ran


def test_greedy_is_the_plain_engine_token_for_token_with_target_logprobs(engines):
    _, plain, spec = engines
    reqs = requests([3, 9, 1])
    stop = (17, 33, 250 - 1)
    sampling = SamplingParams(temperature=0, max_new_tokens=8, stop_token_ids=stop, n=2)
    want, got = plain.generate(reqs, sampling), spec.generate(reqs, sampling)
    for a, b in zip(want, got):
        assert b.response_ids == a.response_ids and b.finish_reason == a.finish_reason
        assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs)) <= 1e-5
        proposed, accepted = b.metadata[SPEC_METADATA_KEY]
        assert len(proposed) == 3 and all(0 <= a_ <= p_ for a_, p_ in zip(accepted, proposed))


def test_draft_is_the_mtp_reference(engines):
    from _mtp_reference import MtpReference

    path, _, spec = engines
    seq = torch.randint(0, 250, (11,), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        hidden = spec.model.model(seq[None]).last_hidden_state[:, :-1]
        positions = torch.arange(10)[None]
        _, logits = spec.draft(hidden, seq[None, 1:], positions, torch.ones(1, 10, dtype=torch.long),
                               spec.draft.new_cache(10), spec.model)
        want = MtpReference(path).logits(seq)
    assert (logits[0] - want).abs().max().item() <= 1e-5 and want.abs().max().item() > 1.0


def test_sampled_tokens_follow_the_target_distribution(tiny_hf_models):
    """The engine end to end on a vocab of 8: the joint law of the first two tokens and the third's marginal
    (drafts accepted and rejected, both depths) against the target's exact law, chi-square; each token's reported
    log-prob is the target's ``log_softmax(logits / T)`` given its prefix."""
    path = tiny_hf_models(FAMILY, mtp=True, vocab_size=8)
    engine = EmbeddedEngine(path, speculative=SpeculativeConfig(algorithm="EAGLE", num_steps=2,
                                                                num_draft_tokens=3))
    prompt, n = [3, 5, 2], 1500
    sampling = SamplingParams(temperature=1.0, top_p=0.95, top_k=6, max_new_tokens=3, seed=11, n=n, ignore_eos=True)
    samples = engine.generate([GenerateRequest(prompt_ids=prompt, group_index=0)], sampling)
    tokens = torch.tensor([s.response_ids for s in samples])
    with torch.no_grad():
        l1 = engine.model(torch.tensor([prompt])).logits[:, -1]
        l2 = engine.model(torch.tensor([prompt + [a] for a in range(8)])).logits[:, -1]  # [t1, V]
        l3 = engine.model(torch.tensor([prompt + [a, b] for a in range(8) for b in range(8)])).logits[:, -1]
    p1, p2 = sampling_distribution(l1, sampling)[0], sampling_distribution(l2, sampling)
    p3 = sampling_distribution(l3, sampling).view(8, 8, 8)
    lp = [torch.log_softmax(x.float(), -1) for x in (l1[0], l2, l3.view(8, 8, 8))]
    want = torch.stack([lp[0][tokens[:, 0]], lp[1][tokens[:, 0], tokens[:, 1]],
                        lp[2][tokens[:, 0], tokens[:, 1], tokens[:, 2]]], dim=1)
    torch.testing.assert_close(torch.tensor([s.rollout_logprobs for s in samples]), want, atol=1e-5, rtol=0)
    joint = p1[:, None] * p2
    stat, df = chi2(torch.bincount(tokens[:, 0] * 8 + tokens[:, 1], minlength=64).double(), joint.flatten() * n)
    assert stat < chi2_critical(df), (stat, df)
    third = (joint[:, :, None] * p3).sum(dim=(0, 1))
    stat, df = chi2(torch.bincount(tokens[:, 2], minlength=8).double(), third * n)
    assert stat < chi2_critical(df), (stat, df)
    proposed, accepted = (torch.tensor([s.metadata[SPEC_METADATA_KEY][i] for s in samples]).sum(0) for i in (0, 1))
    assert 0 < accepted[0] < proposed[0]  # drafts were accepted and rejected


def test_weight_sync_moves_the_draft_and_release_keeps_it(engines):
    path, _, _ = engines
    spec = EmbeddedEngine(path, speculative=SpeculativeConfig(num_steps=2), weight_backup=True)
    names = dict(spec.named_weights())
    assert "model.layers.4.eh_proj.weight" in names and "model.layers.4.mlp.experts.0.gate_proj.weight" in names
    assert "model.layers.4.embed_tokens.weight" in spec.param_map and "model.layers.4.shared_head.head.weight" in \
        spec.param_map  # the MTP copies alias the main tensors
    new = names["model.layers.4.eh_proj.weight"].clone() * 0.5
    spec.update_weights([("model.layers.4.eh_proj.weight", new)], version=1)
    assert torch.equal(spec.draft.model.layers["4"].eh_proj.weight, new)
    spec.release()
    spec.resume()
    assert torch.equal(spec.draft.model.layers["4"].eh_proj.weight, new)


def test_refusals_name_the_flag(tiny_hf_models, engines):
    with pytest.raises(ConfigError, match="--speculative-eagle-topk 4"):
        SpeculativeConfig(eagle_topk=4)
    with pytest.raises(ConfigError, match="--speculative-num-draft-tokens 8"):
        SpeculativeConfig(num_steps=3, num_draft_tokens=8)
    with pytest.raises(ConfigError, match="--speculative-algorithm MEDUSA"):
        SpeculativeConfig(algorithm="MEDUSA")
    with pytest.raises(ConfigError, match="no MTP layers"):
        EmbeddedEngine(tiny_hf_models("qwen2"), speculative=SpeculativeConfig())
    path = engines[0]
    with pytest.raises(ConfigError, match="--use-rollout-routing-replay"):
        EmbeddedEngine(path, speculative=SpeculativeConfig(), record_routes=True)


def test_a_weight_update_between_rounds_is_recorded_per_token(engines):
    """An update landing between two rounds (the engine lock is free there): the rounds after it record the new
    version on their tokens; the same weights sent give the same greedy tokens."""
    _, plain, spec = engines
    reqs = requests([4])
    sampling = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    want = plain.generate(reqs, sampling)[0]
    weights = [(n, t.clone()) for n, t in spec.named_weights()]

    def hook(step):
        if step == 2:
            spec.update_weights(weights, version=spec.weight_version + 1)

    spec.step_boundary_hook = hook
    try:
        got = spec.generate(reqs, sampling)[0]
    finally:
        spec.step_boundary_hook = None
    assert got.response_ids == want.response_ids
    old, new = got.token_versions[0], got.token_versions[-1]
    assert new == old + 1 and got.token_versions == sorted(got.token_versions)

"""Per-token weight versions: SGLang's ``meta_info.weight_versions`` spans become ``Sample.token_versions``,
and the rollout's staleness metrics are measured per token.

The replies are dicts of real SGLang 0.5.23's shape (``tests/rollout/fixtures/sglang_0.5.23_replies.json``);
the engine is driven with its client's ``generate`` answering them, no server.
"""

import pytest

from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
from megatron_rl.errors import EngineError
from megatron_rl.rollout.batch_builder import weight_version_metrics
from megatron_rl.rollout.sglang import SGLangEngine
from megatron_rl.rollout.sglang.protocol import parse_generate_output


def reply(output_ids, spans, reply_version="3"):
    """One ``/generate`` row; ``spans`` as ``(version, start, end)``, sent as SGLang sends them."""
    return {"text": "", "output_ids": list(output_ids), "meta_info": {
        "finish_reason": {"type": "length", "length": len(output_ids)}, "weight_version": reply_version,
        "output_token_logprobs": [[-1.0 - k, t, None] for k, t in enumerate(output_ids)],
        "weight_versions": [{"version": str(v), "start": s, "end": e} for v, s, e in spans]}}


def test_a_row_generated_across_an_update_gets_every_tokens_version():
    out = parse_generate_output(reply([4, 5, 6, 7], [(2, 0, 1), (3, 1, 4)]), where="x")
    assert out.weight_version == 2  # the first token's: the oldest policy in the row
    assert out.token_versions() == [2, 3, 3, 3]
    three = parse_generate_output(reply([4, 5, 6], [(1, 0, 1), (2, 1, 2), (3, 2, 3)]), where="x")
    assert three.token_versions() == [1, 2, 3]


def test_a_row_of_one_version_keeps_no_token_versions():
    """Empty unless the versions differ: today's samples stay exactly as they were."""
    assert parse_generate_output(reply([4, 5], [(3, 0, 2)]), where="x").token_versions() == []
    same = parse_generate_output(reply([4, 5], [(3, 0, 1), (3, 1, 2)]), where="x")  # two spans, one version
    assert same.weight_version == 3 and same.token_versions() == []
    empty = parse_generate_output(reply([], [(3, 0, 0)]), where="x")  # no output token (an abort at once)
    assert empty.weight_version == 3 and empty.token_versions() == []
    no_spans = reply([4, 5], [])  # older servers: the reply-time version is all there is
    del no_spans["meta_info"]["weight_versions"]
    out = parse_generate_output(no_spans, where="x")
    assert out.weight_version == 3 and out.token_versions() == []


def test_an_empty_leading_span_does_not_name_the_first_token():
    out = parse_generate_output(reply([4, 5], [(2, 0, 0), (3, 0, 2)]), where="x")
    assert out.weight_version == 3 and out.token_versions() == []


@pytest.mark.parametrize("spans", [
    [(2, 0, 1), (3, 2, 3)],  # a gap: token 1 has no version
    [(2, 0, 2), (3, 1, 3)],  # an overlap: token 1 has two
    [(2, 0, 1), (3, 1, 2)],  # short: the last token has none
    [(2, 0, 1), (3, 1, 4)],  # beyond the output
    [(2, 1, 3)],  # not from the first token
    [(3, 1, 3), (2, 0, 1)],  # out of order
    [(2, 0, 2), (3, 2, 1), (4, 1, 3)],  # a span ending before it starts
])
def test_spans_that_do_not_cover_the_output_exactly_are_out_of_protocol(spans):
    with pytest.raises(EngineError, match="do not cover its 3 output token"):
        parse_generate_output(reply([4, 5, 6], spans), where="SGLang server x")


def test_a_span_with_a_non_numeric_bound_is_out_of_protocol():
    row = reply([4], [(2, 0, 1)])
    row["meta_info"]["weight_versions"][0]["end"] = "one"
    with pytest.raises(EngineError, match="expected"):
        parse_generate_output(row, where="x")


def test_the_engine_fills_token_versions_and_keeps_the_spans_in_metadata():
    engine = SGLangEngine(["http://a:1"], health_interval_s=0, connect_retries=0)
    rows = [reply([4, 5, 6], [(2, 0, 2), (3, 2, 3)]), reply([7, 8], [(3, 0, 2)])]
    engine.clients[0].generate = lambda input_ids, params, rids=None, timeout_s=None, return_routed_experts=False, \
        lora_path=None: rows
    try:
        mixed, plain = engine.generate([GenerateRequest([1, 2], 0, metadata={"k": 1})],
                                       SamplingParams(temperature=1.0, max_new_tokens=3, n=2))
    finally:
        engine.close()
    assert mixed.weight_version == 2 and mixed.token_versions == [2, 2, 3]
    assert mixed.metadata == {"k": 1, "weight_version_spans": [[2, 0, 2], [3, 2, 3]]}
    assert mixed.staleness(3) == 1 and mixed.effective_token_versions() == [2, 2, 3]
    assert plain.weight_version == 3 and plain.token_versions == [] and plain.metadata == {"k": 1}
    assert plain.effective_token_versions() == [3, 3]


def test_staleness_metrics_are_measured_per_token_against_the_current_version():
    def sample(version, token_versions=(), spans=None):
        metadata = {"weight_version_spans": spans} if spans else {}
        return Sample(group_index=0, prompt_ids=[1], response_ids=[2, 3, 4], weight_version=version,
                      token_versions=list(token_versions), metadata=metadata)

    samples = [sample(5),  # on-policy
               sample(3, token_versions=[3, 4, 5]),  # continued across two updates: 2 behind
               sample(4, spans=[[4, 0, 1], [5, 1, 3]]),  # stored before token_versions: spans only
               sample(5, spans=[[4, 0, 0], [5, 0, 3]]),  # an empty span holds no token: not mixed
               sample(1)]  # carried over from long ago
    assert weight_version_metrics(samples, current_version=5) == {
        "rollout/stale_samples": 3.0, "rollout/weight_version_min": 1.0, "rollout/weight_version_max": 5.0,
        "rollout/mixed_version_samples": 2.0, "rollout/staleness_mean": (0 + 2 + 1 + 0 + 4) / 5,
        "rollout/staleness_max": 4.0}

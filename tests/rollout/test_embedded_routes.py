"""The embedded engine's routes (MoE routing replay R3, ``record_routes=True``): every input token's experts,
as one full forward over prompt + response routes them, through batching, shared prefills, compaction,
continuous batching and a retract under new weights; and the records that carry them (codec, SGLang's
wire format, cut and stitched samples)."""

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from _util import InThread
from megatron_rl.data import sample_codec
from megatron_rl.data.types import RoutedExperts, Sample
from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams
from megatron_rl.rollout.routes import RouteCapture, from_sglang, to_sglang

REQUESTS = [GenerateRequest([5, 17, 3], 0), GenerateRequest([9, 1, 100, 42, 7, 8, 60], 1),
            GenerateRequest([11, 12, 13, 14, 15], 2)]
SAMPLING = SamplingParams(temperature=0.8, max_new_tokens=8, seed=7, n=2, stop_token_ids=tuple(range(0, 250, 13)),
                          ignore_eos=True)


@pytest.fixture(scope="module")
def moe(tiny_hf_models):
    """Two weight versions of a tiny Qwen3-MoE (4 experts, top-2, every layer MoE)."""
    return {0: tiny_hf_models("qwen3_moe"), 1: tiny_hf_models("qwen3_moe", seed=1)}


@pytest.fixture(scope="module")
def reference_routes(moe):
    """``routes(version, ids)``: ``[len(ids), moe_layers, topk]`` of one full forward of the HF model."""
    models = {v: transformers.AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
              for v, p in moe.items()}
    captures = {v: RouteCapture(m) for v, m in models.items()}

    def routes(version, ids):
        with torch.no_grad():
            models[version](torch.tensor([ids]))
        return captures[version].take(1, len(ids))[0]
    return routes


def assert_routes_of_full_forward(sample, routes_of):
    ids = sample.prompt_ids + sample.response_ids
    got = sample.routed_experts
    assert isinstance(got, RoutedExperts) and got.array.dtype == np.uint8
    assert (got.tokens, got.layers, got.topk) == (len(ids) - 1, 4, 2)  # the last token is never an input
    want = routes_of(ids)[:-1].sort(dim=-1).values.numpy()
    np.testing.assert_array_equal(np.sort(got.array, axis=-1), want)


def test_generate_records_each_tokens_experts_as_a_full_forward_routes_them(moe, reference_routes):
    engine = EmbeddedEngine(moe[0], max_batch_size=4, record_routes=True)
    samples = engine.generate(REQUESTS, SAMPLING)
    assert any(s.finish_reason == "stop" for s in samples) and any(s.finish_reason == "length" for s in samples)
    for s in samples:
        assert_routes_of_full_forward(s, lambda ids: reference_routes(0, ids))
    # recording changes nothing else, and is off by default
    plain = EmbeddedEngine(moe[0], max_batch_size=4).generate(REQUESTS, SAMPLING)
    assert [dataclasses.replace(s, routed_experts=None) for s in samples] == plain
    assert all(s.routed_experts is None for s in plain)


def test_a_retract_update_gives_every_route_of_the_new_weights(moe, reference_routes):
    """A retract re-prefills prompt + tokens under version 1: the routes of a row spanning the update are all
    version 1's (the cache later tokens attend to); a row that ended before is all version 0's."""
    engine = EmbeddedEngine(moe[0], max_batch_size=4, record_routes=True)
    fired = []

    def hook(at):
        if at == 3 and not fired:
            fired.append(at)
            engine.pause("retract")
    engine.step_boundary_hook = hook
    running = InThread(lambda: engine.generate(REQUESTS, SAMPLING), bound_s=300, what="the generate")
    assert engine.wait_paused(300) == 1
    engine.update_weights_from_disk(moe[1], 1)
    engine.continue_()
    samples = running.result()
    spanning = [s for s in samples if len(set(s.effective_token_versions())) > 1]
    assert spanning, "no row spans the update"
    for s in samples:
        version = max(s.effective_token_versions()) if s.response_ids else 0
        assert_routes_of_full_forward(s, lambda ids, v=version: reference_routes(v, ids))


def test_continuous_batching_records_routes_of_joining_rows(moe, reference_routes):
    from megatron_rl.rollout.embedded import EngineRow

    engine = EmbeddedEngine(moe[0], record_routes=True)
    rows = [EngineRow(list(r.prompt_ids), seed=7 + i, max_new_tokens=6) for i, r in enumerate(REQUESTS)]
    waves = [rows[:1], [], rows[1:]]  # two rows join the running one at its third step
    done = {}
    engine.generate_continuous(SAMPLING, lambda room: waves.pop(0) if waves else [],
                               lambda row, out: done.__setitem__(id(row), out))
    for row in rows:
        out = done[id(row)]
        sample = Sample(0, row.prompt_ids, out.response_ids, routed_experts=out.routes)
        assert_routes_of_full_forward(sample, lambda ids: reference_routes(0, ids))


def test_routes_survive_the_codec_the_sglang_format_and_cuts():
    rng = np.random.default_rng(0)
    routes = RoutedExperts.from_indices(rng.integers(0, 300, size=(9, 3, 4)), 300)
    assert routes.array.dtype == np.uint16  # 300 experts do not fit uint8
    s = Sample(0, [1, 2, 3], [4, 5, 6, 7, 8, 9, 10], routed_experts=routes)
    assert sample_codec.decode(*sample_codec.encode([s, Sample(1, [1], [2])])) == [s, Sample(1, [1], [2])]
    import io

    buf = io.BytesIO()  # rollout checkpoints and debug rollouts: field dicts through torch.save
    torch.save([dataclasses.asdict(s), vars(s)], buf)
    buf.seek(0)
    assert [Sample(**d) for d in torch.load(buf, weights_only=False)] == [s, s]
    # SGLang: int32 [tokens, num_hidden_layers, topk], the dense layers' rows zero
    moe_layers = [1, 2, 4]
    wire = to_sglang(routes, moe_layers, 5)
    assert from_sglang(wire, moe_layers, 5, 4, 300) == routes
    with pytest.raises(ValueError, match="not a multiple of num_hidden_layers 6 x topk 4"):
        from_sglang(wire, moe_layers, 6, 4, 300)
    from megatron_rl.rollout.generate_fn import truncate

    cut = truncate(s, 3)
    assert cut.routed_experts == routes.first(5)  # prompt 3 + response 3, less the last token
    from megatron_rl.rollout.batch_builder import route_metrics

    # the route traffic a rollout carries: 9 tokens x 3 layers x top-4 x 2 bytes (uint16) = 24 bytes a token
    assert route_metrics([s, Sample(1, [1], [2])]) == {"rollout/route_bytes_per_token": 24.0}
    assert route_metrics([Sample(1, [1], [2])]) == {}


def test_routes_through_sglangs_protocol_equal_the_engines_own(moe):
    """The embedded engine served over SGLang's protocol (``--embedded-engine-ranks process``; SGLang itself
    speaks the same: ``return_routed_experts`` in, ``meta_info.routed_experts`` out): the client asks for
    routes and reads them into the model's MoE layers, equal to the in-process engine's; a server started
    without --enable-return-routed-experts refuses such a request, and a client that gets no routes names
    the flag."""
    from megatron_rl.errors import EngineError
    from megatron_rl.rollout.embedded_server import EmbeddedServer
    from megatron_rl.rollout.routes import RouteLayout
    from megatron_rl.rollout.sglang.engine import SGLangEngine
    from megatron_rl.rollout.sglang.protocol import GenerateOutput

    sampling = SamplingParams(temperature=0.9, max_new_tokens=6, seed=11, n=2, ignore_eos=True)
    own = EmbeddedEngine(moe[0], record_routes=True).generate(REQUESTS[:2], sampling)
    layout = RouteLayout.of_checkpoint(moe[0])
    assert (layout.moe_layers, layout.num_hidden_layers, layout.topk, layout.num_experts) == ((0, 1, 2, 3), 4, 2, 4)
    for record, routes_expected in ((True, True), (False, False)):
        server = EmbeddedServer(EmbeddedEngine(moe[0], record_routes=record), model_path=moe[0]).start()
        client = SGLangEngine([server.url], releases_memory=False, health_interval_s=0, route_layout=layout)
        try:
            if routes_expected:
                served = client.generate(REQUESTS[:2], sampling)
                assert [s.routed_experts for s in served] == [s.routed_experts for s in own]
                assert [s.response_ids for s in served] == [s.response_ids for s in own]
            else:
                with pytest.raises(EngineError, match="return_routed_experts needs a server started with "
                                                      "--enable-return-routed-experts"):
                    client.generate(REQUESTS[:1], sampling)
        finally:
            client.close()
            server.stop()
    out = GenerateOutput(output_ids=[1, 2], logprobs=[0.0, 0.0], finish_reason="length", weight_version=0, text=None)
    with pytest.raises(EngineError, match="start SGLang with --enable-return-routed-experts"):
        layout.read(out.routed_experts, 5, where="row 0")


def test_gpt_oss_routes_are_read_off_its_routers(tiny_hf_models):
    """gpt-oss's routers are ``mlp.router`` (not ``mlp.gate``) and its sliding-window layers keep transformers'
    own cache (static batching): the routes still equal one full forward's."""
    path = tiny_hf_models("gpt_oss")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    capture = RouteCapture(model)
    assert capture.moe_layers == [0, 1, 2, 3]

    def routes(ids):
        with torch.no_grad():
            model(torch.tensor([ids]))
        return capture.take(1, len(ids))[0]

    samples = EmbeddedEngine(path, max_batch_size=4, record_routes=True).generate(REQUESTS, SAMPLING)
    for s in samples:
        assert_routes_of_full_forward(s, routes)

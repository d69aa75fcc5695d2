"""slime's function contracts run unchanged (rollout/slime_compat): a generate function that posts to the run's
SGLang-protocol gateway, a rollout function with a data_source, reward functions; what they return becomes our
samples token for token; statuses as slime treats them; an installed slime is never shadowed."""

import dataclasses
import importlib
import os
import sys

import pytest

from _tokenizer import build_char_tokenizer
from megatron_rl.config.flags import parse_config
from megatron_rl.data.types import GenerateRequest, Sample, SamplingParams
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.generate_fn import RolloutFunctions, load_function
from megatron_rl.rollout.rewards import compute_rewards, load_custom_reward
from megatron_rl.rollout.slime_compat import finder

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "slime_fns")


class Engine:
    """A test double of ``RolloutEngine.generate``: each row's tokens and log-probs a pure function of its prompt
    and seed, every reply recorded (what the trained samples must equal)."""

    def __init__(self):
        self.replies, self.calls = [], []

    def generate(self, requests, sampling):
        self.calls.append(len(requests))
        out = []
        for r in requests:
            for j in range(sampling.n):
                base = (sum(r.prompt_ids) + (sampling.seed or 0) + j) % 50
                ids = [20 + (base + 3 * i) % 60 for i in range(min(r.budget(sampling), 5))]
                s = Sample(group_index=r.group_index, prompt_ids=list(r.prompt_ids), response_ids=ids,
                           rollout_logprobs=[-0.01 * (t % 17) - 0.001 * i for i, t in enumerate(ids)],
                           finish_reason="length", weight_version=3)
                self.replies.append((list(r.prompt_ids), ids, list(s.rollout_logprobs)))
                out.append(s)
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("slime_model")
    build_char_tokenizer(path)
    return str(path)


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(FIXTURES)
    yield
    finder.slime_module("rollout.sglang_rollout").GenerateState.clear_instances()  # one per process (slime's)


def _cfg(model_dir, *extra):
    return parse_config(["--hf-checkpoint", model_dir, "--debug-train-only", "--rollout-max-response-len", "24",
                         "--n-samples-per-prompt", "2", "--rollout-batch-size", "2", *extra], validate=False)


def _requests(tok):
    return [GenerateRequest(prompt_ids=tok.encode(text), group_index=g, label="yes", prompt_text=text)
            for g, text in enumerate(["hi there", "what now"])]


def _segments(sample, engine):
    """The sample's loss-mask-1 runs, each with its log-probs, in order."""
    runs, cur = [], None
    for i, m in enumerate(sample.loss_mask):
        if m and cur is None:
            cur = i
        if (not m or i == len(sample.loss_mask) - 1) and cur is not None:
            end = i + 1 if m else i
            runs.append((sample.response_ids[cur:end], sample.rollout_logprobs[cur:end]))
            cur = None
    return runs


def test_a_slime_generate_function_trains_exactly_the_engine_tokens(model_dir, on_path):
    cfg = _cfg(model_dir, "--custom-generate-function-path", "slime_style.two_turns")
    fns = RolloutFunctions.from_config(cfg)
    tok = build_char_tokenizer(os.path.join(model_dir, "again"))
    engine = Engine()
    sampling = SamplingParams(max_new_tokens=24, n=2, seed=5)
    samples = fns.generate(0, _requests(tok), sampling, engine.generate, tokenizer=tok)
    assert [s.group_index for s in samples] == [0, 0, 1, 1]
    replies = {tuple(p + ids): (ids, lps) for p, ids, lps in engine.replies}
    obs = tok.encode(" ok ")
    for s in samples:
        assert s.finish_reason == "length" and s.weight_version == 3 and s.metadata["slime_status"] == "truncated"
        # two engine turns with the observation between: the observation is the only loss-mask-0 run
        first, second = _segments(s, engine)
        n1 = len(first[0])
        assert s.response_ids[n1:n1 + len(obs)] == obs and s.loss_mask[n1:n1 + len(obs)] == [0] * len(obs)
        assert s.rollout_logprobs[n1:n1 + len(obs)] == [0.0] * len(obs)
        assert replies[tuple(s.prompt_ids + first[0])] == (first[0], first[1])
        context = s.prompt_ids + first[0] + obs
        assert replies[tuple(context + second[0])] == (second[0], second[1])


def test_slime_statuses_map_as_slime_treats_them(model_dir, on_path):
    from megatron_rl.rollout.slime_compat.contract import to_ours

    types = finder.slime_module("utils.types")
    req = GenerateRequest(prompt_ids=[7, 8], group_index=4, label="x")

    def sample(status, **kw):
        return types.Sample(group_index=4, tokens=[7, 8, 30, 31], response_length=2, loss_mask=[1, 1],
                            rollout_log_probs=[-0.5, -0.25], status=getattr(types.Sample.Status, status), **kw)

    assert to_ours(sample("ABORTED"), req, "f").finish_reason == "abort"
    assert to_ours(sample("TRUNCATED"), req, "f").finish_reason == "length"
    done = to_ours(sample("COMPLETED"), req, "f")
    assert (done.finish_reason, done.prompt_ids, done.response_ids, done.rollout_logprobs) == \
        ("stop", [7, 8], [30, 31], [-0.5, -0.25])
    assert to_ours(sample("FAILED"), req, "f").metadata["slime_status"] == "failed"
    assert to_ours(sample("COMPLETED", remove_sample=True), req, "f").loss_mask == [0, 0]
    with pytest.raises(ConfigError, match="rollout_log_probs None"):
        to_ours(dataclasses.replace(sample("COMPLETED"), rollout_log_probs=None), req, "f")


def test_an_aborted_slime_sample_asks_for_the_group_again(model_dir, on_path):
    cfg = _cfg(model_dir, "--custom-generate-function-path", "slime_style.aborted")
    fns = RolloutFunctions.from_config(cfg)
    tok = build_char_tokenizer(os.path.join(model_dir, "again"))
    samples = fns.generate(0, _requests(tok), SamplingParams(max_new_tokens=24, n=2), Engine().generate)
    assert [s.finish_reason for s in samples] == ["abort"] * 4


def test_a_slime_rollout_function_and_reward_functions(model_dir, on_path):
    cfg = _cfg(model_dir, "--rollout-function-path", "slime_style.generate_rollout", "--custom-rm-path",
               "slime_style.reward_func")
    fns = RolloutFunctions.from_config(cfg)
    tok = build_char_tokenizer(os.path.join(model_dir, "again"))
    engine = Engine()
    samples = fns.generate(0, _requests(tok), SamplingParams(max_new_tokens=24, n=2, seed=1), engine.generate)
    assert [s.group_index for s in samples] == [0, 0, 1, 1]
    replies = [(p, ids, lps) for p, ids, lps in engine.replies]
    assert sorted((s.prompt_ids, s.response_ids, s.rollout_logprobs) for s in samples) == sorted(replies)
    assert all(s.loss_mask == [1] * len(s.response_ids) for s in samples)
    reward = load_custom_reward("slime_style.reward_func", cfg=cfg)
    assert compute_rewards(samples, reward) == [1.5] * 4
    batched = load_custom_reward("slime_style:batched_reward", cfg=cfg)
    assert compute_rewards(samples, batched) == [float(len(s.response_ids)) for s in samples]


def test_slime_signatures_are_checked_when_loaded(tmp_path, on_path):
    (tmp_path / "bad_slime.py").write_text("async def generate(args, sample):\n    return sample\n")
    with pytest.raises(ConfigError, match="cannot be called as slime calls it"):
        load_function(str(tmp_path / "bad_slime.py") + ":generate", "--custom-generate-function-path")
    assert load_function("slime_style.two_turns", "--custom-generate-function-path")


def test_an_installed_slime_is_never_shadowed(tmp_path, monkeypatch):
    (tmp_path / "slime").mkdir()
    (tmp_path / "slime" / "__init__.py").write_text("REAL = True\n")
    saved = {k: v for k, v in sys.modules.items() if k == "slime" or k.startswith("slime.")}
    for k in saved:
        del sys.modules[k]
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        finder.install()
        real = importlib.import_module("slime")
        assert getattr(real, "REAL", False) and not finder.is_shim(real)
    finally:
        for k in [k for k in sys.modules if k == "slime" or k.startswith("slime.")]:
            del sys.modules[k]
        sys.modules.update(saved)


def test_a_slime_rollout_function_on_the_embedded_engine_trains_its_replies(tmp_path, tiny_hf_models, on_path,
                                                                          monkeypatch):
    """Through the rollout manager, on the real embedded engine behind the gateway: slime's rollout function
    (groups from ``data_source``, ``generate_and_rm_group``, slime's default token generate) and its reward
    function; every sample is one gateway reply, tokens and log-probs exactly."""
    import json

    from megatron_rl.rollout.build import build_rollout
    from megatron_rl.rollout.slime_compat.contract import ENGINE_REPLIES

    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": [1, 2, 3 + i], "label": "yes"}) + "\n" for i in range(4)))
    cfg = parse_config(["--hf-checkpoint", tiny_hf_models("qwen2"), "--prompt-data", str(prompts),
                        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "6",
                        "--rollout-function-path", "slime_style.generate_rollout",
                        "--custom-rm-path", "slime_style.reward_func",
                        "--save-debug-rollout-data", str(tmp_path / "debug" / "r_{rollout_id}.pt")])
    manager = build_rollout(cfg)
    samples, metrics = manager.generate(0)
    # the reward function's own rule: no response text (this tiny model has no tokenizer), n_samples_per_prompt 2
    assert [s.group_index for s in samples] == [0, 0, 1, 1] and [s.reward for s in samples] == [0.5] * 4
    replies = [json.loads(line) for line in (tmp_path / "debug" / ENGINE_REPLIES).read_text().splitlines()]
    assert sorted((s.prompt_ids, s.response_ids, s.rollout_logprobs) for s in samples) == \
        sorted((r["input_ids"], r["output_ids"], r["logprobs"]) for r in replies)


def test_a_slime_generate_function_under_the_asynchronous_producer(model_dir, on_path):
    """--async-mode one-step / full: the producer's gated engine call serves the gateway; a weight sync that cuts a
    call ends the group's attempt (generated again after it), and every trained token is within the bound."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runner"))
    from test_producer import B, PausingEngine, Prompts, make, train  # the producer's doubles

    cfg = _cfg(model_dir, "--custom-generate-function-path", "slime_style.two_turns")
    engine, prompts = PausingEngine(seed=5, delay=0.002), Prompts()
    producer = make(engine, prompts, k=1, partial=False,
                    generate_group=RolloutFunctions.from_config(cfg).group_generate(None))
    producer.start()
    try:
        trained = train(producer, engine, steps=4, trainer_delay=0.005, seed=5)
    finally:
        producer.stop()
    indices = []
    for step, groups in trained:
        for g in groups:
            indices.append(g.request.metadata["prompt_index"])
            for s in g.samples:
                assert s.finish_reason != "abort" and set(s.response_ids) == {7} and s.oldest_version >= step - 1
    assert indices == list(range(4 * B))


def test_the_gateway_batches_the_requests_that_wait_and_honours_stop_strings(model_dir):
    """Requests that arrive while an engine call runs go to the engine in the next call, together, each with its
    own budget; a stop string cuts the engine's tokens where their text completes it."""
    import json
    import threading
    import time
    import urllib.request

    from megatron_rl.rollout.slime_compat.gateway import Gateway

    tok = build_char_tokenizer(os.path.join(model_dir, "gw"))
    entered, release, engine = threading.Event(), threading.Event(), Engine()

    def call(requests, sampling):
        if not engine.calls:
            entered.set()
            release.wait(60)
        return engine.generate(requests, sampling)

    gw = Gateway(tok).start()

    def post(body):
        req = urllib.request.Request(gw.url + "/generate", data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    replies = {}
    try:
        with gw.lane(call):
            bodies = {k: {"input_ids": [30 + k, 31], "return_logprob": True,
                          "sampling_params": {"max_new_tokens": 3 + k, "temperature": 1.0}} for k in range(4)}
            threads = [threading.Thread(target=lambda k=k: replies.__setitem__(k, post(bodies[k]))) for k in range(4)]
            threads[0].start()
            assert entered.wait(60)  # the first request is inside its engine call (held until released)
            deadline = time.monotonic() + 60
            for t in threads[1:]:
                t.start()
            while len(gw._queue) < 3 and time.monotonic() < deadline:  # state: the other three queued behind it
                time.sleep(0.01)
            release.set()
            for t in threads:
                t.join(60)
            params = {"max_new_tokens": 5, "sampling_seed": 7}
            full = post({"text": "hi", "return_logprob": True, "sampling_params": params})
            cut = tok.decode(full["output_ids"][1:2])  # the second token's text: the stop string
            stop = post({"text": "hi", "return_logprob": True, "sampling_params": {**params, "stop": [cut]}})
    finally:
        gw.stop()
    assert engine.calls[:2] == [1, 3]  # the three that waited: one call, each with its own budget
    for k, reply in replies.items():
        pairs = reply["meta_info"]["output_token_logprobs"]
        assert [p[1] for p in pairs] == reply["output_ids"] and len(pairs) == min(3 + k, 5)
    first = next(k for k in range(1, 6) if cut in tok.decode(full["output_ids"][:k]))
    assert stop["output_ids"] == full["output_ids"][:first] and stop["meta_info"]["finish_reason"] == \
        {"type": "stop", "matched": cut}


@pytest.mark.parametrize("rm_type, response, label, expected", [
    ("f1", "The capital is Paris", "Paris", 2 * (1 / 3) * 1 / (1 / 3 + 1)),  # "capital is paris" vs "paris"
    ("f1", "yes", "no", 0.0),
    ("f1", "paris, France!", "france paris", 1.0),
    ("boxed_exact_match", "so \\boxed{Paris}.", "paris", 1.0),
    ("boxed_exact_match", "Paris", "paris", 0.0),  # no box: ""
    ("boxed_f1", "x \\boxed{new york city}", "New York", 0.8),
])
def test_slimes_rule_rewards(rm_type, response, label, expected):
    from megatron_rl.rollout.rewards import get_reward_fn

    sample = Sample(group_index=0, prompt_ids=[1], response_ids=[2], response_text=response, label=label)
    assert get_reward_fn(rm_type=rm_type)([sample]) == [pytest.approx(expected)]


def test_a_slime_sample_longer_than_the_budget_trains_as_its_prefix(model_dir, on_path):
    cfg = _cfg(model_dir, "--custom-generate-function-path", "slime_style.whole_budget_each_turn")
    engine = Engine()
    samples = RolloutFunctions.from_config(cfg).generate(0, _requests(build_char_tokenizer(
        os.path.join(model_dir, "again"))), SamplingParams(max_new_tokens=8, n=2, seed=2), engine.generate)
    for s in samples:  # two turns of 5 tokens for a budget of 8: the first 8, exactly as the engine gave them
        first = next(r for r in engine.replies if r[0] == s.prompt_ids and r[1] == s.response_ids[:len(r[1])])
        second = next(r for r in engine.replies if r[0] == s.prompt_ids + first[1])
        assert s.response_ids == (first[1] + second[1])[:8] and s.rollout_logprobs == (first[2] + second[2])[:8]
        assert s.finish_reason == "length" and s.metadata["slime_response_length"] == 10


def test_a_reward_the_slime_function_set_is_the_reward_without_a_reward_flag(model_dir, on_path):
    from megatron_rl.rollout.rewards import reward_fn_from_config, reward_source

    cfg = _cfg(model_dir, "--custom-generate-function-path", "slime_style.scores_itself")
    samples = RolloutFunctions.from_config(cfg).generate(0, _requests(build_char_tokenizer(
        os.path.join(model_dir, "again"))), SamplingParams(max_new_tokens=24, n=2, seed=2), Engine().generate)
    assert compute_rewards(samples, reward_fn_from_config(cfg)) == [float(len(s.response_ids)) for s in samples]
    assert reward_source(cfg) == "the reward --custom-generate-function-path slime_style.scores_itself set"
    unscored = [dataclasses.replace(samples[0], metadata={})]
    with pytest.raises(ConfigError, match="did not set sample.reward and no reward flag is given; pass --rm-type"):
        compute_rewards(unscored, reward_fn_from_config(cfg))

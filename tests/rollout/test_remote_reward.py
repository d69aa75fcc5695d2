"""--rm-url: rewards from a reward server over HTTP, against real local servers (http.server in a thread).

Every test decides from state: a "slow" server is one that never answers until the test releases it,
concurrency is proven by a barrier every chunk's request must reach, a refused connection is a port
nobody listens on until the client's retry wait (a hook here) starts the server.
"""

import json
import socket
import threading

import pytest
from reward_server import RewardServer  # tests/rollout/ is on sys.path (pytest's rootdir-relative import)

from megatron_rl.config import parse_config
from megatron_rl.config.validate import collect_errors
from megatron_rl.data.types import Sample
from megatron_rl.errors import ConfigError
from megatron_rl.rollout.remote_reward import RemoteReward, RewardServerError
from megatron_rl.rollout.rewards import compute_rewards, reward_fn_from_config, reward_metrics


def score_lengths(body):
    """Reward: the response's length; metric: whether it ends with token 2."""
    rewards = [{"reward": float(len(s["response_ids"])), "ends_with_2": float(s["response_ids"][-1] == 2)}
               for s in body["samples"]]
    return 200, json.dumps({"rewards": rewards}).encode()


@pytest.fixture
def serve():
    servers = []

    def start(reply, port=0):
        servers.append(RewardServer(reply, port))
        return servers[-1]
    yield start
    for server in servers:
        server.close()


def samples(count):
    return [Sample(group_index=i // 2, prompt_ids=[7, i], response_ids=list(range(1, i + 2)), prompt_text=f"p{i}",
                   response_text=f"r{i}", label=str(i), finish_reason="stop", metadata={"prompt_index": i})
            for i in range(count)]


def test_batches_are_posted_concurrently_and_scored_in_order(serve):
    chunks = 4
    barrier = threading.Barrier(chunks, timeout=60)  # passes only when all four requests are in flight at once

    def reply(body):
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            return 503, b'{"error": "requests were not concurrent"}'
        return score_lengths(body)

    server = serve(reply)
    rm = RemoteReward(server.url, batch_size=3, max_concurrency=chunks)
    batch = samples(10)
    assert compute_rewards(batch, rm, source=f"--rm-url {server.url}") == [float(i + 1) for i in range(10)]
    assert [len(b["samples"]) for b in sorted(server.bodies, key=lambda b: b["samples"][0]["index"])] == [3, 3, 3, 1]
    first = min(server.bodies, key=lambda b: b["samples"][0]["index"])["samples"][1]
    assert first == {"prompt": "p1", "response": "r1", "label": "1", "prompt_ids": [7, 1], "response_ids": [1, 2],
                     "group_index": 0, "index": 1, "finish_reason": "stop", "metadata": {"prompt_index": 1}}
    # the dict rewards' other keys are kept per sample and logged as reward/<key>, the mean over the batch
    assert batch[1].metadata["reward_metrics"] == {"ends_with_2": 1.0}
    assert reward_metrics(batch) == {"reward/ends_with_2": 0.1}
    rm.close()


def test_a_server_that_does_not_answer_in_time_is_named(serve):
    release = threading.Event()

    def hang(body):
        release.wait()  # never answers until the test releases it
        return score_lengths(body)

    server = serve(hang)
    rm = RemoteReward(server.url, timeout_s=0.2, max_retries=3)
    try:
        with pytest.raises(RewardServerError) as info:
            rm(samples(2))
    finally:
        release.set()
    err = info.value
    assert err.kind == "timeout" and err.url == server.url and rm.requests_sent == 1  # a timeout is never resent
    assert f"reward server {server.url} (--rm-url) did not answer a batch of 2 sample(s) within 0.2 s" in str(err)
    assert "--rm-timeout" in str(err)
    rm.close()


@pytest.mark.parametrize("status,payload,said", [
    (200, b"<html>oops</html>", "a body that is not JSON: '<html>oops</html>'"),
    (200, b'{"rewards": [1.0]}', "1 reward(s) for 3 sample(s)"),
    (200, b'{"reward": 1.0}', 'dict {"reward": 1.0} (no "rewards" list)'),
    (500, b"internal error", "HTTP 500: 'internal error'"),
    (422, b'{"detail": "bad label"}', "HTTP 422"),
])
def test_bad_replies_are_clear_errors_and_never_retried(serve, status, payload, said):
    server = serve(lambda body: (status, payload))
    rm = RemoteReward(server.url, max_retries=3)
    with pytest.raises(RewardServerError) as info:
        rm(samples(3))
    message = str(info.value)
    assert f"reward server {server.url} (--rm-url) answered a batch of 3 sample(s) with {said}" in message
    assert 'expected HTTP 200 with {"rewards": [one number or {"reward": number, ...} per sample' in message
    assert info.value.status == status and len(server.bodies) == 1 and rm.requests_sent == 1
    rm.close()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_refused_connection_is_retried_until_the_server_is_up(serve):
    port = _free_port()  # nobody listens: the first request is refused
    waits = []

    def sleep(seconds):  # the retry's wait: the server comes up now
        waits.append(seconds)
        if len(waits) == 2:
            serve(score_lengths, port=port)

    rm = RemoteReward(f"http://127.0.0.1:{port}/score", max_retries=5, backoff_s=0.5, sleep=sleep)
    assert [r["reward"] for r in rm(samples(2))] == [1.0, 2.0]
    assert waits == [0.5, 1.0] and rm.requests_sent == 3
    rm.close()


def test_a_server_that_never_comes_up_is_named_after_the_retries():
    port = _free_port()
    waits = []
    rm = RemoteReward(f"http://127.0.0.1:{port}/score", max_retries=4, backoff_s=3.0, sleep=waits.append)
    with pytest.raises(RewardServerError) as info:
        rm(samples(1))
    assert info.value.kind == "unreachable" and waits == [3.0, 6.0, 8.0, 8.0]  # doubling, capped
    assert (f"could not reach reward server http://127.0.0.1:{port}/score (--rm-url) for a batch of 1 sample(s) "
            "after 5 attempt(s)") in str(info.value)
    assert "is the server running and is the URL right?" in str(info.value)
    rm.close()


def test_metadata_json_cannot_hold_is_sent_as_text(serve):
    server = serve(score_lengths)
    batch = samples(1)
    batch[0].metadata["spans"] = ((0, 0, 3),)
    batch[0].metadata["odd"] = {1, 2}.__class__  # not JSON: sent as its str
    RemoteReward(server.url)(batch)
    assert server.bodies[0]["samples"][0]["metadata"]["spans"] == [[0, 0, 3]]
    assert server.bodies[0]["samples"][0]["metadata"]["odd"] == "<class 'set'>"


@pytest.mark.parametrize("reward,match", [
    ({"score": 1.0}, r"returned a dict without a 'reward' key for sample 0 \(prompt_index 0\) \(keys: score\)"),
    ({"reward": 1.0, "judge": "good"}, r"returned 'good' for metric 'judge' of sample 0 \(prompt_index 0\); rewards "
                                       "and reward metrics must be numbers"),
    ({"reward": float("inf")}, r"returned inf for sample 0 \(prompt_index 0\); rewards must be finite"),
    ("1.0", "returned '1.0' for sample 0"),
])
def test_bad_dict_rewards_name_the_source(reward, match):
    with pytest.raises(ConfigError, match=match):
        compute_rewards(samples(1), lambda batch: [reward], source="--rm-url http://x/score")


def test_rescoring_drops_the_metrics_of_the_previous_score():
    batch = samples(2)
    compute_rewards(batch, lambda b: [{"reward": 1.0, "a": 1.0}, {"reward": 0.0, "a": 0.0, "b": 4.0}])
    assert reward_metrics(batch) == {"reward/a": 0.5, "reward/b": 4.0}
    compute_rewards(batch, lambda b: [1.0, 0.0])
    assert reward_metrics(batch) == {} and [s.reward for s in batch] == [1.0, 0.0]


# ------------------------------------------------------------------------------------- flags
@pytest.fixture
def argv(tiny_hf_models, tmp_path):
    def make(*extra):
        return ["--hf-checkpoint", tiny_hf_models("qwen2"), *extra]
    return make


def test_rm_url_flags_build_the_remote_reward(argv, serve):
    server = serve(score_lengths)
    cfg = parse_config(argv("--rm-url", server.url, "--rm-timeout", "30", "--rm-batch-size", "4",
                            "--rm-max-concurrency", "2", "--rm-max-retries", "1"))
    rm = reward_fn_from_config(cfg)
    assert isinstance(rm, RemoteReward)
    assert (rm.url, rm.timeout_s, rm.batch_size, rm.max_retries) == (server.url, 30.0, 4, 1)
    assert compute_rewards(samples(5), rm) == [1.0, 2.0, 3.0, 4.0, 5.0] and len(server.bodies) == 2
    rm.close()


def test_rm_url_flag_errors(argv):
    def errors(*extra):
        return collect_errors(parse_config(argv(*extra), validate=False))

    (found,) = [e for e in errors("--rm-url", "http://h:1/s", "--rm-type", "math") if "--rm-url" in e]
    assert "--rm-type would score them again: pick one reward" in found
    assert any("--custom-rm-path" in e for e in errors("--rm-url", "http://h:1/s", "--custom-rm-path", "m:f"))
    assert any("must be an http:// or https:// URL" in e for e in errors("--rm-url", "h:1/s"))
    (found,) = [e for e in errors("--rm-timeout", "5", "--rm-batch-size", "8") if "--rm-timeout" in e]
    assert "--rm-timeout 5.0, --rm-batch-size 8 tune the reward server, which only --rm-url names" in found
    assert any("--rm-max-concurrency 0 must be >= 1" in e for e in errors("--rm-url", "http://h/", "--rm-max-"
                                                                          "concurrency", "0"))
    assert any("--rm-max-retries -1 must be >= 0" in e for e in errors("--rm-url", "http://h/", "--rm-max-retries",
                                                                       "-1"))
    assert errors("--rm-url", "https://rm.example:8000/score", "--rm-max-retries", "0") == []

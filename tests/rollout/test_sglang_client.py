"""SGLang client and engine against the protocol-exact stand-in server (tests/rollout/sglang_standin.py)."""

import os
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.errors import ConfigError, EngineError, SyncError
from megatron_rl.rollout import ENGINES, GenerateRequest, SamplingParams
from megatron_rl.rollout.sglang import SGLangClient, SGLangEngine, SGLangEngineError, SGLangSyncError
from megatron_rl.rollout.sglang import protocol
from megatron_rl.rollout.sglang.protocol import parse_weight_version

from sglang_standin import SGLangStandIn  # tests/ is on sys.path (conftest)

REQUESTS = [GenerateRequest([5, 17, 3], 0, label="a", metadata={"k": 0}),
            GenerateRequest([9, 1, 100, 42], 1, label="b"), GenerateRequest([7, 7], 2)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=5, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True, seed=11, n=2)


def wait_for(predicate, what: str, timeout_s: float = 120.0) -> None:
    """Wait for a state; the timeout only bounds a hang (and names it)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"hung: {what} not reached within {timeout_s:.0f} s"
        time.sleep(0.01)


@pytest.fixture
def model(tiny_hf_models):
    return tiny_hf_models("qwen2")


@pytest.fixture
def standin(model):
    with SGLangStandIn(model) as server:
        yield server


@pytest.fixture
def engine(standin, model, tmp_path):
    eng = SGLangEngine([standin.url], weight_dir=str(tmp_path / "weights"), hf_checkpoint=model, timeout_s=10,
                       connect_retries=1, backoff_s=0.05)
    yield eng
    eng.close()


def checkpoint(path):
    return load_file(os.path.join(path, "model.safetensors"))


def tokens(samples):
    return [s.response_ids for s in samples]


def rows_sent(standin, count):
    """The last ``count`` /generate rows the stand-in answered: (rid, sampling_params received, row sent back)."""
    return [(rid, standin.generated[rid]["sampling_params"], standin.generated[rid]["row"])
            for rid in standin.rids_served[-count:]]


def test_generate_round_trip(engine, standin, model):
    """What the engine sends for a batch and how it reads the rows back. The rows' shape is real
    SGLang 0.5.23's (test_standin_replies.py holds the stand-in to it); which tokens come back is the
    server's business, checked against real SGLang by scripts/test_sglang_real.sh."""
    samples = engine.generate(REQUESTS, SAMPLED)
    assert len(samples) == 6 and standin.requests["/generate"] == 1  # one batch per server per call
    sent = rows_sent(standin, 6)
    for k, (s, (rid, params, row)) in enumerate(zip(samples, sent)):
        i, j = divmod(k, 2)
        req = REQUESTS[i]
        assert (s.group_index, s.prompt_ids, s.label, s.metadata) == (req.group_index, req.prompt_ids, req.label,
                                                                      req.metadata)
        # the row sent: its own rid and sampling_seed, the sampling params in SGLang's names
        assert rid.endswith(f"-{i}-{j}") and params == protocol.sampling_params_dict(
            SAMPLED, seed=protocol.row_seed(SAMPLED.seed, i, j))
        # the row read back: tokens, log-probs, text, finish reason and version as the server sent them
        logprobs = [entry[0] for entry in row["meta_info"]["output_token_logprobs"]]
        assert (s.response_ids, s.rollout_logprobs, s.response_text) == (row["output_ids"], logprobs, row["text"])
        assert row["meta_info"]["finish_reason"]["type"] == s.finish_reason == "length"
        assert row["meta_info"]["weight_version"] == "default" and s.weight_version == 0
    seeds = [params["sampling_seed"] for _, params, _ in sent]
    assert len(set(seeds)) == 6
    engine.generate(REQUESTS, SAMPLED)  # seeded per row: the same call sends the same seeds
    assert [params["sampling_seed"] for _, params, _ in rows_sent(standin, 6)] == seeds
    greedy = engine.generate(REQUESTS, GREEDY)
    assert all(params["temperature"] == 0.0 and params["max_new_tokens"] == 5 and params["ignore_eos"]
               for _, params, _ in rows_sent(standin, 3))
    # a stop token: sent as stop_token_ids; a row ending {"type": "stop", "matched": id} reads "stop"
    ids = greedy[0].response_ids
    stop = ids[next(k for k in range(1, len(ids)) if ids[k] not in ids[:k])]  # a token first seen past position 0
    first = engine.generate(REQUESTS[:1], SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=(stop,)))
    [(_, params, row)] = rows_sent(standin, 1)
    assert params["stop_token_ids"] == [stop] and row["meta_info"]["finish_reason"] == {"type": "stop",
                                                                                         "matched": stop}
    assert first[0].finish_reason == "stop" and first[0].response_ids == row["output_ids"]


def test_round_robin_keeps_a_prompts_samples_on_one_server(model, standin):
    with SGLangStandIn(model) as second:
        eng = SGLangEngine([standin.url, second.url], connect_retries=0)
        single = SGLangEngine([standin.url], connect_retries=0)
        try:
            samples = eng.generate(REQUESTS, SAMPLED)
            assert standin.requests["/generate"] == second.requests["/generate"] == 1
            by_row = {}  # (prompt, sample) -> (sampling_params sent, row answered), whichever server had it
            for server in (standin, second):
                prompts = {rid.rsplit("-", 2)[1] for rid in server.rids_served}
                assert len(server.rids_served) == 2 * len(prompts)  # both samples of each of its prompts
                for rid in server.rids_served:
                    i, j = map(int, rid.rsplit("-", 2)[1:])
                    by_row[(i, j)] = (server.generated[rid]["sampling_params"], server.generated[rid]["row"])
            # the samples come back in request order, each the row its server answered
            assert tokens(samples) == [by_row[(i, j)][1]["output_ids"] for i in range(3) for j in range(2)]
            # routing changes no request: one server alone is sent the same seed for every (prompt, sample)
            single.generate(REQUESTS, SAMPLED)
            alone = {tuple(map(int, rid.rsplit("-", 2)[1:])): standin.generated[rid]["sampling_params"]
                     for rid in standin.rids_served[-6:]}
            assert alone == {row: params for row, (params, _) in by_row.items()}
        finally:
            eng.close()
            single.close()


def test_disk_update_changes_generations_and_bumps_weight_version(engine, standin, model, tmp_path):
    before = engine.generate(REQUESTS, GREEDY)
    tensors = checkpoint(model)
    zeroed = dict(tensors, **{"lm_head.weight": torch.zeros_like(tensors["lm_head.weight"])})
    engine.update_weights(zeroed.items(), version=1)
    assert engine.weight_version == 1 and standin.model_info()["weight_version"] == "1"
    vdir = tmp_path / "weights" / "v1"
    assert (vdir / "model.safetensors").exists() and (vdir / "config.json").exists()
    after = engine.generate(REQUESTS, GREEDY)
    assert all(s.weight_version == 1 for s in after)
    vocab = tensors["lm_head.weight"].shape[0]
    uniform = -torch.log(torch.tensor(float(vocab))).item()  # zero logits: every token equally likely
    assert all(abs(lp - uniform) < 1e-5 for s in after for lp in s.rollout_logprobs)
    assert tokens(after) != tokens(before)
    engine.update_weights(iter(tensors.items()), version=2)  # a one-shot stream, as a trainer sends it
    engine.update_weights(tensors.items(), version=3)
    assert tokens(engine.generate(REQUESTS, GREEDY)) == tokens(before)
    assert sorted(os.listdir(tmp_path / "weights")) == ["v2", "v3"]  # pruned to keep_versions, no temp dirs left
    health = engine.health()
    assert health.ok and health.weight_version == 3, health.detail
    with pytest.raises(SyncError, match="older than"):
        engine.update_weights(tensors.items(), version=2)


def test_failed_update_names_server_and_message_and_keeps_version(engine, standin, model):
    bad = {"model.not_a_tensor": torch.zeros(3)}
    with pytest.raises(SyncError) as info:
        engine.update_weights(bad.items(), version=1)
    message = str(info.value)
    assert standin.url in message and "/update_weights_from_disk" in message and "HTTP 400" in message
    assert "unknown name" in message  # the server's own words
    assert engine.weight_version == 0 and not engine.health().ok
    with pytest.raises(EngineError, match="last weight update failed"):
        engine.generate(REQUESTS, GREEDY)
    assert standin.requests["/update_weights_from_disk"] == 1


def test_http_errors_are_never_retried(standin):
    client = SGLangClient(standin.url, connect_retries=3, backoff_s=0.01)
    with pytest.raises(SGLangSyncError) as info:
        client.update_weights_from_disk("/no/such/dir", weight_version="1")
    err = info.value
    assert (err.status, err.endpoint, err.url) == (400, "/update_weights_from_disk", standin.url)
    # real SGLang's words name no path ("Failed to get weights iterator: ..."): the client's message adds it
    assert "Failed to get weights iterator" in err.server_message and "/no/such/dir" in str(err)
    assert standin.requests["/update_weights_from_disk"] == 1
    with pytest.raises(SGLangEngineError) as info:  # 404 with FastAPI's body
        client.request("POST", "/no_such_endpoint", {})
    assert info.value.status == 404 and "Not Found" in str(info.value)
    # a connection dropped after sending: retried for an idempotent endpoint, never for a weight endpoint
    standin.faults.drop["/model_info"] = 1
    assert client.weight_version() == "default" and standin.requests["/model_info"] == 2
    standin.faults.drop["/update_weight_version"] = 1
    with pytest.raises(SGLangSyncError, match="may or may not have applied"):
        client.update_weight_version("5")
    assert standin.requests["/update_weight_version"] == 1
    client.close()


def test_connection_errors_are_retried_with_backoff(standin):
    client = SGLangClient(standin.url, connect_retries=5, backoff_s=0.1, timeout_s=60)
    assert client.health()
    standin.stop()
    # the server comes back for the 3rd attempt (was: a 0.25 s timer racing the backoff on a busy machine)
    attempts, send = [], client._http.request

    def request(*args, **kwargs):
        attempts.append(args[1])
        if len(attempts) == 3:
            standin.start()
        return send(*args, **kwargs)

    client._http.request = request
    assert client.model_info()["weight_version"] == "default"  # refused, refused, then answered
    assert attempts == ["/model_info"] * 3 and standin.requests["/model_info"] == 1
    standin.stop()
    quick = SGLangClient(standin.url, connect_retries=2, backoff_s=0.01)
    with pytest.raises(SGLangEngineError) as info:
        quick.model_info()
    assert standin.url in str(info.value) and "/model_info" in str(info.value) and "3 attempt(s)" in str(info.value)
    client.close()
    quick.close()


def test_timeout_names_the_server_the_endpoint_and_the_wait(standin):
    standin.faults.delay_s["/generate"] = 600.0  # no answer before the test ends: only the timeout can end the call
    client = SGLangClient(standin.url, timeout_s=0.3, connect_retries=3)
    with pytest.raises(SGLangEngineError) as info:
        client.generate([[1, 2]], [{"max_new_tokens": 1}])
    message = str(info.value)
    assert standin.url in message and "POST /generate" in message and "within 0.3 s" in message
    assert "raise --rollout-generate-timeout" in message  # the flag that sets this bound
    # a read timeout is not retried: the server got it once, and the client has given up (was: 'took < 0.9 s')
    wait_for(lambda: standin.requests["/generate"] >= 1, "the request at the server")
    assert standin.requests["/generate"] == 1
    client.close()


def test_server_death_mid_request_is_a_clear_error(engine, standin):
    standin.faults.die_on = "/generate"
    with pytest.raises(EngineError) as info:
        engine.generate(REQUESTS, GREEDY)
    assert standin.url in str(info.value) and "/generate" in str(info.value) and "likely died" in str(info.value)
    assert not engine.health().ok


def test_begin_end_weight_update_detection(model, standin):
    client = SGLangClient(standin.url, connect_retries=0)
    with pytest.raises(SGLangSyncError) as info:  # 0.5.21+: a tensor push outside begin/end is a 400
        client.update_weights_from_tensor(["cGF5bG9hZA=="])  # base64 (else the request fails validation first)
    assert info.value.status == 400 and "begin_weight_update" in info.value.server_message
    assert client.begin_weight_update() and client.has_update_session and standin.in_session
    assert client.end_weight_update() and not standin.in_session
    client.close()
    with SGLangStandIn(model, legacy=True) as old:
        legacy = SGLangClient(old.url, connect_retries=0)
        assert legacy.begin_weight_update() is False and legacy.has_update_session is False
        assert legacy.end_weight_update() is False and legacy.begin_weight_update() is False
        assert old.requests["/begin_weight_update"] == 1 and old.requests["/end_weight_update"] == 0
        legacy.close()


def test_release_and_resume(engine, standin):
    """The tags each call sends and what the engine allows meanwhile (real SGLang on CPU cannot release:
    what a resumed server generates is for a GPU run of scripts/test_sglang_real.sh)."""
    engine.release()
    assert standin.released == {"weights", "kv_cache", "cuda_graph"}
    health = engine.health()
    assert health.released and not health.ok
    generated = standin.requests["/generate"]
    with pytest.raises(EngineError, match="released"):
        engine.generate(REQUESTS, GREEDY)
    assert standin.requests["/generate"] == generated  # refused by the engine, nothing sent
    engine.resume()
    assert standin.released == set() and len(engine.generate(REQUESTS, GREEDY)) == 3
    assert standin.requests["/generate"] == generated + 1
    engine.release(tags=["kv_cache"])
    assert standin.released == {"kv_cache"}
    engine.resume(tags=["kv_cache"])
    with pytest.raises(ConfigError, match="memory tag"):
        engine.release(tags=["gpu"])


def test_resume_in_two_halves_around_a_weight_update(engine, standin, model):
    """The colocated wake (runner/colocation.py): weights back, the sync writes them while the KV cache
    is still released (no generation yet), then the rest; an update into released weights is refused."""
    engine.release()
    with pytest.raises(EngineError, match="weights released"):
        engine.update_weights(checkpoint(model).items(), version=1)
    assert standin.disk_updates == []  # refused before anything was sent
    engine.resume_weights()
    assert standin.released == {"kv_cache", "cuda_graph"} and engine.health().released
    with pytest.raises(EngineError, match="released"):
        engine.generate(REQUESTS, GREEDY)
    engine.update_weights(checkpoint(model).items(), version=1)
    assert [version for version, _ in standin.disk_updates] == ["1"]  # loaded while the KV cache was released
    engine.resume_kv_cache()
    assert standin.released == set() and engine.health().ok
    assert {s.weight_version for s in engine.generate(REQUESTS, GREEDY)} == {1}
    engine.resume_weights()  # nothing released: no request
    assert standin.requests["/resume_memory_occupation"] == 2


def test_abort_flush_and_pause(engine, standin):
    client = engine.clients[0]
    standin.faults.delay_s["/generate:row"] = 10.0  # rows stay pending until aborted
    result = {}
    worker = threading.Thread(target=lambda: result.update(samples=engine.generate(REQUESTS, GREEDY)))
    worker.start()
    wait_for(lambda: standin.pending_count() > 0, "the rows pending")
    with pytest.raises(SGLangEngineError) as info:  # 400 while requests are pending
        client.flush_cache()
    # real SGLang answers a bare "Flush cache failed."; the client's message says why
    assert info.value.status == 400 and info.value.server_message == "Flush cache failed."
    assert "running or waiting" in str(info.value)
    with pytest.raises(SGLangEngineError, match="idle"):
        client.release_memory_occupation(["weights"])
    engine.abort()
    worker.join(120)  # a hang bound
    assert [s.finish_reason for s in result["samples"]] == ["abort"] * 3
    assert all(s.response_ids == [] for s in result["samples"])
    client.flush_cache()
    # pause holds new requests until continue
    standin.faults.delay_s.pop("/generate:row")
    assert client.pause_generation("in_place")["status"] == "ok"
    worker = threading.Thread(target=lambda: result.update(samples=engine.generate(REQUESTS, GREEDY)))
    worker.start()
    wait_for(lambda: standin.pending_count() > 0, "the rows held at the server")  # was: alive after a 0.2 s sleep
    assert worker.is_alive() and result["samples"][0].finish_reason == "abort"  # not answered yet
    client.continue_generation()
    worker.join(120)  # a hang bound
    assert [s.finish_reason for s in result["samples"]] == ["length"] * 3


def test_weight_version_endpoint_and_parse():
    assert parse_weight_version("default", where="x") == 0 and parse_weight_version("12", where="x") == 12
    with pytest.raises(EngineError, match="not an integer"):
        parse_weight_version("run-1", where="x")


def test_update_weight_version_and_health_mismatch(engine, standin):
    client = engine.clients[0]
    assert client.update_weight_version("7")["new_version"] == "7"
    assert client.weight_version() == "7"
    health = engine.health()
    assert not health.ok and "differ" in health.detail


def test_from_config_and_the_table(engine, standin, model, tmp_path):
    from megatron_rl.config import parse_config

    assert ENGINES.get("sglang") is SGLangEngine
    flags = ["--hf-checkpoint", model, "--rollout-backend", "sglang", "--update-weight-transport", "disk",
             "--update-weight-disk-dir", str(tmp_path / "w")]
    built = SGLangEngine.from_config(parse_config([*flags, "--rollout-engine-urls", standin.url,
                                                   "--rollout-generate-timeout", "45",
                                                   "--rollout-update-timeout", "90"]))
    try:
        assert built.urls == [standin.url] and built.weights.root == str(tmp_path / "w")
        assert (built.generate_timeout_s, built.update_timeout_s) == (45.0, 90.0)
        assert built.weights.hf_checkpoint == model and built.tokenizer is None  # the tiny model has none
        assert built.health().ok
    finally:
        built.close()
    with pytest.raises(ConfigError, match="needs servers: the engines this run launches, or --rollout-engine-urls"):
        SGLangEngine.from_config(parse_config(flags, validate=False))
    # the engine's HTTP bounds are flags; on an engine in the trainer's processes they would bound nothing
    with pytest.raises(ConfigError, match="--rollout-update-timeout 90 bounds the driver's HTTP calls to a served"):
        parse_config(["--hf-checkpoint", model, "--rollout-backend", "embedded", "--rollout-update-timeout", "90"])
    with pytest.raises(EngineError, match="get_weights_by_name"):
        engine.named_weights()
    with pytest.raises(ConfigError, match="at least one"):
        SGLangEngine([])


def test_named_tensors_serialise_for_a_server_in_another_process_tree(tmp_path):
    """The tensor route's payload opens in an unrelated process, as in an SGLang server started apart.

    With torch's default file_descriptor sharing the receiver must fetch each fd from our
    multiprocessing resource sharer with our process tree's auth key, which another tree lacks
    (real SGLang: "digest sent was rejected", then its scheduler dies); file_system sharing sends a
    shared-memory file name instead.
    """
    import subprocess
    import sys

    from megatron_rl.rollout.sglang.protocol import serialize_named_tensors

    weights = [("lm_head.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
               ("norm.weight", torch.full((5,), 0.5, dtype=torch.bfloat16))]
    entry, buffers = serialize_named_tensors(iter(weights))
    assert torch.multiprocessing.get_sharing_strategy() == "file_system"
    assert all(b.data_ptr() != w.data_ptr() for b, (_, w) in zip(buffers, weights))  # copies, not the originals
    reader = ("import base64, io, pickle, sys, torch.multiprocessing\n"
              "pairs = pickle.load(io.BytesIO(base64.b64decode(sys.stdin.read())))\n"
              "print([(n, str(t.dtype), list(t.shape), float(t.float().sum())) for n, t in pairs])\n")
    out = subprocess.run([sys.executable, "-c", reader], input=entry, capture_output=True, text=True, timeout=60,
                         start_new_session=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str([("lm_head.weight", "torch.float32", [3, 4], 66.0),
                                      ("norm.weight", "torch.bfloat16", [5], 2.5)])
    del buffers
    with pytest.raises(ValueError, match="no tensors"):
        serialize_named_tensors([])


def test_weight_version_spans_pick_the_oldest_version():
    from megatron_rl.rollout.sglang.protocol import parse_generate_output

    row = {"text": "", "output_ids": [4, 5, 6], "meta_info": {
        "finish_reason": {"type": "length", "length": 3}, "weight_version": "3",
        "output_token_logprobs": [[-1.0, 4, None], [-1.5, 5, None], [-2.0, 6, None]],
        "weight_versions": [{"version": "2", "start": 0, "end": 1}, {"version": "3", "start": 1, "end": 3}]}}
    out = parse_generate_output(row, where="x")
    # meta_info.weight_version is the server's version at reply time; the first token came from version 2
    assert out.weight_version == 2 and out.weight_version_spans == ((2, 0, 1), (3, 1, 3))
    del row["meta_info"]["weight_versions"]  # older servers: the reply-time version is all there is
    assert parse_generate_output(row, where="x").weight_version == 3


def test_seed_ignored_by_a_server_without_deterministic_inference_is_warned(model, caplog):
    with SGLangStandIn(model, deterministic=False) as server:
        eng = SGLangEngine([server.url], timeout_s=10, connect_retries=0)
        try:
            with caplog.at_level("WARNING", logger="megatron_rl.rollout.sglang.engine"):
                eng.generate(REQUESTS, SAMPLED)
                eng.generate(REQUESTS, SAMPLED)
            warned = [r for r in caplog.records if "enable-deterministic-inference" in r.getMessage()]
            assert len(warned) == 1 and server.url in warned[0].getMessage()  # once per server
            assert server.requests["/server_info"] == 1
        finally:
            eng.close()


def test_seeded_sampling_on_a_deterministic_server_is_not_warned(engine, standin, caplog):
    # (whether a deterministic server replays a seed is the server's claim, not the client's: on real SGLang
    # it needs --enable-deterministic-inference, which the CPU route lacks; check_real_sglang.py's seeded()
    # checks it where the server reports it)
    assert engine.clients[0].server_info()["enable_deterministic_inference"] is True
    with caplog.at_level("WARNING", logger="megatron_rl.rollout.sglang.engine"):
        engine.generate(REQUESTS, SAMPLED)
    assert not [r for r in caplog.records if "deterministic" in r.getMessage()]
    assert all("sampling_seed" in params for _, params, _ in rows_sent(standin, 6))  # the seeds still go out

"""SGLangEngine through a real sglang-router (0.3.2, Rust) in front of two protocol-exact stand-in servers.

Why a real router: its request schema is typed (``sampling_params`` must be one map per request,
HTTP 422 otherwise), it forwards only generation (the weight, pause, flush and abort endpoints
answer 404 there) and lists its workers on ``GET /workers``; the engine's router mode is written
against exactly that, so a double of the router would prove nothing. The router is a subprocess
(``python -m sglang_router.launch_router``, installed by the test extras), the stand-ins serve
from this process.
"""

import math
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from safetensors.torch import load_file

from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError, MegatronRLError
from megatron_rl.rollout import GenerateRequest, SamplingParams
from megatron_rl.rollout.sglang import SGLangEngine
from megatron_rl.rollout.sglang.engine import discover_router

from _util import InThread, free_port
from sglang_standin import SGLangStandIn  # tests/ is on sys.path (conftest)

REQUESTS = [GenerateRequest([5, 17, 3], 0, label="a"), GenerateRequest([9, 1, 100, 42], 1, label="b"),
            GenerateRequest([7, 7], 2)]
SAMPLED = SamplingParams(temperature=1.0, max_new_tokens=5, ignore_eos=True, seed=11, n=2)


@pytest.fixture(scope="module")
def fleet(tiny_hf_models, tmp_path_factory):
    model = tiny_hf_models("qwen2")
    with SGLangStandIn(model) as a, SGLangStandIn(model) as b:
        port = free_port()
        log = open(tmp_path_factory.mktemp("router") / "router.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                                 "--port", str(port), "--worker-urls", a.url, b.url, "--policy", "round_robin",
                                 "--log-level", "warn", "--prometheus-port", str(free_port())], stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 300  # a hang bound: the router's start and first health checks
            while True:
                try:
                    workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
                    if len(workers) == 2 and all(w["is_healthy"] for w in workers):
                        break
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                assert proc.poll() is None, f"sglang-router exited {proc.returncode}; see {log.name}"
                assert time.monotonic() < deadline, f"hung: sglang-router not ready in 300 s; see {log.name}"
                time.sleep(0.2)
            yield model, url, (a, b), proc.pid  # the router's pid: the frozen-router test stops it
        finally:
            proc.terminate()
            proc.wait(timeout=120)  # a hang bound
            log.close()


def test_a_router_url_is_found_and_replaced_by_its_workers(fleet, tmp_path):
    model, router, (a, b), _ = fleet
    cfg = parse_config(["--hf-checkpoint", model, "--rollout-backend", "sglang", "--rollout-engine-urls", router,
                        "--update-weight-transport", "disk", "--update-weight-disk-dir", str(tmp_path / "w")])
    engine = SGLangEngine.from_config(cfg)
    try:
        assert sorted(engine.urls) == sorted([a.url, b.url]) and engine.router.base_url == router
    finally:
        engine.close()
    assert discover_router([a.url, b.url]) == ([a.url, b.url], None)  # plain servers: no router
    with pytest.raises(ConfigError, match="is an sglang-router; give the router alone"):
        discover_router([router, a.url])


def test_generation_through_the_router_equals_the_servers_and_weights_reach_every_worker(fleet, tmp_path):
    model, router, (a, b), _ = fleet
    workers, found = discover_router([router])
    via = SGLangEngine(workers, router_url=found, weight_dir=str(tmp_path / "weights"), hf_checkpoint=model,
                       timeout_s=10, connect_retries=1)
    direct = SGLangEngine([a.url], timeout_s=10, connect_retries=1)
    try:
        before = {s.url: s.requests["/generate"] for s in (a, b)}
        rids_before = {s.url: len(s.rids_served) for s in (a, b)}
        samples = via.generate(REQUESTS, SAMPLED)
        # each row its own request (6), the router spreading them over both workers; the row seeds and
        # rids pass through, so each worker is sent what one server is sent directly
        served = {s.url: s.requests["/generate"] - before[s.url] for s in (a, b)}
        assert sum(served.values()) == 6 and all(served.values()), served
        by_row = {}  # (prompt, sample) -> (sampling_params the worker received, row it answered)
        for s in (a, b):
            for rid in s.rids_served[rids_before[s.url]:]:
                by_row[tuple(map(int, rid.rsplit("-", 2)[1:]))] = (s.generated[rid]["sampling_params"],
                                                                   s.generated[rid]["row"])
        assert [s.response_ids for s in samples] == [by_row[(i, j)][1]["output_ids"]
                                                     for i in range(3) for j in range(2)]
        direct.generate(REQUESTS, SAMPLED)
        alone = {tuple(map(int, rid.rsplit("-", 2)[1:])): a.generated[rid]["sampling_params"]
                 for rid in a.rids_served[-6:]}
        assert alone == {row: params for row, (params, _) in by_row.items()}
        assert [(s.group_index, s.label) for s in samples] == [(r.group_index, r.label) for r in REQUESTS
                                                               for _ in range(2)]
        # a weight update goes to both workers (the router forwards none); generation through the router sees it
        tensors = load_file(os.path.join(model, "model.safetensors"))
        tensors["lm_head.weight"] = tensors["lm_head.weight"] * 0
        via.update_weights(tensors.items(), version=1)
        assert a.model_info()["weight_version"] == b.model_info()["weight_version"] == "1"
        after = via.generate(REQUESTS, SAMPLED)
        uniform = -math.log(tensors["lm_head.weight"].shape[0])
        assert all(abs(lp - uniform) < 1e-5 for s in after for lp in s.rollout_logprobs)
        assert all(s.weight_version == 1 for s in after) and via.health().ok
    finally:
        via.close()
        direct.close()


def test_a_frozen_router_is_named_within_the_generate_timeout_and_the_workers_still_answer(fleet, tmp_path):
    """The router's process stopped (SIGSTOP: it accepts connections and never answers): generation through it
    ends within the engine's generate timeout naming the router, the endpoint and the timeout; the engine's
    health polls and weight-side calls, which go to the workers, are not held by it."""
    model, router, (a, b), router_pid = fleet
    workers, found = discover_router([router])
    via = SGLangEngine(workers, router_url=found, weight_dir=str(tmp_path / "weights"), hf_checkpoint=model,
                       timeout_s=10, generate_timeout_s=0.5, connect_retries=0)
    os.kill(router_pid, signal.SIGSTOP)
    try:
        with pytest.raises(MegatronRLError) as err:
            InThread(lambda: via.generate(REQUESTS[:1], SAMPLED), bound_s=120, what="generate via the router").result()
        assert router in str(err.value) and "did not answer POST /generate within 0.5 s" in str(err.value), str(
            err.value)
        health = via.health()  # the workers answer (at the version an earlier test left): only generation
        assert health.weights_loaded and not via.dead_servers(), health  # goes through the router
    finally:
        os.kill(router_pid, signal.SIGCONT)
        via.close()


def test_a_503_through_the_router_is_retried_by_it_or_comes_back_as_aborted_rows(fleet, tmp_path):
    """A worker's 503 (SGLang aborted a row with a status, "Retry later."): what sglang-router 0.3.2 does
    with it, and what reaches the rollout: aborted rows carrying the words of whoever answered 503 (the
    rollout generates their groups again, --rollout-abort-retries), never an exception. Last in this
    module: the router's circuit breakers stay open for a while after the refusals."""
    model, router, (a, b), _ = fleet
    workers, found = discover_router([router])
    via = SGLangEngine(workers, router_url=found, weight_dir=str(tmp_path / "weights"), hf_checkpoint=model,
                       timeout_s=10, connect_retries=1)
    try:
        a.faults.unavailable_generates = 1  # one refusal: the router retries it on a worker
        samples = via.generate(REQUESTS, SAMPLED)
        assert a.faults.unavailable_generates == 0
        assert [s.finish_reason for s in samples if s.finish_reason == "abort"] == []
        assert all(s.response_ids for s in samples)
        a.faults.unavailable_generates = b.faults.unavailable_generates = 1000
        samples = via.generate(REQUESTS, SAMPLED)
        assert {s.finish_reason for s in samples} == {"abort"}
        messages = {s.metadata["finish_message"] for s in samples}
        assert all("(sglang-router) answered 503: " in m for m in messages), messages
        assert any("Retry later." in m or "No available workers" in m for m in messages), messages
    finally:
        a.faults.unavailable_generates = b.faults.unavailable_generates = 0
        via.close()

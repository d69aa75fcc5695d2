"""The SGLang engine launcher: placement, command lines, start-up, failures, stop.

Real parts: ``launcher.launch_engines`` / ``EngineFleet`` start real processes with the real
command line (``python -m sglang.launch_server ...``) and poll them over HTTP; the ``sglang``
package on PYTHONPATH is the test double in ``tests/rollout/sglang_double`` (CLI of SGLang, HTTP of
the protocol stand-in). ``scripts/test_sglang_real.sh --launcher`` runs the same launcher against
real SGLang. One process, no torchrun (the 2-rank URL exchange is in tests/e2e/test_sglang_launched.py).
"""

import json
import os
import signal
import sys

import pytest

from megatron_rl.config import parse_config
from megatron_rl.errors import ConfigError, EngineError
from megatron_rl.plan.engines import plan_engine_placement
from megatron_rl.rollout.sglang import SGLangEngine
from megatron_rl.rollout.sglang.launcher import _pass_through_args, engine_command, launch_engines

HERE = os.path.dirname(os.path.abspath(__file__))
DOUBLE = os.path.join(HERE, "sglang_double")


# ------------------------------------------------------------------ placement
def test_colocated_engines_take_the_devices_of_consecutive_trainer_ranks():
    p = plan_engine_placement(num_gpus=8, gpus_per_engine=2, colocate=True, num_nodes=2, gpus_per_node=4,
                              devices_per_node=4)
    assert [(e.node_rank, e.gpu_ids, e.trainer_ranks) for e in p.engines] == [
        (0, (0, 1), (0, 1)), (0, (2, 3), (2, 3)), (1, (0, 1), (4, 5)), (1, (2, 3), (6, 7))]
    assert p.engine_of_rank(5).index == 2 and p.colocated
    cpu = plan_engine_placement(num_gpus=2, gpus_per_engine=1, colocate=True, num_nodes=1, gpus_per_node=2,
                                devices_per_node=None)
    assert [(e.gpu_ids, e.trainer_ranks) for e in cpu.engines] == [((), (0,)), ((), (1,))]


def test_separate_engines_take_the_gpus_the_trainer_leaves_free_on_its_nodes():
    p = plan_engine_placement(num_gpus=4, gpus_per_engine=2, colocate=False, num_nodes=2, gpus_per_node=6,
                              devices_per_node=8)
    assert [(e.node_rank, e.gpu_ids, e.trainer_ranks) for e in p.engines] == [(0, (6, 7), ()), (1, (6, 7), ())]
    cpu = plan_engine_placement(num_gpus=3, gpus_per_engine=1, colocate=False, num_nodes=2, gpus_per_node=1,
                                devices_per_node=None)
    assert [e.node_rank for e in cpu.engines] == [0, 1, 0]


def test_an_engine_bigger_than_a_node_takes_whole_consecutive_nodes():
    p = plan_engine_placement(num_gpus=32, gpus_per_engine=16, colocate=True, num_nodes=4, gpus_per_node=8,
                              devices_per_node=8)
    assert [(e.node_rank, e.span, e.gpu_ids, e.trainer_ranks) for e in p.engines] == [
        (0, (0, 1), tuple(range(8)), tuple(range(16))), (2, (2, 3), tuple(range(8)), tuple(range(16, 32)))]
    assert p.spans_nodes and p.engine_of_rank(20).index == 1
    assert p.parts_on_node(1) == [(p.engines[0], 1)] and p.on_node(1) == []  # node 1 runs engine 0's second part
    assert p.engines[0].describe() == "SGLang engine 0 (not started, nodes 0,1, GPUs 0,1,2,3,4,5,6,7 on each)"
    sep = plan_engine_placement(num_gpus=4, gpus_per_engine=4, colocate=False, num_nodes=2, gpus_per_node=6,
                                devices_per_node=8)
    assert [(e.node_rank, e.span, e.gpu_ids) for e in sep.engines] == [(0, (0, 1), (6, 7))]
    cpu = plan_engine_placement(num_gpus=2, gpus_per_engine=2, colocate=True, num_nodes=2, gpus_per_node=1,
                                devices_per_node=None)
    assert [(e.span, e.gpu_ids, e.trainer_ranks) for e in cpu.engines] == [((0, 1), (), (0, 1))]
    within = plan_engine_placement(num_gpus=8, gpus_per_engine=8, colocate=True, num_nodes=1, gpus_per_node=8,
                                   devices_per_node=8)
    assert not within.spans_nodes and within.engines[0].nodes == (0,)


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_gpus=64, gpus_per_engine=8, colocate=False, num_nodes=8, gpus_per_node=8, devices_per_node=8),
     "needs 8 engine\\(s\\) on the GPUs the trainer leaves free.*--rollout-engine-urls"),
    (dict(num_gpus=12, gpus_per_engine=12, colocate=True, num_nodes=2, gpus_per_node=8, devices_per_node=8),
     "split into whole engines, or an engine take whole nodes; use a divisor or a multiple of 8"),
    (dict(num_gpus=6, gpus_per_engine=3, colocate=False, num_nodes=3, gpus_per_node=6, devices_per_node=8),
     "more than the 2 GPU\\(s\\) each node leaves free .* use a multiple of 2"),
    (dict(num_gpus=8, gpus_per_engine=4, colocate=False, num_nodes=3, gpus_per_node=6, devices_per_node=8),
     "needs 4 node\\(s\\) of 2 free GPU\\(s\\), and this run has 3"),
    (dict(num_gpus=16, gpus_per_engine=2, colocate=True, num_nodes=1, gpus_per_node=8, devices_per_node=8),
     "--colocate with --rollout-num-gpus 16: .* the trainer has 8"),
    (dict(num_gpus=6, gpus_per_engine=4, colocate=True, num_nodes=1, gpus_per_node=8, devices_per_node=8),
     "multiple of --rollout-num-gpus-per-engine 4"),
])
def test_placements_that_cannot_be_launched_are_refused_naming_the_flag(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        plan_engine_placement(**kwargs)


# -------------------------------------------------------------- command line
def test_pass_through_flags_reach_sglang_verbatim():
    assert _pass_through_args({"mem_fraction_static": "0.7", "enable_deterministic_inference": True,
                               "cuda_graph_bs": ["1", "2", "4"], "disable_radix_cache": False}) == [
        "--mem-fraction-static", "0.7", "--enable-deterministic-inference", "--cuda-graph-bs", "1", "2", "4"]


def _cfg(hf, tmp_path, *extra):
    return parse_config(["--hf-checkpoint", hf, "--prompt-data", str(tmp_path / "p.jsonl"), "--output-dir",
                         str(tmp_path / "run"), "--update-weight-transport", "disk", "--update-weight-disk-dir",
                         str(tmp_path / "w"), *extra], validate=False)


def test_command_line_and_environment_of_a_colocated_gpu_engine(tiny_hf_models, tmp_path, monkeypatch):
    from megatron_rl.rollout.sglang.launcher import _engine_env

    hf = tiny_hf_models("qwen2")
    cfg = _cfg(hf, tmp_path, "--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "2",
               "--sglang-mem-fraction-static", "0.7")
    assert cfg.rollout.rollout_backend == "sglang"  # auto: the flags configure SGLang engines
    slot = plan_engine_placement(num_gpus=4, gpus_per_engine=2, colocate=True, num_nodes=1, gpus_per_node=4,
                                 devices_per_node=4).engines[1]
    cmd = engine_command(cfg, slot, python="/py", host="127.0.0.1", port=31000, nccl_port=31001)
    assert cmd == ["/py", "-m", "sglang.launch_server", "--model-path", hf, "--host", "127.0.0.1", "--port", "31000",
                   "--nccl-port", "31001", "--tp-size", "2", "--base-gpu-id", "0", "--enable-memory-saver",
                   "--mem-fraction-static", "0.7"]
    # MoE routing replay from the rollout (R3): the engines record and return each token's experts
    moe = tiny_hf_models("qwen3_moe")
    r3 = _cfg(moe, tmp_path, "--colocate", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus-per-engine", "2",
              "--use-rollout-routing-replay")
    assert engine_command(r3, slot, python="/py", host="h", port=1, nccl_port=2)[-1] == "--enable-return-routed-experts"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    monkeypatch.setenv("RANK", "3")
    env = _engine_env(slot, sys.executable)
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7" and "RANK" not in env  # the engine's GPUs, not a torchrun rank


# ------------------------------------------------------------------ processes
def _launch_cfg(hf, tmp_path, *extra):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": [3, 4, 5], "label": "1"}) + "\n")
    return _cfg(hf, tmp_path, "--rollout-backend", "sglang", "--rollout-num-gpus", "2",
                "--rollout-engine-startup-timeout", "60", *extra)


@pytest.fixture
def double_on_path(monkeypatch, tmp_path):
    monkeypatch.setenv("PYTHONPATH", DOUBLE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    monkeypatch.setenv("MRL_SGLANG_DOUBLE_RECORD", str(tmp_path / "record"))
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path / "record"


@pytest.mark.parametrize("router", ["off", "on"])
def test_launched_engines_serve_generate_and_stop_with_their_process_groups(tiny_hf_models, tmp_path,
                                                                              double_on_path, router):
    """--rollout-router on: a real sglang-router (test extras) starts over both engines once they serve,
    generation goes through it, and it stops with them."""
    from megatron_rl.data.types import GenerateRequest, SamplingParams

    hf = tiny_hf_models("qwen2")
    cfg = _launch_cfg(hf, tmp_path, "--sglang-disable-radix-cache", "--rollout-router", router)
    fleet = launch_engines(cfg)
    try:
        urls = fleet.urls
        assert len(urls) == 2 and len(set(urls)) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
        logs = [e.log_path for e in fleet.placement.engines]
        assert logs == [str(tmp_path / "run" / "engines" / f"engine_{i}.log") for i in range(2)]
        engine = SGLangEngine.from_config(cfg, fleet.placement)
        if router == "on":
            assert fleet.placement.router_url and engine.router.base_url == fleet.placement.router_url
            assert sorted(engine.urls) == sorted(urls)  # weights and pauses still go to the engines
            head = (tmp_path / "run" / "engines" / "router.log").read_text().splitlines()[0]
            assert "sglang_router.launch_router" in head and all(u in head for u in urls)
        else:
            assert fleet.placement.router_url is None and engine.router is None
        out = engine.generate([GenerateRequest([3, 4, 5], 0), GenerateRequest([3, 4, 6], 1)],
                              SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))
        assert [len(s.response_ids) for s in out] == [3, 3]
        if router == "on":  # --use-fault-tolerance restarts a dead router on its port, ready once it lists both
            fleet.router.proc.kill()
            fleet.router.proc.wait(timeout=120)  # a hang bound on reaping the SIGKILLed router
            assert fleet.dead() == [fleet.router]
            fleet.restart(fleet.router)
            assert fleet.dead() == [] and fleet.router.restarts == 1
            again = engine.generate([GenerateRequest([3, 4, 5], 0), GenerateRequest([3, 4, 6], 1)],
                                    SamplingParams(temperature=0.0, max_new_tokens=3, ignore_eos=True))
            assert [s.response_ids for s in again] == [s.response_ids for s in out]
        engine.close()
        records = [json.loads(p.read_text()) for p in sorted(double_on_path.iterdir())]
        assert all("--disable-radix-cache" in r["argv"] and r["env"]["RANK"] is None for r in records)
        assert all(open(p).readline().startswith("$ ") for p in logs)  # the command heads each log
        pids = [p.proc.pid for p in fleet.local + ([fleet.router] if fleet.router else [])]
    finally:
        fleet.stop()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # the whole process group is gone


def test_an_engine_that_exits_at_start_up_is_named_with_its_log(tiny_hf_models, tmp_path, double_on_path,
                                                                  monkeypatch):
    monkeypatch.setenv("MRL_SGLANG_DOUBLE_FAULT", "exit")
    cfg = _launch_cfg(tiny_hf_models("qwen2"), tmp_path)
    with pytest.raises(EngineError) as exc:
        launch_engines(cfg)
    msg = str(exc.value)
    # both engines fail to load; the error names the first one found dead (which exits first is up to the OS)
    engine = 0 if "SGLang engine 0 (http://127.0.0.1:" in msg else 1
    assert f"SGLang engine {engine} (http://127.0.0.1:" in msg and "exited with code 3 while starting" in msg
    assert str(tmp_path / "run" / "engines" / f"engine_{engine}.log") in msg and "cannot load model" in msg


def test_an_engine_that_never_answers_times_out_naming_it(tiny_hf_models, tmp_path, double_on_path, monkeypatch):
    monkeypatch.setenv("MRL_SGLANG_DOUBLE_FAULT", "hang")
    cfg = _launch_cfg(tiny_hf_models("qwen2"), tmp_path, "--rollout-engine-startup-timeout", "3")
    with pytest.raises(EngineError, match="2 SGLang engine\\(s\\) did not answer /health within "
                                          "--rollout-engine-startup-timeout 3 s: SGLang engine 0"):
        launch_engines(cfg)
    pids = [json.loads(p.read_text())["pid"] for p in double_on_path.iterdir()]
    for pid in pids:  # stopped after the failure, not left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ------------------------------------------------------------------ validation
def test_validation_of_launched_engines(tiny_hf_models, tmp_path, monkeypatch):
    hf = tiny_hf_models("qwen2")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": [3, 4, 5], "label": "1"}) + "\n")
    base = ["--hf-checkpoint", hf, "--prompt-data", str(tmp_path / "p.jsonl"), "--update-weight-transport", "disk",
            "--update-weight-disk-dir", str(tmp_path / "w"), "--rollout-backend", "sglang", "--rollout-num-gpus", "1"]
    monkeypatch.setenv("PYTHONPATH", DOUBLE)
    parse_config(base)  # the interpreter finds an sglang package: accepted
    monkeypatch.delenv("PYTHONPATH")
    with pytest.raises(ConfigError) as exc:
        parse_config([*base, "--sglang-port", "30000", "--sglang-tp-size", "2", "--sglang-device", "cpu",
                      "--colocate", "--rollout-engine-python", "/no/such/python"])
    msg = str(exc.value)
    assert "--sglang-port: set by the launcher (a free port per engine) for each engine" in msg
    assert "--sglang-tp-size: set by --rollout-num-gpus-per-engine" in msg
    with pytest.raises(ConfigError, match="launches python -m sglang.launch_server with --rollout-engine-python, "
                                          "but /no/such/python could not be run"):
        parse_config([*base, "--rollout-engine-python", "/no/such/python"])
    # the dry run plans without the interpreter: nothing is started
    assert parse_config([*base, "--dry-run", "--rollout-engine-python", "/no/such/python"]).mode.dry_run


def test_stop_is_safe_twice_and_after_a_crash(tiny_hf_models, tmp_path, double_on_path):
    cfg = _launch_cfg(tiny_hf_models("qwen2"), tmp_path, "--rollout-num-gpus", "1")
    fleet = launch_engines(cfg)
    proc = fleet.local[0]
    os.killpg(proc.proc.pid, signal.SIGKILL)
    proc.proc.wait(timeout=120)  # a hang bound on reaping the SIGKILLed engine
    assert [p.slot.index for p in fleet.dead()] == [0]
    assert "was killed by signal 9" in proc.death_message("during generate")
    fleet.stop()
    fleet.stop()


# ------------------------------------------------------------------ a port taken between choice and bind
@pytest.fixture
def listener():
    """A port another process 'took' after the launcher chose it: a socket listening on it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _hand_out_taken(monkeypatch, taken: int, at: set[int]):
    """``free_port`` answers ``taken`` at the calls numbered in ``at`` (0-based), the real choice otherwise."""
    from megatron_rl.rollout.sglang import launcher

    calls = []

    def fake(host="127.0.0.1", **kw):
        calls.append(host)
        return taken if len(calls) - 1 in at else launcher_free_port(host, **kw)

    launcher_free_port = launcher.free_port
    monkeypatch.setattr(launcher, "free_port", fake)
    return calls


@pytest.mark.parametrize("router", ["off", "on"])
def test_a_port_taken_before_the_engine_binds_it_starts_it_again_on_other_ports(tiny_hf_models, tmp_path,
                                                                                double_on_path, monkeypatch,
                                                                                listener, router, caplog):
    """Engine 0's HTTP port (call 0), or the router's (call 4, after two engines' two ports), is held by
    another process: that start dies with 'Address already in use' and is made again on fresh ports."""
    calls = _hand_out_taken(monkeypatch, listener, {0} if router == "off" else {4})
    cfg = _launch_cfg(tiny_hf_models("qwen2"), tmp_path, "--rollout-router", router)
    with caplog.at_level("WARNING", logger="megatron_rl.rollout.sglang.launcher"):
        fleet = launch_engines(cfg)
    try:
        assert all(f":{listener}" not in u for u in fleet.urls + [fleet.placement.router_url or ""])
        assert any("was taken before it bound it (attempt 1 of 3)" in r.getMessage() for r in caplog.records)
        name = "engine_0.log" if router == "off" else "router.log"
        text = (tmp_path / "run" / "engines" / name).read_text()
        assert text.count("\n$ ") + text.startswith("$ ") == 2  # the log keeps the failed start and the good one
        assert "address already in use" in text.lower()
        if router == "off":  # all engines start again: 2 x 2 ports, twice
            assert len(calls) == 8
        else:  # only the router starts again
            assert len(calls) == 8 and fleet.placement.router_url
        engine = SGLangEngine.from_config(cfg, fleet.placement)
        from megatron_rl.data.types import GenerateRequest, SamplingParams

        out = engine.generate([GenerateRequest([3, 4, 5], 0)], SamplingParams(temperature=0.0, max_new_tokens=2,
                                                                             ignore_eos=True))
        assert len(out[0].response_ids) == 2
        engine.close()
    finally:
        fleet.stop()


def test_a_port_taken_at_every_try_is_an_error_naming_the_port(tiny_hf_models, tmp_path, double_on_path,
                                                                monkeypatch, listener):
    _hand_out_taken(monkeypatch, listener, set(range(100)))
    cfg = _launch_cfg(tiny_hf_models("qwen2"), tmp_path, "--rollout-num-gpus", "1")
    with pytest.raises(EngineError) as exc:
        launch_engines(cfg)
    msg = str(exc.value)
    assert f"SGLang engine 0 (http://127.0.0.1:{listener}" in msg and "address already in use" in msg.lower()
    log = (tmp_path / "run" / "engines" / "engine_0.log").read_text()
    assert log.count("\n$ ") + log.startswith("$ ") == 3  # PORT_ATTEMPTS starts, each logged


def test_the_log_tail_is_the_latest_starts_own(tmp_path):
    """A restarted engine's error quotes its own lines, not the port the start before it found taken."""
    from megatron_rl.plan.engines import EngineSlot
    from megatron_rl.rollout.sglang.launcher import EngineProcess

    log = tmp_path / "engine_0.log"
    slot = EngineSlot(0, "http://127.0.0.1:1", 0, (), (0,), str(log))
    first = EngineProcess(slot, [sys.executable, "-c", "print('OSError: [Errno 98] Address already in use')"],
                          dict(os.environ), str(log))
    first.start()
    first.proc.wait(timeout=120)  # a hang bound: one python start
    assert "Address already in use" in first.log_tail()
    first.cmd = [sys.executable, "-c", "print('cannot load model'); raise SystemExit(3)"]
    first.start()
    first.proc.wait(timeout=120)  # a hang bound: one python start
    tail = first.death_message("while starting")
    assert "exited with code 3" in tail and "cannot load model" in tail and "Address already in use" not in tail
    assert "Address already in use" in log.read_text()  # the log itself keeps both starts

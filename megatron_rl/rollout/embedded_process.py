"""``--embedded-engine-ranks process``: the driver starts the embedded engine server and speaks SGLang to it.

The server (``rollout.embedded_server``) runs as ``python -m megatron_rl.rollout.embedded_server``
in its own process group, on 127.0.0.1 and a free port, its output in
``<--output-dir>/engines/embedded_engine.log``; it dies with the driver (``PR_SET_PDEATHSIG``, the
SGLang launcher's ``EngineProcess``). The driver waits for ``GET /health`` within
``--rollout-engine-startup-timeout``; a server that exits or does not answer in time is an
``EngineError`` naming the log and its last lines. The engine the loop sees is an
``SGLangEngine`` over that one URL (``ServedEmbeddedEngine``): generation, the disk weight sync,
pause / continue / abort and version checks go through the code SGLang servers get, and
``close()`` stops the process.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any, Iterable

import httpx

from megatron_rl.errors import EngineError
from megatron_rl.infra.ports import free_port
from megatron_rl.rollout.base import load_tokenizer
from megatron_rl.rollout.routes import RouteLayout
from megatron_rl.rollout.sglang.engine import SGLangEngine
from megatron_rl.rollout.sglang.launcher import EngineProcess

if TYPE_CHECKING:
    from megatron_rl.config.schema import Config

PORT_ATTEMPTS = 3  # starts when another process took the free port first


class ServerSlot:
    """Where the server listens, as ``EngineProcess`` needs it (a URL and a name for messages)."""

    def __init__(self, url: str):
        self.url = url

    def describe(self) -> str:
        return f"the embedded engine server at {self.url}"


class ServedEmbeddedEngine(SGLangEngine):
    """The SGLang client over the one embedded engine server this run started; closing it stops the server."""

    def __init__(self, process: EngineProcess, **kwargs: Any):
        super().__init__([process.url], server_notes={process.url: f"log {process.log_path}"}, **kwargs)
        self.process = process

    def close(self) -> None:
        try:
            super().close()
        finally:
            self.process.stop(grace_s=10.0)

    def reports_weight_checksums(self) -> bool:
        """Our own server answers each tensor's checksum (``/weights_checker`` ``tensor_checksums``), so the
        trainer's post-apply check (--update-weight-verify) runs against it as against the in-process engine."""
        return True

    def weight_checksums(self, names: Iterable[str], algorithm: str) -> dict[str, str]:
        client = self.clients[0]
        reply = client.request("POST", "/weights_checker", {"action": "tensor_checksums", "names": list(names),
                                                            "algorithm": algorithm}, timeout_s=self.update_timeout_s,
                               context="the post-apply check's checksums (--update-weight-verify)").json()
        checksums = reply.get("checksums") if isinstance(reply, dict) else None
        if not isinstance(checksums, dict):
            raise EngineError(f"{client.label} answered /weights_checker tensor_checksums without checksums: "
                              f"{str(reply)[:200]}")
        return {str(k): str(v) for k, v in checksums.items()}


def server_command(model: str, port: int, python: str = sys.executable, routes: bool = False,
                   deterministic: bool = False) -> list[str]:
    return ([python, "-m", "megatron_rl.rollout.embedded_server", "--model", model, "--host", "127.0.0.1",
             "--port", str(port)] + (["--enable-return-routed-experts"] if routes else [])
            + (["--enable-deterministic-inference"] if deterministic else []))


def start_server(model: str, log_path: str, timeout_s: float, routes: bool = False,
                 deterministic: bool = False) -> EngineProcess:
    """Start the server and wait until it answers ``/health``; ``EngineError`` naming its log otherwise."""
    env = dict(os.environ)
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # the server is not a rank of the training job
    last = ""
    for _attempt in range(PORT_ATTEMPTS):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        process: EngineProcess = EngineProcess(ServerSlot(url), server_command(model, port, routes=routes,
                                                                              deterministic=deterministic), env,
                                               log_path)
        process.start()
        deadline = time.monotonic() + timeout_s
        with httpx.Client() as client:
            while process.alive() and time.monotonic() < deadline:
                try:
                    if client.get(url + "/health", timeout=5.0).status_code == 200:
                        return process
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        if process.alive():
            process.stop(grace_s=5.0)
            raise EngineError(f"the embedded engine server did not answer {url}/health within {timeout_s:g} s "
                              f"(--rollout-engine-startup-timeout). Last lines of {log_path}:\n"
                              + process.log_tail(12))
        last = process.death_message("while starting", lines=12)
        if "Address already in use" not in last:
            break
    raise EngineError(last)


def start_embedded_engine(cfg: "Config") -> ServedEmbeddedEngine:
    """The loop's engine for ``--embedded-engine-ranks process``: the server started, the client over it."""
    model = cfg.model.hf_checkpoint
    assert model is not None, "validation requires --hf-checkpoint with the embedded engine"
    log_path = os.path.join(cfg.runtime.output_dir, "engines", "embedded_engine.log")
    routes = cfg.megatron.use_rollout_routing_replay
    process = start_server(model, log_path, cfg.rollout.rollout_engine_startup_timeout, routes=routes,
                           deterministic=cfg.algorithm.true_on_policy_mode)
    try:
        return ServedEmbeddedEngine(process, weight_dir=cfg.sync.update_weight_disk_dir, hf_checkpoint=model,
                                    tokenizer=load_tokenizer(model), releases_memory=False,
                                    check_first_update=cfg.sync.check_weight_update_equal,
                                    pause_mode=cfg.rollout.pause_generation_mode,
                                    generate_timeout_s=cfg.rollout.rollout_generate_timeout,
                                    update_timeout_s=cfg.rollout.rollout_update_timeout,
                                    route_layout=RouteLayout.of_checkpoint(model) if routes else None)
    except BaseException:
        process.stop(grace_s=5.0)
        raise

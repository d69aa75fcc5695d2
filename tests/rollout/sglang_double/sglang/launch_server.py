"""``python -m sglang.launch_server`` as the launcher calls it, serving the protocol stand-in (CPU test stand-in).

Takes SGLang's command line: ``--model-path``, ``--host``, ``--port`` are used; every other
``--flag [value ...]`` is accepted and recorded. Writes ``{"argv": [...], "env": {...}}`` to
``$MRL_SGLANG_DOUBLE_RECORD/<port>-<pid>.json`` when that is set, so a test can check what the
launcher passed. ``MRL_SGLANG_DOUBLE_FAULT``: ``exit`` prints an error and exits 3 before serving (a
model that does not load); ``hang`` never listens (an engine stuck at start-up); ``die-after-generate:N``
makes the first engine to claim ``$MRL_SGLANG_DOUBLE_RECORD/died`` serve N ``/generate`` calls and
die (``os._exit(9)``) on the next one before answering: an engine crashing mid-rollout, once per run;
``die-on-first-generate`` makes the first engine to RECEIVE a ``/generate`` call (the claim is made
then, not at start) die on it: deterministic whatever spreads the requests (an sglang-router's
cache-aware policy may send every request to one engine). Serves until SIGTERM.

An engine spanning nodes (``--nnodes K --node-rank J --dist-init-addr HOST:PORT``), as SGLang 0.5.23
runs one: its processes meet at ``--dist-init-addr`` through torch's TCP store (the head, node
rank 0, hosts it; each waits for all K), then the head serves the protocol with ``--tp-size``
TP ranks and the others only ``/health`` on their own ``--port`` (SGLang's
``launch_dummy_health_check_server``), ignoring SIGTERM as SGLang's non-zero ranks do: they
exit when the head is gone (SGLang: the head's shutdown broadcast).
"""

import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _arg(argv: list, name: str, default=None):
    return argv[argv.index(name) + 1] if name in argv else default


def _claim(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def _die_on_first_generate(server, claim_path: str) -> None:
    generate = server.generate

    def dying_generate(body):
        if _claim(claim_path):
            print("test double: dying on the run's first /generate call", flush=True)
            os._exit(9)
        return generate(body)

    server.generate = dying_generate


def _die_after(server, served: int) -> None:
    """Serve ``served`` /generate calls, die on the next. The count, the line and the exit happen under one lock:
    concurrent requests (the async driver's) would otherwise both count before either printed, and the line
    would name call 7, or a second thread's exit would cut the first's line off."""
    import threading

    generate, calls, lock = server.generate, [0], threading.Lock()

    def dying_generate(body):
        with lock:
            calls[0] += 1
            if calls[0] > served:
                print(f"test double: dying on /generate call {calls[0]}", flush=True)
                os._exit(9)
        return generate(body)

    server.generate = dying_generate


def _rendezvous(argv: list, nnodes: int, node_rank: int):
    """The engine's processes meet where SGLang's do: torch's TCP store at ``--dist-init-addr``."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    addr = _arg(argv, "--dist-init-addr")
    if not addr:
        print("ValueError: --nnodes > 1 needs --dist-init-addr (test double)", flush=True)
        sys.exit(3)
    host, port = addr.rsplit(":", 1)
    store = TCPStore(host, int(port), nnodes, is_master=node_rank == 0, timeout=timedelta(seconds=300),
                     wait_for_workers=True)
    store.set(f"node{node_rank}", "ready")
    for j in range(nnodes):
        store.get(f"node{j}")  # every part is up before any serves
    print(f"test double: node rank {node_rank} of {nnodes} met the others at {addr}", flush=True)
    return store


def _follow(store, host: str, port: int, node_rank: int) -> int:
    """A non-head part: ``/health`` only, SIGTERM ignored, gone when the head's store is."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the stdlib's name
            code = 200 if self.path in ("/health", "/health_generate") else 404
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer((host, port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: print(f"SIGTERM received on node_rank {node_rank}; waiting for the "
                                                   "head to stop", flush=True))
    print(f"The follower (node rank {node_rank}) serves /health on {host}:{port}", flush=True)
    while True:
        time.sleep(0.5)
        try:
            store.check(["node0"])
        except Exception:  # noqa: BLE001 - the head's store is gone: the engine stopped
            print(f"test double: node rank {node_rank}: the head is gone, exiting", flush=True)
            return 0


def _port_taken(host: str, port: int):
    """The bind error of ``host:port`` if another process holds it now (the stand-in would hit it when it binds,
    after loading torch and the model: seconds a failing start need not spend), else None."""
    import socket

    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as e:
            return str(e)
    return None


def main() -> int:
    argv = sys.argv[1:]
    model, port = _arg(argv, "--model-path"), int(_arg(argv, "--port", "30000"))
    record = os.environ.get("MRL_SGLANG_DOUBLE_RECORD")
    if record:
        os.makedirs(record, exist_ok=True)
        keep = ("CUDA_VISIBLE_DEVICES", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        with open(os.path.join(record, f"{port}-{os.getpid()}.json"), "w") as fh:
            json.dump({"argv": argv, "env": {k: os.environ.get(k) for k in keep}, "pid": os.getpid()}, fh)
    fault = os.environ.get("MRL_SGLANG_DOUBLE_FAULT", "")
    if fault == "exit":
        print(f"RuntimeError: cannot load model from {model} (test double fault)", flush=True)
        return 3
    if fault == "hang":
        while True:
            time.sleep(1)
    nnodes, node_rank = int(_arg(argv, "--nnodes", "1")), int(_arg(argv, "--node-rank", "0"))
    store = _rendezvous(argv, nnodes, node_rank) if nnodes > 1 else None
    if node_rank > 0:
        return _follow(store, _arg(argv, "--host", "127.0.0.1"), port, node_rank)
    taken = _port_taken(_arg(argv, "--host", "127.0.0.1"), port)
    if taken:  # SGLang's own failure (its HTTP server binds last), without loading the model first
        print(f"OSError: {taken} (test double: --port {port} was taken before the server could bind it)", flush=True)
        return 1
    from sglang_standin import SGLangStandIn  # tests/rollout (on sys.path above); loads torch: after the faults

    server = SGLangStandIn(model, port=port, tp_size=int(_arg(argv, "--tp-size", "1")))
    if fault.startswith("die-after-generate:") and _claim(os.path.join(record or ".", "died")):
        _die_after(server, int(fault.split(":", 1)[1]))
    if fault == "die-on-first-generate":
        _die_on_first_generate(server, os.path.join(record or ".", "died"))
    server.start()
    print(f"The server is fired up and ready to roll! {server.url}", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop and server.alive:
            time.sleep(0.1)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SGLang's replies to one fixed list of requests, recorded as SHAPES, so the CI stand-in is held to real SGLang.

CI talks to ``tests/rollout/sglang_standin.py``, not to SGLang; a client test that passes there proves
only that the client and the stand-in agree. This module sends the same fixed list of requests
(``record``: every endpoint ``megatron_rl``'s SGLang client, engine and weight transports call, with
success and error statuses) to a server and keeps, per request, the HTTP status, the reply's shape
(``shape``: keys and value types, recursively; a list by its elements' shapes) and its message as
text. Run once against real SGLang 0.5.23 on CPU (``bash scripts/test_sglang_real.sh
--record-replies``), the result is the committed fixture ``tests/rollout/fixtures/sglang_0.5.23_replies.json``;
``tests/rollout/test_standin_replies.py`` runs the same ``record`` against the stand-in and ``compare``
must find nothing.

Requests real SGLang cannot serve on CPU, or that need a second server or a request held in flight,
are not in the list; ``NOT_RECORDED`` says why and where they are checked instead (it is written into
the fixture).

    python tools/sglang_cpu/record_replies.py --sglang-python /work/sglang-venv/bin/python   # refresh the fixture
    python tools/sglang_cpu/record_replies.py --url http://127.0.0.1:30000 --model DIR --out x.json  # any server
    python tools/sglang_cpu/record_replies.py --standin --model DIR     # the stand-in, compared with the fixture
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from megatron_rl.data.types import SamplingParams  # noqa: E402 - after the repo is on sys.path
from megatron_rl.rollout.sglang import SGLangClient, protocol  # noqa: E402

FIXTURE = REPO / "tests" / "rollout" / "fixtures" / "sglang_0.5.23_replies.json"

# The /server_info keys megatron_rl reads (weight_sync/distributed.py, weight_sync/sglang_tensor.py,
# rollout/sglang/engine.py); real SGLang sends several hundred, the stand-in only these.
SERVER_INFO_KEYS = ("tp_size", "dp_size", "pp_size", "device", "version", "enable_deterministic_inference")

# The tensor every weight request carries: present in every Qwen2 checkpoint, sent with its own values
# (so the server's generations do not change under the later requests).
TENSOR = "model.norm.weight"
GROUP = "megatron_rl_record_replies"

NOT_RECORDED = {
    "POST /release_memory_occupation, POST /resume_memory_occupation":
        "SGLang 0.5.23 calls CUDA synchronize there: on CPU the scheduler dies and the server goes down "
        "(docs/sglang-cpu.md); a GPU run of scripts/test_sglang_real.sh is where they get checked",
    "POST /flush_cache with requests running (400 \"Flush cache failed.\"), a /generate row aborted by "
    "/abort_request or /pause_generation (finish_reason abort)":
        "they need a request held in flight, which a fixed list cannot time without sleeping; "
        "tools/sglang_cpu/check_real_sglang.py (abort_flush_pause) records both and compares the stand-in",
    "POST /generate answered 503":
        "needs a second server with --max-running-requests 1 and SGLANG_REQ_WAITING_TIMEOUT; "
        "check_real_sglang.py (unavailable_503) records and compares it",
    "POST /weights_checker compare":
        "SGLang 0.5.23 moves the compared chunks to CUDA (utils/weight_checker_comparator.py): it cannot run "
        "on CPU (check_real_sglang.py weights_check checks the error says so); snapshot is recorded",
    "POST /update_weights_from_tensor with a payload that cannot be opened":
        "SGLang raises in its scheduler and the server goes down; the stand-in answers 400 on purpose "
        "(its docstring lists this difference)",
    "GET /get_weights_by_name":
        "not called by megatron_rl (the Qwen2 model class lacks it in 0.5.23)",
    "POST /load_lora_adapter, POST /load_lora_adapter_from_tensors, POST /unload_lora_adapter, /generate with "
    "lora_path":
        "need a server started with --enable-lora; tools/sglang_cpu/check_lora_real.py "
        "(scripts/test_sglang_real.sh --lora) sends them to real SGLang and checks the stand-in's words",
}

# How each error (or fixed) message is compared between the fixture and another server:
# "exact": the same text; a tuple: the key facts both must carry (what a client or a person parses);
# absent: not compared (its text names a path, a value or a Python repr that differs by server).
MESSAGE_RULES: dict[str, Any] = {
    "get_weight_version_gone": "exact",  # FastAPI's 404: the route is gone, no hint (recorded 2026-12-03)
    "workers_on_a_server": "exact",
    "unknown_route": "exact",
    "generate_invalid_top_p": "exact",
    "generate_invalid_temperature": "exact",
    "update_weights_from_tensor_not_base64": ("serialized_named_tensors", "Expected base64-encoded bytes"),
    "update_weights_from_tensor_outside_session": ("begin_weight_update", "end_weight_update"),
    "update_weights_from_distributed_outside_session": ("begin_weight_update", "end_weight_update"),
    "end_weight_update_no_session": ("begin_weight_update",),
    "begin_weight_update": "exact",
    "begin_weight_update_twice": ("already open",),  # the client's open_weight_update parses these words
    "update_weights_from_tensor": "exact",
    "end_weight_update": "exact",
    "update_weights_from_disk_missing": ("Failed to get weights iterator",),
    "update_weights_from_disk": "exact",
    "update_weight_version": "exact",
    "update_weight_version_missing_field": ("new_version", "Field required"),
    "pause_generation": "exact",
    "continue_generation": "exact",
    "flush_cache_idle": "exact",
    "weights_checker_snapshot": "exact",
    "init_weights_update_group": "exact",
    "update_weights_from_distributed": "exact",
    "destroy_weights_update_group": "exact",
    "destroy_weights_update_group_missing": "exact",  # "The group to be destroyed does not exist."
}


def shape(value: Any) -> Any:
    """The type structure of a JSON value: a dict's keys with their values' shapes, a list as the
    distinct shapes of its elements (in order of first appearance), a scalar as its type's name."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        out: list = []
        for v in value:
            s = shape(v)
            if s not in out:
                out.append(s)
        return out
    if value is None:
        return "null"
    return type(value).__name__  # bool, int, float, str


def _reply(resp) -> dict:
    """Status, shape and message of one HTTP reply (a body that is not JSON is ``"<text>"`` or ``"<empty>"``)."""
    content = resp.content
    try:
        body = json.loads(content) if content else None
        kind = "json" if content else "empty"
    except (ValueError, UnicodeDecodeError):
        body, kind = resp.text, "text"
    if kind == "json":
        body_shape = shape(body)
    else:
        body_shape = "<empty>" if kind == "empty" else "<text>"
    if resp.status_code >= 400:
        message = protocol.error_message(resp.status_code, content)
    elif kind == "text":
        message = body
    elif isinstance(body, dict) and isinstance(body.get("message"), str):
        message = body["message"]
    else:
        message = None
    return {"status": resp.status_code, "shape": body_shape, "message": message}


class _Recorder:
    """Sends requests through ``SGLangClient.request`` (every status accepted) and keeps their replies."""

    def __init__(self, url: str, timeout_s: float):
        self.client = SGLangClient(url, timeout_s=timeout_s, connect_retries=0)
        self.records: dict[str, dict] = {}

    def send(self, name: str, method: str, path: str, payload: Any = None, *, note: str,
             keep_keys: Optional[tuple] = None) -> dict:
        if name in self.records:
            raise ValueError(f"request {name!r} recorded twice")
        resp = self.client.request(method, path, payload, ok_statuses=range(100, 600))
        if keep_keys is not None and resp.status_code == 200:  # /server_info: only what the client reads
            body = resp.json()
            rec = {"status": 200, "shape": shape({k: body[k] for k in keep_keys if k in body}), "message": None}
        else:
            rec = _reply(resp)
        self.records[name] = {"request": f"{method} {path}", "note": note, **rec}
        return rec

    def send_in_thread(self, name: str, method: str, path: str, payload: Any, *, note: str) -> Callable[[], dict]:
        """Start ``send`` in a thread (a distributed call waits on the broadcast we make); return its join."""
        box: dict = {}

        def run():
            try:
                box["rec"] = self.send(name, method, path, payload, note=note)
            except BaseException as exc:  # noqa: BLE001 - raised in the caller's join
                box["error"] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()

        def join() -> dict:
            thread.join(self.client.timeout_s + 5)
            if thread.is_alive():
                raise TimeoutError(f"{method} {path} to {self.client.base_url}: no reply within "
                                   f"{self.client.timeout_s + 5:g} s")
            if "error" in box:
                raise box["error"]
            return box["rec"]

        return join


def _norm_weight(model_dir: str):
    import torch
    from safetensors import safe_open

    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            if TENSOR in st.keys():
                return st.get_tensor(TENSOR).to(torch.float32).contiguous()
    raise FileNotFoundError(f"{TENSOR} is in no safetensors file of {model_dir}")


def record(url: str, model_dir: str, *, timeout_s: float = 120.0) -> dict[str, dict]:
    """Send the fixed list of requests to the server at ``url`` (serving ``model_dir``, freshly started:
    weight version "default") and return ``{name: {request, note, status, shape, message}}`` in order.

    The list is the same for every server: nothing branches on a reply, so two servers are compared
    request by request. It leaves the server serving ``model_dir``'s weights, at weight version "4",
    not paused, with no weights-update group and no open update session."""
    from megatron_rl.weight_sync.update_group import UpdateGroup

    r = _Recorder(url, timeout_s)
    norm = _norm_weight(model_dir)
    prompt = [3, 4, 5, 6]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)
    try:
        # liveness and what the client reads about the server
        r.send("health", "GET", "/health", note="SGLangClient.health: 200, no body")
        r.send("health_generate", "GET", "/health_generate", note="SGLangClient.health_generate")
        r.send("model_info", "GET", "/model_info", note="weight_version 'default' before any versioned update")
        r.send("server_info", "GET", "/server_info", keep_keys=SERVER_INFO_KEYS,
               note=f"only the keys megatron_rl reads: {', '.join(SERVER_INFO_KEYS)}")
        r.send("get_server_info", "GET", "/get_server_info", keep_keys=SERVER_INFO_KEYS,
               note="the client's fallback for servers older than /server_info (0.5.23 still answers it)")
        r.send("get_weight_version_gone", "GET", "/get_weight_version",
               note="gone since 0.5.21: the client reads /model_info instead")
        r.send("workers_on_a_server", "GET", "/workers",
               note="SGLangClient.router_workers: a plain server answers 404 (an sglang-router lists workers)")
        r.send("unknown_route", "POST", "/no_such_route", {}, note="FastAPI's 404")
        # generation, as the engine sends it (a batch, per-row params with seeds and rids) and as through a router
        rows = [protocol.sampling_params_dict(greedy, seed=protocol.row_seed(7, 0, j)) for j in range(2)]
        r.send("generate_batch", "POST", "/generate",
               protocol.generate_payload([prompt, prompt[:3]], rows, rids=["rec-0-0", "rec-0-1"]),
               note="SGLangClient.generate: a batch of 2 rows, per-row sampling_params (sampling_seed) and rids")
        r.send("generate_one", "POST", "/generate",
               protocol.single_generate_payload(prompt, protocol.sampling_params_dict(greedy), rid="rec-1-0"),
               note="SGLangClient.generate_one (router mode): one row, one sampling_params map")
        r.send("generate_invalid_top_p", "POST", "/generate",
               {"input_ids": prompt, "sampling_params": {"temperature": 0.0, "top_p": 2.0, "max_new_tokens": 2}},
               note="SamplingParams.verify refuses it: 400 with the reason")
        r.send("generate_invalid_temperature", "POST", "/generate",
               {"input_ids": prompt, "sampling_params": {"temperature": -1.0, "max_new_tokens": 2}},
               note="SamplingParams.verify refuses it: 400 with the reason")
        # the update session (0.5.21+): tensor and distributed updates only inside begin/end
        shapes = [list(norm.shape)]
        r.send("update_weights_from_tensor_not_base64", "POST", "/update_weights_from_tensor",
               {"serialized_named_tensors": ["x"], "load_format": None, "flush_cache": True},
               note="request validation decodes every entry first (before the session check)")
        entry, buffers = protocol.serialize_named_tensors([(TENSOR, norm)])
        try:
            r.send("update_weights_from_tensor_outside_session", "POST", "/update_weights_from_tensor",
                   {"serialized_named_tensors": [entry], "load_format": None, "flush_cache": True,
                    "weight_version": "1"}, note="a valid payload, refused: no session open")
            r.send("update_weights_from_distributed_outside_session", "POST", "/update_weights_from_distributed",
                   {"names": [TENSOR], "dtypes": ["float32"], "shapes": shapes, "group_name": GROUP,
                    "flush_cache": True}, note="refused before any group is looked up")
            r.send("end_weight_update_no_session", "POST", "/end_weight_update", {}, note="no session open")
            r.send("begin_weight_update", "POST", "/begin_weight_update", {}, note="opens the session")
            r.send("begin_weight_update_twice", "POST", "/begin_weight_update", {},
                   note="SGLangClient.open_weight_update reads 'already open' and closes the stale session")
            r.send("update_weights_from_tensor", "POST", "/update_weights_from_tensor",
                   {"serialized_named_tensors": [entry], "load_format": None, "flush_cache": True,
                    "weight_version": "1"}, note=f"{TENSOR} with its own values, file_system sharing, version 1")
        finally:
            del buffers
        r.send("end_weight_update", "POST", "/end_weight_update", {}, note="closes the session")
        # the disk route (exempt from the session)
        r.send("update_weights_from_disk_missing", "POST", "/update_weights_from_disk",
               {"model_path": "/nonexistent/megatron_rl_record_replies", "abort_all_requests": False,
                "flush_cache": True, "weight_version": "99"},
               note="a path the server cannot see (it then tries the hub): 400, the version unchanged")
        r.send("update_weights_from_disk", "POST", "/update_weights_from_disk",
               {"model_path": str(model_dir), "abort_all_requests": False, "flush_cache": False,
                "weight_version": "2"}, note="the served checkpoint itself, version 2 (the disk transport's call)")
        r.send("flush_cache_idle", "POST", "/flush_cache", note="idle server: 200, plain text")
        r.send("update_weight_version", "POST", "/update_weight_version",
               {"new_version": "3", "abort_all_requests": False}, note="SGLangClient.update_weight_version")
        r.send("update_weight_version_missing_field", "POST", "/update_weight_version", {},
               note="request validation: new_version is required")
        r.send("model_info_after_updates", "GET", "/model_info",
               note="weight_version '3'; model_path follows the disk load")
        r.send("generate_after_updates", "POST", "/generate",
               protocol.generate_payload([prompt], rows[:1], rids=["rec-2-0"]),
               note="rows carry weight_version '3' (and weight_versions spans)")
        # control
        r.send("pause_generation", "POST", "/pause_generation", {"mode": "abort"},
               note="the weight sync's pause (abort mode: nothing is running here)")
        r.send("continue_generation", "POST", "/continue_generation", {}, note="the weight sync's continue")
        r.send("abort_request_rid", "POST", "/abort_request", {"rid": "rec-none", "abort_all": False},
               note="an unknown rid: 200, nothing to abort")
        r.send("abort_request_all", "POST", "/abort_request", {"rid": "", "abort_all": True},
               note="SGLangEngine.abort")
        r.send("weights_checker_snapshot", "POST", "/weights_checker", {"action": "snapshot"},
               note="--check-weight-update-equal's first step (compare needs CUDA: not recorded)")
        # the distributed route: this process is rank 0 of a gloo group the server joins (as the transport does)
        group = UpdateGroup(group_name=GROUP, world_size=2, backend="gloo", master_address="127.0.0.1",
                            timeout_s=timeout_s)
        try:
            port = group.open_store()
            joined = r.send_in_thread("init_weights_update_group", "POST", "/init_weights_update_group", {
                "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
                "group_name": GROUP, "backend": "gloo"}, note="the server joins our gloo group as rank 1")
            group.connect()
            if joined()["status"] == 200:
                r.send("begin_weight_update_for_distributed", "POST", "/begin_weight_update", {},
                       note="the session around the distributed update")
                updated = r.send_in_thread("update_weights_from_distributed", "POST",
                                           "/update_weights_from_distributed", {
                                               "names": [TENSOR], "dtypes": ["float32"], "shapes": shapes,
                                               "group_name": GROUP, "flush_cache": True, "weight_version": "4"},
                                           note=f"{TENSOR} broadcast from rank 0 (one broadcast per name), version 4")
                group.broadcast(norm).wait()
                updated()
                r.send("end_weight_update_for_distributed", "POST", "/end_weight_update", {},
                       note="closes the session")
                r.send("destroy_weights_update_group", "POST", "/destroy_weights_update_group",
                       {"group_name": GROUP}, note="DistributedSynchronizer.shutdown")
        finally:
            group.close()
        r.send("destroy_weights_update_group_missing", "POST", "/destroy_weights_update_group",
               {"group_name": GROUP}, note="a second destroy: the group is gone")
        r.send("model_info_at_end", "GET", "/model_info", note="weight_version '4' after the distributed update")
    finally:
        r.client.close()
    return r.records


def compare(want: dict[str, dict], got: dict[str, dict]) -> list[str]:
    """Every difference of ``got`` from the recorded ``want``: the same requests, statuses and shapes,
    and the messages by ``MESSAGE_RULES`` (exact, or the key facts, which must hold in ``want`` too)."""
    problems = []
    if list(want) != list(got):
        problems.append(f"requests differ: only recorded {sorted(set(want) - set(got))}, "
                        f"only sent now {sorted(set(got) - set(want))}")
    for name in [n for n in want if n in got]:
        w, g = want[name], got[name]
        if w["status"] != g["status"]:
            problems.append(f"{name} ({w['request']}): status {g['status']}, recorded {w['status']} "
                            f"(message {g['message']!r}, recorded {w['message']!r})")
            continue
        if w["shape"] != g["shape"]:
            problems.append(f"{name} ({w['request']}): shape {json.dumps(g['shape'])}, recorded "
                            f"{json.dumps(w['shape'])}")
        rule = MESSAGE_RULES.get(name)
        if rule == "exact" and w["message"] != g["message"]:
            problems.append(f"{name}: message {g['message']!r}, recorded {w['message']!r}")
        elif isinstance(rule, tuple):
            for fact in rule:
                if fact not in (w["message"] or ""):
                    problems.append(f"{name}: the recorded message {w['message']!r} lacks {fact!r} (update "
                                    "MESSAGE_RULES and whoever parses it)")
                elif fact not in (g["message"] or ""):
                    problems.append(f"{name}: message {g['message']!r} lacks {fact!r} (recorded {w['message']!r})")
    return problems


def load_fixture(path: Path = FIXTURE) -> dict:
    return json.loads(Path(path).read_text())


def _sglang_version(python: str) -> str:
    out = subprocess.run([python, "-c", "from importlib.metadata import version; print(version('sglang'))"],
                         capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or f"unknown ({out.stderr.strip()[-200:]})"


def _record_real(args: argparse.Namespace) -> int:
    """Start real SGLang (check_real_sglang.py's server and model), record, write the fixture."""
    from check_real_sglang import SERVER_ARGS, CheckFailed, SGLangServer, build_model, wait_healthy

    from megatron_rl.infra.ports import free_port

    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    say = lambda msg: print(f"[record-replies] {msg}", flush=True)  # noqa: E731
    model = build_model(work, 0)
    extra = ["--disable-radix-cache"]
    server = SGLangServer(args.sglang_python, model, work / "server.log", port=free_port(), extra_args=extra)
    t0 = time.monotonic()
    say(f"starting SGLang ({args.sglang_python}) on {server.url}, log {server.log_path}")
    server.start()
    try:
        try:
            startup = wait_healthy(server, args.startup_timeout_s, say)
        except CheckFailed as exc:
            say(f"error: {exc}")
            return 2
        say(f"healthy after {startup:.0f} s; sending the fixed requests")
        t = time.monotonic()
        records = record(server.url, str(model), timeout_s=args.timeout_s)
        took = time.monotonic() - t
        alive = server.alive()
    finally:
        server.stop()
    if not alive:
        say(f"error: the server died during the requests; log tail:\n{server.log_tail()}")
        return 1
    fixture = {
        "what": "real SGLang's replies to tools/sglang_cpu/record_replies.py's fixed requests, as shapes "
                "(tests/rollout/test_standin_replies.py holds the CI stand-in to them)",
        "sglang_version": _sglang_version(args.sglang_python),
        "recorded_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "bash scripts/test_sglang_real.sh --record-replies  (= " + " ".join(
            shlex.quote(a) for a in [sys.executable, *sys.argv]) + ")",
        "server": {"model": "tiny random-weight Qwen2 of check_real_sglang.build_model (2 layers, hidden 64, "
                            "vocab 32, the digit tokenizer)",
                   "args": [*SERVER_ARGS, *extra], "env": {"SGLANG_USE_CPU_ENGINE": "1"},
                   "startup_s": round(startup, 1), "requests_s": round(took, 1),
                   "total_s": round(time.monotonic() - t0, 1)},
        "shape_rule": "a dict: its keys with their values' shapes; a list: the distinct shapes of its elements; "
                      "a scalar: bool/int/float/str/null; a body that is not JSON: <text> or <empty>; message: "
                      "the error's text (protocol.error_message) or a success reply's message",
        "not_recorded": NOT_RECORDED,
        "replies": records,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(fixture, indent=1) + "\n")
    say(f"{len(records)} replies recorded in {took:.1f} s (server start {startup:.0f} s) -> {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--sglang-python", default=os.environ.get("SGLANG_PYTHON", "/work/sglang-venv/bin/python"),
                    help="start real SGLang from this venv's python and write the fixture (the default mode)")
    ap.add_argument("--url", help="record a server already running at URL instead (needs --model, --out)")
    ap.add_argument("--standin", action="store_true",
                    help="record the CI stand-in on --model and print its differences from the fixture")
    ap.add_argument("--model", help="the checkpoint the server at --url (or the stand-in) serves")
    ap.add_argument("--out", default=str(FIXTURE), help="where to write the replies (default: the fixture)")
    ap.add_argument("--work", default="/tmp/sglang_record_replies", help="model dir and server log (real mode)")
    ap.add_argument("--startup-timeout-s", type=float, default=240.0)
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per request")
    args = ap.parse_args(argv)
    if args.standin:
        if not args.model:
            ap.error("--standin needs --model")
        sys.path.insert(0, str(REPO / "tests" / "rollout"))
        from sglang_standin import SGLangStandIn

        with SGLangStandIn(args.model) as standin:
            got = record(standin.url, args.model, timeout_s=args.timeout_s)
        problems = compare(load_fixture()["replies"], got)
        print("\n".join(problems) or f"the stand-in answers all {len(got)} requests as recorded")
        return 1 if problems else 0
    if args.url:
        if not args.model or args.out == str(FIXTURE):
            ap.error("--url needs --model and an --out other than the fixture")
        Path(args.out).write_text(json.dumps({"replies": record(args.url, args.model, timeout_s=args.timeout_s)},
                                             indent=1) + "\n")
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    return _record_real(args)


if __name__ == "__main__":
    sys.exit(main())

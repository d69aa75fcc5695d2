"""The CI stand-in (sglang_standin.py) held to real SGLang 0.5.23's recorded replies.

``tests/rollout/fixtures/sglang_0.5.23_replies.json`` holds what real SGLang answered to
``tools/sglang_cpu/record_replies.py``'s fixed list of requests (every endpoint megatron_rl calls,
success and error statuses): per request the status, the reply's shape and its message. Here the
same ``record`` function sends the same list to the stand-in; statuses and shapes must be equal and
the messages equal, or carry the same key facts where a client parses them (``MESSAGE_RULES``).
Refresh the fixture with ``bash scripts/test_sglang_real.sh --record-replies``.
"""

import re
import sys
from pathlib import Path

import pytest

from sglang_standin import SGLangStandIn  # tests/ is on sys.path (conftest)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools" / "sglang_cpu"))

import record_replies  # noqa: E402 - tools/sglang_cpu, on sys.path just above

FIXTURE = record_replies.load_fixture()


def test_the_fixture_is_real_sglangs_and_covers_every_endpoint_the_client_calls():
    assert FIXTURE["sglang_version"] == "0.5.23" and FIXTURE["replies"]
    recorded = {rec["request"].split(" ", 1)[1] for rec in FIXTURE["replies"].values()}
    not_recorded = " ".join(FIXTURE["not_recorded"])
    assert "/release_memory_occupation" in not_recorded and "/resume_memory_occupation" in not_recorded
    # every path the client can send (client.py's string literals) was sent to real SGLang, or is listed with why not
    client_src = (REPO / "megatron_rl" / "rollout" / "sglang" / "client.py").read_text()
    paths = set(re.findall(r'"(/[a-z_]+)"', client_src))
    assert len(paths) >= 20
    missing = sorted(p for p in paths if p not in recorded and p not in not_recorded)
    assert not missing, f"endpoints of client.py neither recorded nor listed as not recorded: {missing}"
    # the recorded list is the one record() sends today (a changed list needs a fresh recording)
    assert set(FIXTURE["replies"]) >= set(record_replies.MESSAGE_RULES)


def test_the_standin_answers_every_recorded_request_as_real_sglang_did(tiny_hf_models):
    model = tiny_hf_models("qwen2")
    with SGLangStandIn(model) as standin:
        got = record_replies.record(standin.url, model, timeout_s=30)
        # the list leaves the server as documented: served weights, version 4, nothing open
        assert standin.weight_version == "4" and not standin.in_session and not standin.groups
    problems = record_replies.compare(FIXTURE["replies"], got)
    assert not problems, "the stand-in differs from real SGLang 0.5.23:\n" + "\n".join(problems)


def test_compare_reports_a_status_a_shape_and_a_message_that_differ():
    want = {"a": {"request": "GET /a", "status": 200, "shape": {"x": "int"}, "message": None},
            "begin_weight_update_twice": {"request": "POST /b", "status": 400, "shape": "<text>",
                                          "message": "a session is already open"}}
    same = {k: dict(v) for k, v in want.items()}
    assert record_replies.compare(want, same) == []
    got = {k: dict(v) for k, v in want.items()}
    got["a"]["shape"] = {"x": "float"}
    got["begin_weight_update_twice"]["message"] = "busy"
    problems = record_replies.compare(want, got)
    assert len(problems) == 2 and "shape" in problems[0] and "'already open'" in problems[1]
    got["a"]["status"] = 404
    assert "status 404, recorded 200" in record_replies.compare(want, got)[0]


@pytest.mark.parametrize("value, expected", [
    ({"a": [1, 2], "b": None, "c": [[0.5, 3, None]], "d": []},
     {"a": ["int"], "b": "null", "c": [["float", "int", "null"]], "d": []}),
    ([{"t": "x"}, {"t": "y"}, {"t": 1}], [{"t": "str"}, {"t": "int"}]),
    (True, "bool"),
])
def test_shape(value, expected):
    assert record_replies.shape(value) == expected

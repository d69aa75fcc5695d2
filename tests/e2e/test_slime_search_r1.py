"""slime's own ``examples/search-r1/generate_with_search.py`` (unchanged: tests/rollout/fixtures/slime_search_r1)
trains the CPU demo model through ``--custom-generate-function-path`` and its ``reward_func`` through
``--custom-rm-path``: ``python -m megatron_rl.train`` in one process, the embedded engine behind the run's
SGLang-protocol gateway, the example's retriever a stub speaking its retrieval API on 127.0.0.1. The model is a
tiny Qwen2 that memorised one search-then-answer trajectory, so the example's multi-turn path runs (a search,
the retriever's observation with loss mask 0, an answer). What trained equals what the engine returned: every
loss-mask-1 run of every saved sample (``--save-debug-rollout-data``) is one gateway reply's tokens and log-probs
exactly (``engine_replies.jsonl``, recorded by the gateway), on exactly the context it was asked for."""

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

pytestmark = pytest.mark.e2e

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLE = os.path.join(REPO, "tests", "rollout", "fixtures", "slime_search_r1")
QUESTION = "Answer as <answer> x </answer>. Question: capital of France?\n"
DOC = '"Paris"\nThe capital.'
# what the example builds: its search turn (stopped at </search>), the retriever's observation, its answer
OBSERVATION = '\n\n<information>Doc 1(Title: "Paris") The capital.</information>\n\n'
TARGET = "<search>France</search>" + OBSERVATION + "<answer>Paris</answer>"


class Retriever(BaseHTTPRequestHandler):
    """The retrieval API the example's local_search_server.py calls: POST {"queries", "topk"} -> result lists."""

    queries: list = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.queries.extend(body["queries"])
        data = json.dumps({"result": [[{"contents": DOC}] for _ in body["queries"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _model(path):
    """A tiny Qwen2 (char tokenizer) that memorised QUESTION -> TARGET <eos>."""
    import transformers

    from _tokenizer import build_char_tokenizer

    config = transformers.Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False, dtype="float32")
    config.save_pretrained(str(path))
    tok = build_char_tokenizer(path)
    config.eos_token_id, config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    prompt = tok.encode(QUESTION, add_special_tokens=False)
    ids = torch.tensor([prompt + tok.encode(TARGET, add_special_tokens=False) + [tok.eos_token_id]])
    labels = ids.clone()
    labels[0, :len(prompt)] = -100
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(100):
            loss = model(input_ids=ids, labels=labels).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _runs(mask):
    """[start, end) of each run of ones in ``mask``."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def test_slimes_search_r1_example_trains_unchanged_on_exactly_the_engine_tokens(tmp_path):
    model = _model(tmp_path / "model")
    label = {"ground_truth": {"target": ["Paris"]}}
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": QUESTION, "label": label}) + "\n")
    server = ThreadingHTTPServer(("127.0.0.1", 0), Retriever)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([REPO, EXAMPLE]),
           "SEARCH_R1_URL": f"http://127.0.0.1:{server.server_address[1]}/retrieve"}
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(var, None)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", model, "--prompt-data",
             str(tmp_path / "prompts.jsonl"), "--custom-generate-function-path", "search_r1_local.generate",
             "--custom-rm-path", "search_r1_local.reward_func", "--rollout-batch-size", "2",
             "--n-samples-per-prompt", "2", "--rollout-max-response-len", "200", "--rollout-max-prompt-len", "64",
             "--rollout-temperature", "0.5", "--num-rollout", "2", "--lr", "1e-5", "--output-dir", str(out),
             "--save-debug-rollout-data", str(tmp_path / "rollouts" / "r_{rollout_id}.pt")],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert json.loads((out / "run_status.json").read_text())["status"] == "finished"
    assert Retriever.queries and set(Retriever.queries) <= {"France"} | set(Retriever.queries)
    replies = [json.loads(line) for line in (tmp_path / "rollouts" / "engine_replies.jsonl").read_text().splitlines()]
    by_context = {tuple(r["input_ids"]): r for r in replies}
    searched = 0
    for rollout in (0, 1):
        samples = torch.load(tmp_path / "rollouts" / f"r_{rollout}.pt", weights_only=False)["samples"]
        assert len(samples) == 4
        for s in samples:
            mask, ids, lps = s["loss_mask"], s["response_ids"], s["rollout_logprobs"]
            assert len(mask) == len(ids) == len(lps)
            for start, end in _runs(mask):  # each trained run: one engine reply, exactly, on its own context
                reply = by_context[tuple(s["prompt_ids"] + ids[:start])]
                assert reply["output_ids"] == ids[start:end] and reply["logprobs"] == lps[start:end]
            zeros = [i for i, m in enumerate(mask) if not m]
            if zeros:  # the retriever's observation, appended by the example with loss mask 0
                searched += 1
                assert s["response_text"][:len(TARGET)] .count("<information>") == 1
                assert all(lps[i] == 0.0 for i in zeros)
            assert s["metadata"]["slime_status"] in ("completed", "truncated")
            if s["response_text"] == TARGET:  # the example's own reward_func scored it (qa_em: exact match)
                assert s["reward"] == 1.0
    assert searched > 0

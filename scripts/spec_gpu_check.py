"""What speculative decoding with the MTP draft needs a CUDA GPU to check (a step of scripts/gpu_check.sh).

1. The embedded engine on the GPU (``--device``): greedy with the draft equals greedy without it token for
   token, and the reported log-probs agree (on the GPU fp32 matmuls of a k+1-token verify forward and a
   one-token decode differ by more than on CPU: the largest gap is printed; the check fails above 1e-3).
2. SGLang (when it imports): a launched server with ``--speculative-algorithm NEXTN`` on the same tiny
   DeepSeek-V3-architecture checkpoint with one MTP layer, greedy against a server without it (the same
   tokens), and the server's reported acceptance (``spec_verify_ct`` / completion tokens). Skipped, with the
   reason, where SGLang does not import; its failure to start is reported with the server's last log lines.

    python scripts/spec_gpu_check.py [--device cuda] [--json OUT] [--dry-run (CPU, SGLang skipped)]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch


def embedded(path: str, device: str) -> dict:
    from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams
    from megatron_rl.rollout.speculative import SpeculativeConfig, spec_metrics

    plain = EmbeddedEngine(path, device=device)
    spec = EmbeddedEngine(path, device=device, speculative=SpeculativeConfig(num_steps=3))
    gen = torch.Generator().manual_seed(0)
    reqs = [GenerateRequest(prompt_ids=torch.randint(0, 250, (n,), generator=gen).tolist(), group_index=i)
            for i, n in enumerate((5, 12, 3, 8))]
    sampling = SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True, n=2)
    a, b = plain.generate(reqs, sampling), spec.generate(reqs, sampling)
    same = all(x.response_ids == y.response_ids for x, y in zip(a, b))
    gap = max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x.rollout_logprobs, y.rollout_logprobs))
    out = {"greedy_identical": same, "max_logprob_gap": gap, **spec_metrics(b)}
    if not same or gap > 1e-3:
        raise SystemExit(f"embedded speculative on {device}: {out}")
    return out


def sglang(path: str) -> dict:
    try:
        import sglang  # noqa: F401
    except ImportError as e:
        return {"skipped": f"sglang does not import: {e}"}
    import httpx

    prompts = [[3, 17, 42, 9, 100], [7, 7, 1, 250 - 2]]
    results = {}
    for name, extra in (("plain", []), ("nextn", ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
                                                  "--speculative-eagle-topk", "1",
                                                  "--speculative-num-draft-tokens", "3"])):
        port = 30000 + (os.getpid() % 1000) + len(results)
        log = open(os.path.join(tempfile.gettempdir(), f"spec_sglang_{name}.log"), "w")
        proc = subprocess.Popen([sys.executable, "-m", "sglang.launch_server", "--model-path", path, "--port", str(port),
                                 "--mem-fraction-static", "0.3", "--disable-cuda-graph", *extra], stdout=log,
                                stderr=subprocess.STDOUT)
        try:
            deadline = time.time() + 240
            while time.time() < deadline and proc.poll() is None:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health_generate", timeout=5).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(2)
            else:
                tail = open(log.name).read()[-3000:]
                raise SystemExit(f"SGLang {name} server did not become healthy in 240 s; log tail:\n{tail}")
            outs = []
            for ids in prompts:
                r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=120, json={
                    "input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 32, "ignore_eos": True}})
                r.raise_for_status()
                body = r.json()
                outs.append({"output_ids": body.get("output_ids"), "meta": {k: body["meta_info"].get(k) for k in
                                                                            ("completion_tokens", "spec_verify_ct")}})
            results[name] = outs
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    same = [a["output_ids"] == b["output_ids"] for a, b in zip(results["plain"], results["nextn"])]
    results["greedy_identical"] = all(same)
    if not all(same):
        raise SystemExit(f"SGLang NEXTN greedy differs from plain: {results}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_hf_model("deepseek_v3", os.path.join(tmp, "dsv3_mtp"), mtp=True)
        result = {"embedded": embedded(path, "cpu" if args.dry_run else args.device),
                  "sglang": {"skipped": "--dry-run"} if args.dry_run else sglang(path)}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()

"""Tokens/s of the embedded rollout engine vs ``transformers`` ``generate``.

Same model (random-weight Qwen2, hidden 256, 4 layers, vocab 1000, fp32, CPU),
same prompts (ragged lengths), same number of new tokens per row (EOS ignored
on both sides), temperature-1 sampling. HF generate is run with
``output_scores=True`` so it also produces per-token scores, which the engine
always returns (log-probs); both use a KV cache. Each setting is timed after
one warm-up run, best of ``--repeats``, the two
sides interleaved so a shared machine's load affects both alike.

    python benchmarks/rollout.py [--threads 2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch


def _prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 33, (batch,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _time_interleaved(fns: list, repeats: int) -> list[float]:
    """Best-of-``repeats`` wall time of each function, runs interleaved so machine load hits all alike."""
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def run_setting(engine, hf_model, prompts: list[list[int]], new_tokens: int, repeats: int) -> dict:
    from megatron_rl.rollout import GenerateRequest, SamplingParams

    requests = [GenerateRequest(prompt_ids=p, group_index=i) for i, p in enumerate(prompts)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0, ignore_eos=True)

    def ours():
        out = engine.generate(requests, sampling)
        assert all(len(s.response_ids) == new_tokens for s in out)

    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, p in enumerate(prompts):
        input_ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1

    def hf():
        with torch.inference_mode():
            out = hf_model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                    top_k=0, top_p=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                    pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        assert out.sequences.shape[1] == width + new_tokens

    t_ours, t_hf = _time_interleaved([ours, hf], repeats)
    tokens = len(prompts) * new_tokens
    return dict(tokens=tokens, ours_s=t_ours, hf_s=t_hf, ours_tps=tokens / t_ours, hf_tps=tokens / t_hf,
                ratio=t_hf / t_ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    import transformers

    from megatron_rl.models.hf_tiny import build_tiny_hf_model
    from megatron_rl.rollout import EmbeddedEngine

    overrides = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_hf_model("qwen2", os.path.join(tmp, "qwen2"), **overrides)
        engine = EmbeddedEngine(path, max_batch_size=64)
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        print(f"model: qwen2 {overrides}, fp32, CPU, torch threads={args.threads}, "
              f"load average at start {os.getloadavg()[0]:.1f}")
        print(f"{'setting':>18} {'tokens':>7} {'engine s':>9} {'HF s':>8} {'engine tok/s':>13} "
              f"{'HF tok/s':>9} {'HF/engine time':>15}")
        for batch, new_tokens in [(16, 32), (64, 128)]:
            r = run_setting(engine, hf_model, _prompts(batch, overrides["vocab_size"], seed=batch), new_tokens,
                            args.repeats)
            print(f"{f'{batch} x {new_tokens} new':>18} {r['tokens']:>7} {r['ours_s']:>9.3f} {r['hf_s']:>8.3f} "
                  f"{r['ours_tps']:>13.0f} {r['hf_tps']:>9.0f} {r['ratio']:>14.2f}x")


if __name__ == "__main__":
    main()

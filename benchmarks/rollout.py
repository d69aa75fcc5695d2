"""Tokens/s of the embedded rollout engine vs ``transformers`` ``generate``.

Same model (random-weight Qwen2, hidden 256, 4 layers, vocab 1000, fp32, CPU),
same prompts (ragged lengths 8-32), temperature-1 sampling, both with a KV
cache; HF generate also returns per-token scores (``output_scores``) since the
engine always returns log-probs. Settings:

* ``B x T``: B prompts, exactly T new tokens each (EOS ignored on both sides);
* ``RL``: 8 prompts x 8 samples, up to 128 new tokens, 20 stop tokens (so
  responses end at different lengths, as in RL): HF uses
  ``num_return_sequences`` and keeps finished rows in the batch; the engine
  prefills each prompt once and drops finished rows. Tokens counted are the
  generated ones up to and including the stop token.

Each side is timed after a warm-up, best of ``--repeats``, the two sides
interleaved so a shared machine's load affects both alike. Wall time and
process CPU time are printed; on a loaded machine the CPU-time ratio is the
steadier one. The default is one torch thread: with two threads on a busy
2-core box, OpenMP spin-waits made single runs vary 1.2 s - 8.4 s.

    python benchmarks/rollout.py [--threads 1] [--repeats 3]

``--speculative``: instead, the embedded engine with and without its MTP draft (``--speculative-algorithm
NEXTN``, rollout/speculative.py) on a random-weight DeepSeek-V3-architecture model with one MTP layer. A random
MTP head accepts almost nothing, and a random model's continuations are chaotic, so the benchmark damps the
target's layers (``--layer-scale``, ``_damp_layers``) and first fits the MTP head (``fit_mtp_head``: Adam on the MTP loss
megatron's ``--enable-mtp-training`` uses, cross-entropy of token t + 2 from the target's hidden state at t and
token t + 1, on responses the target generated from other prompts), then times greedy and temperature-1
generation with and without the draft, checks the greedy outputs are identical, and prints the acceptance rate
at each draft depth. Tokens/s are wall and CPU time, best of ``--repeats``, interleaved.

    python benchmarks/rollout.py --speculative [--num-steps 3] [--fit-steps 300]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

STOP_IDS = list(range(100, 120))


def _prompts(batch: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 33, (batch,), generator=gen).tolist()
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def _timed(fns: list, repeats: int) -> list[tuple[float, float, int]]:
    """(best wall s, best CPU s, tokens) per function; runs interleaved, after one warm-up each."""
    for fn in fns:
        fn()
    best = [(float("inf"), float("inf"), 0)] * len(fns)
    for _ in range(repeats):
        for k, fn in enumerate(fns):
            wall, cpu = time.perf_counter(), time.process_time()
            tokens = fn()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            best[k] = (min(best[k][0], wall), min(best[k][1], cpu), tokens)
    return best


def run_setting(engine, hf_model, prompts: list[list[int]], n: int, new_tokens: int, stop: bool,
                repeats: int) -> dict:
    from megatron_rl.rollout import GenerateRequest, SamplingParams

    requests = [GenerateRequest(prompt_ids=p, group_index=i) for i, p in enumerate(prompts)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=0, n=n, ignore_eos=True,
                              stop_token_ids=STOP_IDS if stop else ())

    def ours() -> int:
        return sum(len(s.response_ids) for s in engine.generate(requests, sampling))

    width = max(len(p) for p in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for r, p in enumerate(prompts):
        input_ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p):] = 1
    stop_kwargs = dict(eos_token_id=STOP_IDS) if stop else dict(min_new_tokens=new_tokens)

    def hf() -> int:
        with torch.inference_mode():
            out = hf_model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, temperature=1.0,
                                    top_k=0, top_p=1.0, max_new_tokens=new_tokens, num_return_sequences=n,
                                    pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                                    **stop_kwargs)
        generated = out.sequences[:, width:]
        if not stop:
            return generated.numel()
        is_stop = torch.isin(generated, torch.tensor(STOP_IDS))
        first = torch.where(is_stop.any(1), is_stop.int().argmax(1) + 1, torch.full_like(is_stop[:, 0], new_tokens,
                                                                                          dtype=torch.long))
        return int(first.sum())

    (ours_wall, ours_cpu, ours_tokens), (hf_wall, hf_cpu, hf_tokens) = _timed([ours, hf], repeats)
    return dict(ours_tokens=ours_tokens, hf_tokens=hf_tokens, ours_wall=ours_wall, hf_wall=hf_wall,
                ours_cpu=ours_cpu, hf_cpu=hf_cpu)


def fit_mtp_head(engine, sequences: torch.Tensor, steps: int, lr: float = 3e-3, batch: int = 32) -> list[float]:
    """Fit ``engine``'s MTP draft on ``sequences`` [N, L]: Adam on the cross-entropy of token t + 2 given the
    target's last hidden state at t and token t + 1 (megatron's MTP loss, depth 0); returns the loss every 50
    steps. The target model stays frozen."""
    draft, target = engine.draft, engine.model
    with torch.no_grad():
        hidden = target.model(sequences).last_hidden_state[:, :-2]
    params = [p for p in draft.parameters()]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    gen = torch.Generator().manual_seed(0)
    losses = []
    positions = torch.arange(hidden.shape[1])[None]
    for step in range(steps):
        rows = torch.randint(0, len(sequences), (batch,), generator=gen)
        seq = sequences[rows]
        _, logits = draft(hidden[rows], seq[:, 1:-1], positions.expand(batch, -1),
                          torch.ones(batch, hidden.shape[1], dtype=torch.long), None, target)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), seq[:, 2:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            losses.append(loss.item())
    for p in params:
        p.requires_grad_(False)
    return losses


def _damp_layers(path: str, layers: int, scale: float) -> None:
    """Scale every decoder layer's output projections (attention ``o_proj``, MLP and expert ``down_proj``) by
    ``scale``: each layer then adds less to the residual stream, so the next token depends more on the last few
    tokens than on the whole prefix. A random-weight model is otherwise chaotic (its continuation of one prefix
    tells nothing about another's), which no draft predicts; trained language models are far more predictable."""
    from safetensors.torch import load_file, save_file

    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    for name in tensors:
        parts = name.split(".")
        if name.endswith(("o_proj.weight", "down_proj.weight")) and int(parts[2]) < layers:
            tensors[name] = tensors[name] * scale
    save_file(tensors, weights, metadata={"format": "pt"})


def run_speculative(args) -> None:
    from megatron_rl.models.hf_tiny import build_tiny_hf_model
    from megatron_rl.rollout import EmbeddedEngine, GenerateRequest, SamplingParams
    from megatron_rl.rollout.speculative import SpeculativeConfig, spec_metrics

    overrides = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=8,
                     vocab_size=512)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_hf_model("deepseek_v3", os.path.join(tmp, "dsv3"), mtp=True, **overrides)
        _damp_layers(path, overrides["num_hidden_layers"], args.layer_scale)
        plain = EmbeddedEngine(path)
        spec = EmbeddedEngine(path, speculative=SpeculativeConfig(num_steps=args.num_steps))
        print(f"model: deepseek_v3 {overrides} + 1 MTP layer, layer outputs x{args.layer_scale}, fp32, CPU, "
              f"torch threads={args.threads}, "
              f"load average at start {os.getloadavg()[0]:.1f}")
        # the draft's training data: the target's own responses (greedy and sampled) to other prompts
        train = [GenerateRequest(prompt_ids=p, group_index=i)
                 for i, p in enumerate(_prompts(args.train_prompts, overrides["vocab_size"], seed=99))]
        seqs = []
        for temperature in (0.0, 1.0):
            out = plain.generate(train, SamplingParams(temperature=temperature, max_new_tokens=64, seed=1,
                                                       ignore_eos=True))
            seqs += [s.response_ids for s in out]
        t0 = time.perf_counter()
        losses = fit_mtp_head(spec, torch.tensor(seqs), args.fit_steps)
        print(f"MTP head fitted: {args.fit_steps} Adam steps on {len(seqs)} responses x 64 tokens in "
              f"{time.perf_counter() - t0:.0f} s; loss every 50 steps: {' '.join(f'{x:.2f}' for x in losses)}")
        requests = [GenerateRequest(prompt_ids=p, group_index=i)
                    for i, p in enumerate(_prompts(args.batch, overrides["vocab_size"], seed=7))]
        print(f"{'setting':>28} {'tokens':>7} {'tok/s plain':>12} {'tok/s draft':>12} {'wall ratio':>11} "
              f"{'CPU ratio':>10}  acceptance per depth (accepted tokens per verify)")
        for temperature in (0.0, 1.0):
            sampling = SamplingParams(temperature=temperature, max_new_tokens=args.new_tokens, seed=3,
                                      ignore_eos=True)
            got: dict = {}

            def run(engine, key):
                def fn() -> int:
                    got[key] = engine.generate(requests, sampling)
                    return sum(len(s.response_ids) for s in got[key])
                return fn

            (pw, pc, tokens), (sw, sc, _) = _timed([run(plain, "plain"), run(spec, "spec")], args.repeats)
            if temperature == 0.0:
                same = all(a.response_ids == b.response_ids for a, b in zip(got["plain"], got["spec"]))
                assert same, "greedy outputs of the speculative engine differ from the plain engine's"
            m = spec_metrics(got["spec"])
            rates = " ".join(f"{m[f'rollout/spec_accept_rate_d{j + 1}']:.2f}" for j in range(args.num_steps))
            name = f"{args.batch} x {args.new_tokens}, T={temperature:g}" + (" (identical)" if not temperature else "")
            print(f"{name:>28} {tokens:>7} {tokens / pw:>12.0f} {tokens / sw:>12.0f} {pw / sw:>10.2f}x "
                  f"{pc / sc:>9.2f}x  {rates} ({m['rollout/spec_accept_len_mean']:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--speculative", action="store_true", help="the MTP draft's benchmark (module docstring)")
    parser.add_argument("--num-steps", type=int, default=2, help="--speculative: draft tokens per round")
    parser.add_argument("--fit-steps", type=int, default=300, help="--speculative: Adam steps fitting the MTP head")
    parser.add_argument("--train-prompts", type=int, default=256,
                        help="--speculative: prompts whose responses (greedy and T=1) the MTP head is fitted on")
    parser.add_argument("--layer-scale", type=float, default=0.2,
                        help="--speculative: the target's layer output projections scaled by this (_damp_layers)")
    parser.add_argument("--batch", type=int, default=1, help="--speculative: prompts generated at once")
    parser.add_argument("--new-tokens", type=int, default=64, help="--speculative: tokens per response")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.speculative:
        run_speculative(args)
        return

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
        print(f"{'setting':>24} {'tokens eng/HF':>13} {'tok/s eng':>10} {'tok/s HF':>9} {'wall ratio':>11} "
              f"{'CPU-time tok/s eng':>19} {'HF':>6} {'CPU ratio':>10}")
        settings = [(16, 1, 32, False), (64, 1, 128, False), (8, 8, 128, True)]
        for batch, n, new_tokens, stop in settings:
            r = run_setting(engine, hf_model, _prompts(batch, overrides["vocab_size"], seed=batch), n, new_tokens,
                            stop, args.repeats)
            name = f"RL {batch} x n{n}, <= {new_tokens}, stops" if stop else f"{batch} x {new_tokens} new"
            wall = (r["ours_tokens"] / r["ours_wall"], r["hf_tokens"] / r["hf_wall"])
            cpu = (r["ours_tokens"] / r["ours_cpu"], r["hf_tokens"] / r["hf_cpu"])
            print(f"{name:>24} {r['ours_tokens']:>6}/{r['hf_tokens']:<6} {wall[0]:>10.0f} {wall[1]:>9.0f} "
                  f"{wall[0] / wall[1]:>10.2f}x {cpu[0]:>19.0f} {cpu[1]:>6.0f} {cpu[0] / cpu[1]:>9.2f}x")


if __name__ == "__main__":
    main()

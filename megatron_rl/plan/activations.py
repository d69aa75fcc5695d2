"""Activations of one packed micro-batch per training rank, from config.json and the flags (stdlib only).

What the autograd graph keeps between a micro-batch's forward and its backward, term by term, in bytes. The
classic reference is Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
(per layer ``s b h (34 + 5 a s / h)`` with dropout masks and a materialised softmax); megatron-core 0.16 with a
packed THD micro-batch saves less and differently, so each term here is what its modules save, read from the
modules and, for the ``local`` kernels, measured (``tests/plan/test_activations.py`` sums the unique storages
``torch.autograd.graph.saved_tensors_hooks`` sees for a tiny megatron-core model: within 10%):

* ``local`` kernels (this code base's CPU path: megatron's local spec, torch RMSNorm, unfused SwiGLU, our THD
  attention): the norm keeps its fp32 upcast input, its fp32 normalised output and the fp32 ``rstd``; each linear
  keeps its input; the attention keeps q, k, v, its output and the fp32 log-sum-exp; the SwiGLU keeps fc1's output
  and two ``f``-wide intermediates (the gate's activation and the product), fc2 its input;
* ``te`` kernels (the GPU path: Transformer Engine's fused norm+linear, flash attention, megatron's fused
  ``bias_swiglu``): the norm keeps its input and ``rstd`` and the linear its normalised input; the attention keeps
  q, k, v, the output (which the output projection keeps as its input: one storage) and the fp32 log-sum-exp; the
  fused SwiGLU keeps fc1's output only. Read from the modules, not measured here (no GPU).

Counted for ``N`` packed tokens per micro-batch on this rank (``--max-tokens-per-gpu``; divided by CP; norms,
routers and the inputs of column-parallel linears over TP too with ``--sequence-parallel``), column/row-parallel
widths over TP, expert widths over expert-TP, in the parameters' dtype (``b`` bytes):

* the dense MLP as above; a MoE layer: the router's input, its top-k indices / probabilities and routing map, and
  per routed token copy (``N k`` of them on an expert rank on average: dropless, uniform routing; a hot expert
  takes more) the expert MLP's terms; the shared expert's as a dense MLP;
* MLA (deepseek_v3 / kimi_k2): the q and kv latents (their norm and up-projection inputs, the shared rope key) and
  q, k, v of the decoupled head dims (the local kernels: megatron's unfused attention, fp32 q, k, v and an
  ``s x s`` softmax per sequence of ``seq_len``); gated delta-net layers (qwen3_next): counted as attention of their
  value heads, an approximation (the CPU path keeps about twice as much: not modelled);
* MTP layers (last stage): a decoder layer each plus their input projection and norms;
* recompute: ``--recompute-granularity full`` keeps only each recompute unit's input (``uniform``: every
  ``--recompute-num-layers`` layers one unit; ``block``: the first ``--recompute-num-layers`` layers of each stage
  recompute, the others keep everything) and, while a unit runs its backward, that unit's full activations;
  ``selective`` recomputes the core attention: its q, k, v stay (the checkpoint's inputs), its output and
  log-sum-exp are dropped (the output projection then keeps its own input);
* pipeline: the first stage holds ``PP`` micro-batches in flight in the 1F1B schedule (stage ``s``: ``PP - s``),
  interleaved (VPP ``v``) ``PP (1 + (PP - 1) / (PP v))`` as Megatron-LM's theoretical-memory formula counts them;
* the logits peak of the log-prob / entropy pass (last stage): the output layer runs on the loss rows only
  (response tokens: ``backends/megatron/role_model._output_rows``; counted here as all ``N`` tokens, an upper
  bound). By default (``logprob_path="chunked"``, a plain output projection) the projection is fused into the
  log-prob op and runs ``--log-probs-chunk-size`` rows at a time (``ops/linear_logprob.py``): what it holds at
  once is one chunk's logits in the dtype and two fp32 ``[chunk, V/TP]`` temporaries of the softmax (the
  backward recomputes the chunk's logits and forms its gradient in the same two), plus in the backward the fp32
  ``[V/TP, h]`` accumulator of the weight's gradient and the hidden rows' gradient (``chunked_logprob_peak``,
  checked against the op's own allocations in tests/plan/test_logprob_peak.py). An output layer that is not a
  plain projection (``logprob_path="loss_rows"``) returns the rows' logits whole (``ops/logprob.py``): its
  ``[rows, V/TP]`` logits are kept for the backward, two fp32 ``[chunk, V/TP]`` temporaries bound the chunked
  softmax, and the backward adds the logits' gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_rl.plan.memory import GIB, MegatronLayout, ModelArch

#: ``ops/logprob.py``'s auto chunk: one float32 ``[chunk, V/TP]`` temporary near this many bytes
LOGPROB_CHUNK_BYTES = 64 * 1024 * 1024
KERNELS = ("te", "local")
#: ``ops/linear_logprob.py``'s MIN_TAIL_ROWS: a last chunk shorter than this joins the one before it
MIN_TAIL_ROWS = 8


@dataclass(frozen=True)
class ActivationFlags:
    """The flags that size one micro-batch's activations."""

    tokens: int  # packed tokens per micro-batch on one GPU (--max-tokens-per-gpu), before the CP split
    dtype_bytes: int = 2
    sequence_parallel: bool = False
    recompute_granularity: Optional[str] = None  # None | "full" | "selective"
    recompute_method: Optional[str] = None  # "uniform" | "block"
    recompute_num_layers: Optional[int] = None
    kernels: str = "te"  # "te": the GPU path; "local": the CPU path (megatron's local spec)
    mtp_trained: bool = False
    response_share: float = 1.0  # response tokens / sample tokens of the longest sample: the loss rows' share
    logprob_path: str = "chunked"  # "chunked": the projection inside the log-prob op; "loss_rows": logits whole
    logprob_chunk_rows: Optional[int] = None  # --log-probs-chunk-size (None: ~LOGPROB_CHUNK_BYTES of fp32)
    seq_len: Optional[int] = None  # local kernels, MLA: the unfused attention's softmax is [seq_len, seq_len] each


@dataclass(frozen=True)
class Term:
    """One named line of the estimate: ``bytes`` on this rank and where the figure comes from."""

    name: str
    bytes: float
    why: str = ""


def _norm(tokens: float, width: int, b: int, kernels: str) -> float:
    """An RMSNorm's saved tensors per call. local (torch): fp32 upcast input + fp32 normalised output + fp32 rstd;
    te: the input (dtype) + fp32 rstd (its normalised output is the following linear's input, counted there)."""
    return tokens * ((8 * width + 4) if kernels == "local" else (b * width + 4))


def _mlp(tokens: float, h: int, f: int, b: int, kernels: str, input_saved: bool = True) -> float:
    """A gated MLP (SwiGLU) of width ``f`` (this rank's share): fc1's input, fc1's output ``2f``, the activation's
    intermediates (local: two ``f``-wide; te's fused bias_swiglu: none), fc2's input."""
    inner = 2 * f + (2 * f if kernels == "local" else 0) + f
    return tokens * b * ((h if input_saved else 0) + inner)


def layer_bytes(a: ModelArch, i: int, lay: MegatronLayout, fl: ActivationFlags, tokens: float) -> list[Term]:
    """The saved tensors of decoder layer ``i`` (an MTP layer's: ``i = layers + depth``) for ``tokens`` tokens on
    this rank (after CP), without recompute."""
    b, k, tp = fl.dtype_bytes, fl.kernels, lay.tp
    sp_tokens = tokens / tp if fl.sequence_parallel and tp > 1 else tokens
    h, d, nh, ng = a.hidden, a.head_dim, a.heads / tp, a.groups / tp
    terms = [Term("input norm", _norm(sp_tokens, h, b, k))]
    selective = fl.recompute_granularity == "selective"
    if a.mla:
        q_rank, kv_rank, nope, rope, v = a.mla
        lat = sp_tokens * b * h  # the down projections' input (the normalised hidden state)
        if q_rank:  # the q latent's norm and the up projection's input
            lat += tokens * (_norm(1, q_rank, b, k) + b * q_rank)
        # the kv latent's norm, the up projection's input, the shared rope key (split off and rotated)
        lat += tokens * (_norm(1, kv_rank, b, k) + b * kv_rank + 2 * b * rope)
        terms.append(Term("MLA latents", lat))
        qkv = tokens * b * nh * (2 * (nope + rope) + v)
        out, lse = tokens * b * nh * v, tokens * 4 * nh
        if k == "local":  # megatron's unfused attention (q/k and v head dims differ): fp32 q, k, v and softmax
            qkv = tokens * 4 * nh * (2 * (nope + rope) + v) + tokens * 4 * nh * (fl.seq_len or tokens)
            out, lse = 0.0, 0.0  # the output projection's input is counted below
    else:
        heads = a.heads / tp if not (a.is_linear_layer(i) and a.gdn) else a.gdn[1] / tp
        terms.append(Term("qkv input", sp_tokens * b * h))
        if a.qk_norm:
            terms.append(Term("q/k norms", _norm(tokens, d, b, k) * (nh + ng)))
        qkv = tokens * b * d * (heads + 2 * (ng if not a.is_linear_layer(i) else heads))
        out, lse = tokens * b * d * heads, tokens * 4 * heads
    if selective:
        # core attention recomputed: its inputs stay, its output and lse are dropped; the projection keeps its input
        terms += [Term("attention q, k, v", qkv), Term("output projection input", out)]
    else:
        terms += [Term("attention q, k, v, output, lse", qkv + out + lse)]
        if k == "local":  # the projection's input is a copy of the attention output (te: the same storage)
            terms.append(Term("output projection input", tokens * b * nh * a.mla[4] if a.mla else out))
    terms.append(Term("pre-MLP norm", _norm(sp_tokens, h, b, k)))
    if a.is_moe_layer(i):
        e_local = a.experts / lay.ep
        copies = tokens * max(a.topk, 1)  # routed token copies reaching this rank's experts, on average
        router = sp_tokens * (b * h + 20 * max(a.topk, 1) + 5 * a.experts)
        terms.append(Term(f"MoE router (top-{a.topk} of {a.experts})", router,
                          "input, top-k ids (int64) and probabilities, routing map (bool) and dense probabilities"))
        terms.append(Term(f"MoE experts ({e_local:g} local, {copies / tokens:g} copies per token)",
                          _mlp(copies, h, a.moe_ffn // lay.expert_tp, b, k) + copies * 4,
                          "per routed copy: the permuted token, the expert MLP's intermediates, its probability"))
        if a.shared_expert:
            terms.append(Term("shared expert", _mlp(tokens, h, a.shared_expert // tp, b, k, input_saved=False)))
    else:
        terms.append(Term("MLP", _mlp(tokens, h, a.ffn // tp, b, k) - (tokens - sp_tokens) * b * h))
    return terms


def _stage_layers(a: ModelArch, lay: MegatronLayout, stage: int) -> list[list[int]]:
    return [list(lay.chunk_layers(a.layers, stage, c)) for c in range(lay.chunks)]


@dataclass(frozen=True)
class StageActivations:
    """One pipeline stage's activation terms (bytes) and its peak."""

    terms: list[Term]
    in_flight: float  # micro-batches held at once
    per_microbatch: float  # bytes one micro-batch keeps
    recompute_working: float  # one recompute unit's full activations while its backward runs
    logits: float  # the log-prob pass's peak (last stage)
    logits_response: float = 0.0  # the same with the loss rows at ``response_share`` of the tokens

    @property
    def peak(self) -> float:
        """The in-flight micro-batches plus the larger of the two transients of the last one's backward: the log-prob
        pass's logits (freed once the output layer's backward ran) come before any recompute unit re-materialises."""
        return self.per_microbatch * self.in_flight + max(self.recompute_working, self.logits)


def stage_activations(a: ModelArch, lay: MegatronLayout, fl: ActivationFlags, stage: int,
                      mtp_layers: int = 0, head: str = "logprob") -> StageActivations:
    """The activations of pipeline ``stage`` (module docstring); ``head="value"`` (ppo's critic): a ``[hidden -> 1]``
    value head in place of the output layer, so no logits peak."""
    b, tp, pp = fl.dtype_bytes, lay.tp, lay.pp
    tokens = fl.tokens / lay.cp
    sp_tokens = tokens / tp if fl.sequence_parallel and tp > 1 else tokens
    first, last = stage == 0, stage == pp - 1
    terms: list[Term] = []
    if first:
        terms.append(Term("embedding: token ids", tokens * 8))
    full = fl.recompute_granularity == "full"
    r = max(fl.recompute_num_layers or 1, 1)
    working = 0.0
    layer_total = 0.0
    kept_inputs = 0.0
    recomputed_layers = 0
    for chunk in _stage_layers(a, lay, stage):
        sizes = [sum(t.bytes for t in layer_bytes(a, i, lay, fl, tokens)) for i in chunk]
        if not full:
            layer_total += sum(sizes)
            continue
        if fl.recompute_method == "block":
            recomputed, kept = sizes[:r], sizes[r:]
            kept_inputs += len(recomputed) * sp_tokens * b * a.hidden
            layer_total += sum(kept)
            recomputed_layers += len(recomputed)
            working = max([working] + recomputed)
        else:  # uniform: units of r layers, each keeps its input
            units = [sizes[j:j + r] for j in range(0, len(sizes), r)]
            kept_inputs += len(units) * sp_tokens * b * a.hidden
            recomputed_layers += len(sizes)
            working = max([working] + [sum(u) for u in units])
    n_layers = sum(len(c) for c in _stage_layers(a, lay, stage))
    if full:
        terms.append(Term(f"decoder layers: {recomputed_layers} of {n_layers} recomputed (full, "
                          f"{fl.recompute_method or 'uniform'}, {r} per unit): their units' inputs", kept_inputs))
        if layer_total:
            terms.append(Term(f"decoder layers: {n_layers - recomputed_layers} kept whole", layer_total))
    else:
        what = " (selective: core attention recomputed)" if fl.recompute_granularity == "selective" else ""
        terms.append(Term(f"decoder layers: {n_layers} kept whole{what}", layer_total))
    logits = 0.0
    if last:
        terms.append(Term("final norm + output layer input", _norm(sp_tokens, a.hidden, b, fl.kernels)
                          + tokens * b * a.hidden))
        for depth in range(mtp_layers):
            mtp = sum(t.bytes for t in layer_bytes(a, a.layers + depth, lay, fl, tokens))
            mtp += 2 * _norm(sp_tokens, a.hidden, b, fl.kernels) + tokens * b * 2 * a.hidden  # norms + eh_proj
            if fl.mtp_trained:  # its own language-model loss: logits and the fp32 softmax of the CE
                mtp += tokens * (b + 4) * a.padded_vocab(tp) / tp
            terms.append(Term(f"MTP layer {depth}", mtp))
        logits = logits_peak(a, lay, fl) if head == "logprob" else 0.0
    per_mb = sum(t.bytes for t in terms)
    response = logits_peak(a, lay, fl, rows_share=fl.response_share) if logits else 0.0
    return StageActivations(terms, in_flight_microbatches(lay, stage), per_mb, working, logits, response)


def in_flight_microbatches(lay: MegatronLayout, stage: int) -> float:
    """Micro-batches whose activations a rank of ``stage`` holds at once in the 1F1B schedule: ``PP - stage``;
    interleaved, the first stage ``PP (1 + (PP - 1) / (PP v))`` (Megatron-LM's theoretical memory). Assumes at
    least ``PP`` micro-batches per step (fewer hold fewer)."""
    pp = lay.pp
    if lay.vpp and pp > 1:
        return pp * (1 + (pp - 1) / (pp * lay.vpp)) if stage == 0 else float(pp - stage)
    return float(pp - stage)


def logits_peak(a: ModelArch, lay: MegatronLayout, fl: ActivationFlags, rows_share: float = 1.0) -> float:
    """The log-prob / entropy pass's peak on the last stage. Rows: every token of the micro-batch (after CP), an
    upper bound for response-only log-probs (``rows_share``: the loss rows' share of the tokens instead).

    ``fl.logprob_path`` "chunked" (the backends' default): ``chunked_logprob_peak``, the projection run a chunk
    of rows at a time. "loss_rows" (``ops/logprob.py`` on the output layer's logits): the kept ``[rows, V/TP]``
    logits (dtype), their gradient in the backward (dtype), two fp32 ``[chunk, V/TP]`` temporaries of the chunked
    softmax (about :data:`LOGPROB_CHUNK_BYTES` each, less for few rows)."""
    rows = fl.tokens / lay.cp * rows_share
    v_local = a.padded_vocab(lay.tp) / lay.tp
    if fl.logprob_path == "chunked":
        return chunked_logprob_peak(rows, v_local, a.hidden, fl.dtype_bytes, fl.logprob_chunk_rows)
    chunk = min(LOGPROB_CHUNK_BYTES, rows * v_local * 4)
    return rows * v_local * fl.dtype_bytes * 2 + 2 * chunk


def logprob_chunk_rows(v_local: float, chunk_rows: Optional[int] = None) -> int:
    """Rows per chunk of the log-prob ops: ``--log-probs-chunk-size``, else ``ops/logprob.py``'s auto size (one
    float32 ``[chunk, V/TP]`` near :data:`LOGPROB_CHUNK_BYTES`)."""
    return int(chunk_rows) if chunk_rows else max(1, LOGPROB_CHUNK_BYTES // (4 * max(int(v_local), 1)))


def chunked_logprob_peak(rows: float, v_local: float, hidden: int, dtype_bytes: int,
                         chunk_rows: Optional[int] = None) -> float:
    """Bytes ``ops/linear_logprob.py`` holds at its peak for ``rows`` loss rows, a ``[v_local, hidden]`` weight
    shard and ``chunk_rows`` rows a chunk, over a training step's forward and backward (its inputs, the hidden
    rows and the weight, not counted: the output layer's input is a term of its own).

    Per chunk ``c`` (the last may be shorter; never more than ``rows``): the chunk's logits in the dtype plus the
    two fp32 ``[c, V/TP]`` temporaries of ``chunk_stats`` (forward) or ``chunk_grad`` (backward, over the
    recomputed logits; the gradient is one of them, then cast to the dtype): ``c V (b + 8)``. Per row: the
    log-prob, the entropy and the saved log-sum-exp, fp32, and their gradients in the backward. The backward
    adds the fp32 ``[V/TP, h]`` weight-gradient accumulator, the hidden rows' gradient ``[rows, h]`` (dtype)
    and, for a weight not in fp32, one ``[V/TP, h]`` product of a chunk and the weight's gradient in its dtype
    (each alive with one chunk's gradient at most)."""
    b = dtype_bytes
    c = min(logprob_chunk_rows(v_local, chunk_rows), max(rows, 1.0))
    tail = rows % c if rows > c else 0.0
    if 0 < tail < MIN_TAIL_ROWS:  # ops/linear_logprob.row_chunks: a tail this short joins the chunk before it
        c += tail
    per_row = 4 * 3 + 4 * 2  # forward: log-prob, entropy, lse; backward: their upstream gradients
    forward = c * v_local * (b + 8) + rows * 12
    cast = b * v_local * hidden if b != 4 else 0.0  # the chunk's weight product / the final weight grad, in dtype
    backward = (rows * per_row + 4 * v_local * hidden + rows * hidden * b
                + max(c * v_local * (b + 8), c * v_local * b + cast, cast))
    return max(forward, backward)


def describe_flags(fl: ActivationFlags, lay: MegatronLayout) -> str:
    rec = ("no recompute" if not fl.recompute_granularity else
           f"recompute {fl.recompute_granularity}" + (f" {fl.recompute_method or 'uniform'} x "
                                                      f"{fl.recompute_num_layers or 1}"
                                                      if fl.recompute_granularity == "full" else ""))
    cp = f" / CP {lay.cp}" if lay.cp > 1 else ""
    sp = ", sequence-parallel" if fl.sequence_parallel and lay.tp > 1 else ""
    return f"{fl.tokens:,} tokens per micro-batch{cp}{sp}, {rec}, {fl.kernels} kernels"


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"

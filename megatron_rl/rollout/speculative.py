"""Speculative decoding in the embedded engine, with the model's own MTP head as the draft (SGLang's NEXTN / EAGLE
chain, ``--speculative-eagle-topk 1``).

One round per live row: the draft proposes ``k = --speculative-num-steps`` tokens ``d_1..d_k`` (each drawn from the
draft's distribution ``q_j`` under the same temperature / top-k / top-p as the target), the target scores the
pending token and the drafts in one forward of ``k + 1`` positions, and the standard speculative sampling rule
decides (Leviathan et al. 2023, Chen et al. 2023)::

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), left to right, stopping at the first rejection;
    at a rejection at j draw from norm(max(0, p_j - q_j)); when all k are accepted draw a bonus token from p_{k+1}

where ``p_j`` is exactly the law ``sample_next_tokens`` draws from (``sampling.sampling_distribution``), so every
emitted token follows non-speculative sampling given its prefix; greedy is the special case where both laws are
one-hot, so the tokens are the non-speculative greedy ones. Invariants:

* the log-prob reported for each token is the TARGET's ``log_softmax(logits / T)`` at that token, from the verify
  forward (no draft probability is ever reported): what the non-speculative engine reports, up to fp32 noise of a
  multi-position forward;
* randomness is per row: each row's generator (its ``row_seed``) gives ``2k + 1`` uniforms per round (draft draws,
  accept tests, the final draw), so a row's tokens do not depend on its batch;
* the KV caches hold a column per position ever fed; a rejected draft's column stays with mask 0 (a hole, as left
  padding), so rows accepting different counts share one cache length. The target's and the draft's caches hold
  the same columns (the draft's chain steps are rewound before the round's catch-up), so one mask serves both.
  Memory: a chunk's cache is sized for ``k + 1`` columns per generated token in the worst case.

Per row, ``RowOutput.spec`` counts the drafts proposed and accepted at each depth (``rollout/spec_accept_rate_d{j}``,
docs/metrics.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from megatron_rl.errors import ConfigError
from megatron_rl.rollout.base import SamplingParams
from megatron_rl.rollout.engine_rows import EngineRow, RowOutput
from megatron_rl.rollout.mtp_draft import final_hidden_states
from megatron_rl.rollout.sampling import inverse_cdf, reported_logprobs, sampling_distribution

if TYPE_CHECKING:
    from megatron_rl.rollout.embedded import EmbeddedEngine, _GenerateCall

SPEC_METADATA_KEY = "spec_drafts"  # Sample.metadata: (proposed, accepted) per draft depth
ALGORITHMS = ("NEXTN", "EAGLE")  # SGLang's names; both run the checkpoint's MTP head as an EAGLE chain here


@dataclass(frozen=True)
class SpeculativeConfig:
    """SGLang's speculative-decoding arguments, as the embedded engine runs them."""

    algorithm: str = "NEXTN"
    num_steps: int = 3  # --speculative-num-steps: draft tokens per round (the chain's depth)
    eagle_topk: int = 1  # --speculative-eagle-topk: a chain (1); trees are not built here
    num_draft_tokens: Optional[int] = None  # --speculative-num-draft-tokens: num_steps + 1 for a chain

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"--speculative-algorithm {self.algorithm}: the embedded engine runs "
                              f"{' or '.join(ALGORITHMS)} (the model's MTP head as the draft)")
        if self.num_steps < 1:
            raise ConfigError(f"--speculative-num-steps {self.num_steps}: use a value >= 1")
        if self.eagle_topk != 1:
            raise ConfigError(f"--speculative-eagle-topk {self.eagle_topk}: the embedded engine drafts a chain "
                              "(top-k 1), not a tree; use --speculative-eagle-topk 1")
        if self.num_draft_tokens is not None and self.num_draft_tokens != self.num_steps + 1:
            raise ConfigError(f"--speculative-num-draft-tokens {self.num_draft_tokens}: a chain of "
                              f"--speculative-num-steps {self.num_steps} verifies {self.num_steps + 1} tokens; "
                              f"use --speculative-num-draft-tokens {self.num_steps + 1} (or leave it unset)")


def speculative_config(rollout: Any) -> Optional[SpeculativeConfig]:
    """The ``--speculative-*`` flags of a ``RolloutConfig`` as a ``SpeculativeConfig``; None without
    ``--speculative-algorithm``."""
    if rollout.speculative_algorithm is None:
        return None
    return SpeculativeConfig(rollout.speculative_algorithm, rollout.speculative_num_steps,
                             rollout.speculative_eagle_topk, rollout.speculative_num_draft_tokens)


def spec_metrics(samples: list) -> dict[str, float]:
    """``rollout/spec_accept_rate_d{j}`` (drafts accepted at depth j of those proposed, over the batch, j from 1) and
    ``rollout/spec_accept_len_mean`` (tokens a verify forward commits: accepted drafts + 1); empty when no sample
    was drafted for."""
    stats = [s.metadata[SPEC_METADATA_KEY] for s in samples if SPEC_METADATA_KEY in s.metadata]
    if not stats:
        return {}
    proposed = torch.tensor([p for p, _ in stats], dtype=torch.float64).sum(0)
    accepted = torch.tensor([a for _, a in stats], dtype=torch.float64).sum(0)
    rounds = float(proposed[0]) if len(proposed) else 0.0
    metrics = {f"rollout/spec_accept_rate_d{j + 1}": float(accepted[j] / proposed[j]) if proposed[j] else 0.0
               for j in range(len(proposed))}
    metrics["rollout/spec_accept_len_mean"] = float(accepted.sum() / rounds) + 1.0 if rounds else 0.0
    return metrics


def accept_drafts(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, accept_u: torch.Tensor,
                  final_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling's accept / reject for a batch: ``(accepted count [B], the next token [B])``.

    ``p`` [B, k+1, V]: the target's laws at the pending position and after each draft; ``q`` [B, k, V]: the
    draft's laws the drafts ``[B, k]`` were drawn from; ``accept_u`` [B, k], ``final_u`` [B] uniforms in [0, 1).
    The next token is drawn from ``norm(max(0, p_a - q_a))`` after a rejection at depth a, else from ``p_k``
    (the bonus)."""
    batch, k = drafts.shape
    p_d = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_d = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    ok = accept_u.double() * q_d < p_d  # u < p/q without dividing (q_d > 0: the draft was drawn from q)
    accepted = torch.cumprod(ok.to(torch.long), dim=-1).sum(dim=-1)
    rows = torch.arange(batch, device=p.device)
    law = p[rows, accepted]
    rejected = accepted < k
    if rejected.any():
        residual = (p[rows, accepted.clamp(max=k - 1)] - q[rows, accepted.clamp(max=k - 1)]).clamp(min=0)
        usable = residual.sum(dim=-1, keepdim=True) > 0  # p == q at that depth: never rejected, but rounding
        law = torch.where(rejected.unsqueeze(-1) & usable, residual, law)
    return accepted, inverse_cdf(law, final_u)


class _Row:
    """One row of a speculative chunk: what it committed, and its generator."""

    __slots__ = ("row", "limit", "tokens", "logprobs", "versions", "done", "reason", "gen", "proposed", "accepted")

    def __init__(self, row: "EngineRow", limit: int, depth: int):
        self.row, self.limit = row, limit
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.done, self.reason = False, "length"
        self.gen = torch.Generator().manual_seed(row.seed)
        self.proposed, self.accepted = [0] * depth, [0] * depth

    def uniforms(self, n: int, greedy: bool) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.float64) if greedy else torch.rand(n, generator=self.gen,
                                                                                 dtype=torch.float64)

    def commit(self, tokens: list[int], logprobs: list[float], version: int, stop_ids: set[int]) -> None:
        """Append tokens until the row ends (a stop token, its limit, a cancel); later ones are dropped."""
        for tok, lp in zip(tokens, logprobs):
            self.tokens.append(tok)
            self.logprobs.append(lp)
            self.versions.append(version)
            if tok in stop_ids:
                self.done, self.reason = True, "stop"
            elif (cancel := self.row.cancel) is not None and cancel.is_set():
                self.done, self.reason = True, "abort"
            elif len(self.tokens) >= self.limit:
                self.done = True
            if self.done:
                return


def generate_speculative_chunk(engine: "EmbeddedEngine", call: "_GenerateCall", chunk: list["EngineRow"],
                               sampling: SamplingParams, stop_ids: set[int], pad_to: int,
                               spec: SpeculativeConfig) -> list["RowOutput"]:
    """``EmbeddedEngine._generate_chunk`` with the MTP draft (module docstring). Pauses, aborts and weight versions
    behave as there: every model use is a step between ``_enter_step`` / ``_leave_step``; ``retract`` after a
    weight update prefills the live rows again, prompt + tokens, into fresh caches of both models."""

    k, dev, greedy = spec.num_steps, engine.device, sampling.greedy
    draft = engine.draft
    assert draft is not None, "generate_speculative_chunk runs only on an engine with a draft"
    rows = [_Row(row, engine._new_token_limit(row), k) for row in chunk]
    width = max(pad_to, max(len(r.prompt_ids) for r in chunk))
    capacity = width + (k + 1) * max(r.limit for r in rows) + k
    state: dict[str, Any] = {}

    def forward_target(ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache, keep: int):
        with final_hidden_states(engine.model) as hidden:
            out = engine.model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                               logits_to_keep=keep)
        return out.logits, hidden[-1][:, -ids.shape[1]:]

    def prefill(live: list[int], seqs: list[list[int]], pending: Optional[list[int]]) -> None:
        """Fresh caches of ``live`` rows holding ``seqs`` (left-padded); ``pending``: each row's next token to
        feed, or None: sample it from the prefill's last logits (a chunk's first token)."""
        wide = max(width, max(len(s) for s in seqs))
        ids = torch.zeros(len(seqs), wide, dtype=torch.long)
        mask = torch.zeros(len(seqs), wide, dtype=torch.long)
        for b, s in enumerate(seqs):
            ids[b, wide - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[b, wide - len(s):] = 1
        ids, mask = ids.to(dev), mask.to(dev)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        from megatron_rl.rollout.kv_cache import make_kv_cache  # lazy: kv_cache imports transformers

        cache = make_kv_cache(engine.model.config, capacity=capacity + wide - width)
        logits, hidden = forward_target(ids, mask, positions, cache, 1)
        if pending is None:
            u = torch.stack([rows[r].uniforms(1, greedy)[0] for r in live]).to(dev)
            law = sampling_distribution(logits[:, -1], sampling, engine.banned_tokens)
            first = inverse_cdf(law, u)
            lps = reported_logprobs(logits[:, -1], sampling).gather(-1, first[:, None])[:, 0]
            for b, r in enumerate(live):
                rows[r].commit([int(first[b])], [float(lps[b])], state["version"], stop_ids)
            pending_t = first
        else:
            pending_t = torch.tensor(pending, dtype=torch.long, device=dev)
        draft_cache = draft.new_cache(capacity + wide - width)
        next_ids = torch.cat([ids[:, 1:], pending_t[:, None]], dim=1)
        out, dlogits = draft(hidden, next_ids, positions, mask, draft_cache, engine.model)
        state.update(live=live, mask=mask, cache=cache, draft_cache=draft_cache, pending=pending_t,
                     pos=positions[:, -1] + 1, g=out[:, -1:], dlogits=dlogits[:, -1])

    def truncate(cache, length: int) -> None:
        for layer in cache.layers:
            layer.truncate(length)

    def round_(version: int) -> None:
        live, mask, pos = state["live"], state["mask"], state["pos"]
        cache, draft_cache = state["cache"], state["draft_cache"]
        batch = len(live)
        u = torch.stack([rows[r].uniforms(2 * k + 1, greedy) for r in live]).to(dev)
        drafts: list[torch.Tensor] = []
        qs: list[torch.Tensor] = []
        g, dlogits = state["g"], state["dlogits"]
        for j in range(k):
            if j:  # the chain: the draft's own output, one position on, with the token it drew
                chain_mask = torch.cat([mask, mask.new_ones(batch, j)], dim=1)
                g, step_logits = draft(g, drafts[-1][:, None], (pos + j - 1)[:, None], chain_mask, draft_cache,
                                       engine.model)
                dlogits = step_logits[:, -1]
            q = sampling_distribution(dlogits, sampling, engine.banned_tokens)
            drafts.append(inverse_cdf(q, u[:, j]))
            qs.append(q)
        truncate(draft_cache, mask.shape[1])  # the chain's columns: never kept
        drafts_t, q_t = torch.stack(drafts, dim=1), torch.stack(qs, dim=1)
        fed = torch.cat([state["pending"][:, None], drafts_t], dim=1)  # [B, k+1]
        positions = pos[:, None] + torch.arange(k + 1, device=dev)
        verify_mask = torch.cat([mask, mask.new_ones(batch, k + 1)], dim=1)
        logits, hidden = forward_target(fed, verify_mask, positions, cache, k + 1)
        p = sampling_distribution(logits.reshape(batch * (k + 1), -1), sampling,
                                  engine.banned_tokens).view(batch, k + 1, -1)
        accepted, nxt = accept_drafts(p, q_t, drafts_t, u[:, k:2 * k], u[:, 2 * k])
        committed = torch.cat([drafts_t, drafts_t[:, :1]], dim=1)
        committed[torch.arange(batch, device=dev), accepted] = nxt  # [d_1..d_a, next, ...]
        lps = reported_logprobs(logits, sampling).gather(-1, committed[:, :, None])[:, :, 0]
        cols = torch.arange(k + 1, device=dev)[None, :] <= accepted[:, None]
        new_mask = torch.cat([mask, cols.to(mask.dtype)], dim=1)
        # the draft's catch-up over the verified positions: h from the target, the next committed token
        out, dlogits_all = draft(hidden, committed, positions, new_mask, draft_cache, engine.model)
        rows_idx = torch.arange(batch, device=dev)
        for b, r in enumerate(live):
            a, row = int(accepted[b]), rows[r]
            if row.done:  # ended earlier, still in the batch until the next compaction
                continue
            for j in range(k):
                row.proposed[j] += 1
                row.accepted[j] += int(j < a)
            row.commit(committed[b, :a + 1].tolist(), lps[b, :a + 1].tolist(), version, stop_ids)
        state.update(mask=new_mask, pending=nxt, pos=pos + accepted + 1, g=out[rows_idx, accepted][:, None],
                     dlogits=dlogits_all[rows_idx, accepted])

    def compact() -> None:
        keep = [b for b, r in enumerate(state["live"]) if not rows[r].done]
        index = torch.tensor(keep, dtype=torch.long, device=dev)
        for key in ("cache", "draft_cache"):
            state[key].batch_select_indices(index)
        for key in ("mask", "pending", "pos", "g", "dlogits"):
            state[key] = state[key][index]
        state["live"] = [state["live"][b] for b in keep]

    step, last_version = 0, engine._weight_version
    while True:
        if engine.step_boundary_hook is not None:
            engine.step_boundary_hook(step)
        aborted, parked_under = engine._enter_step(call)
        if aborted:
            for row in rows:
                if not row.done:
                    row.done, row.reason = True, "abort"
            break
        try:
            if step:
                engine._check_ready("continue generating")
            version = state["version"] = engine._weight_version
            if step == 0:
                prefill(list(range(len(rows))), [list(r.prompt_ids) for r in chunk], None)
            else:
                if version != last_version and parked_under == "retract":  # SGLang's retract: prefill again
                    live = [r for r in state["live"] if not rows[r].done]
                    prefill(live, [list(chunk[r].prompt_ids) + rows[r].tokens[:-1] for r in live],
                                   [rows[r].tokens[-1] for r in live])
                elif sum(not rows[r].done for r in state["live"]) <= 0.75 * len(state["live"]):
                    compact()
                round_(version)
        finally:
            engine._leave_step()
        last_version = version
        step += 1
        if all(row.done for row in rows):
            break
    return [RowOutput(row.tokens, row.logprobs, row.reason, row.versions, None,
                      spec=(list(row.proposed), list(row.accepted))) for row in rows]

"""One agent session's trained samples, assembled from the engine's records of its completions, never from text.

Why from records: an agent sends messages (text); re-encoding the model's own turns from that text can give
other token ids than the engine sampled (a merging BPE joins what was drawn as two tokens), and the trainer
would then score tokens the policy never produced. Each completion the endpoint served is recorded as the
exact ``prompt_ids`` it was rendered to and the engine's ``output_ids``, log-probs and weight versions.

**Branches.** A request whose prompt extends a branch's tip (its last completion's prompt + output: an
append-only chat template renders the history as it was) continues that branch: the branch's sample is its
first prompt, then each completion (loss mask 1, its log-probs and versions) and the tokens the template put
between it and the next completion (the turn end, tool results, the next generation prompt: loss mask 0). A
request whose prompt extends no branch's tip (a template that re-renders or drops history, e.g. Qwen3 dropping
earlier turns' thinking once a new user message follows; tool-call JSON re-serialised in another form; an edited
history) starts a new branch: its own sample, whose prompt is that request's whole rendered prompt (the earlier
turns as the model saw them this time, loss mask 0 as any prompt) and whose loss is on its own completions only.
Each completion is trained exactly once, in the branch it was drawn in, with the context it was drawn from.
Where several tips are prefixes of the prompt, the longest one is extended (the deepest match; ties: the
latest branch). ``Sample.branch`` numbers a session's branches 0, 1, ... in the order they started; the
samples of a session are consecutive, so the trainer counts the session once in its group (docs/agentic.md,
"Branches").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_rl.data.types import GenerateRequest, Sample
from megatron_rl.errors import ConfigError


class NonAppendPrompt(ConfigError):
    """A completion recorded into a branch whose tip its prompt does not extend (a session built by hand); the
    endpoint never does that (``Session.place`` starts a new branch instead)."""


@dataclass(frozen=True)
class Completion:
    """One served completion, exactly as the engine gave it."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: str  # "stop" | "length"


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@dataclass
class Session:
    """One agent session's completions, as branches (module docstring), each a list of completions in order."""

    session_id: str
    branches: list[list[Completion]] = field(default_factory=list)

    @property
    def completions(self) -> list[Completion]:
        """Every completion of the session, branch after branch."""
        return [c for b in self.branches for c in b]

    @property
    def splits(self) -> int:
        """Requests that started a new branch after the first (0 for an append-only session)."""
        return max(0, len(self.branches) - 1)

    @staticmethod
    def tip(branch: list[Completion]) -> list[int]:
        """What a request must extend to continue ``branch``: its last completion's prompt + output."""
        return branch[-1].prompt_ids + branch[-1].output_ids

    def place(self, prompt_ids: list[int]) -> Optional[int]:
        """The branch a completion of ``prompt_ids`` continues (the longest tip it extends; ties: the latest
        branch), or None: it starts a new branch."""
        best: Optional[int] = None
        best_len = -1
        for i, branch in enumerate(self.branches):
            tip = self.tip(branch)
            if len(tip) >= best_len and prompt_ids[:len(tip)] == tip:
                best, best_len = i, len(tip)
        return best

    def describe_split(self, prompt_ids: list[int]) -> str:
        """Where ``prompt_ids`` leaves the latest branch's tip (for the log line of a split)."""
        tip = self.tip(self.branches[-1])
        return (f"request {len(self.completions) + 1}'s rendered prompt ({len(prompt_ids)} tokens) does not extend "
                f"branch {len(self.branches) - 1}'s last completion ({len(tip)} tokens; first difference at token "
                f"{_first_difference(tip, prompt_ids)})")

    def response_length(self, prompt_ids: list[int]) -> int:
        """Response tokens the branch of ``prompt_ids`` would hold before a completion of it (0: a new branch)."""
        at = self.place(prompt_ids)
        return 0 if at is None else len(prompt_ids) - len(self.branches[at][0].prompt_ids)

    def add(self, completion: Completion, branch: Optional[int] = None) -> int:
        """Record ``completion`` in the branch ``place`` gives (``branch`` when the caller placed it already, -1
        for a new one); returns its branch's index."""
        at = self.place(completion.prompt_ids) if branch is None else (None if branch < 0 else branch)
        if at is None:
            self.branches.append([completion])
            return len(self.branches) - 1
        tip = self.tip(self.branches[at])
        if completion.prompt_ids[:len(tip)] != tip:
            raise NonAppendPrompt(f"agent session {self.session_id}: a completion's prompt does not extend branch "
                                  f"{at}'s tip (first difference at token {_first_difference(tip, completion.prompt_ids)})")
        self.branches[at].append(completion)
        return at


def assemble_branch(session: Session, index: int, request: GenerateRequest) -> Sample:
    """Branch ``index``'s sample (module docstring): prompt = its first request's rendered prompt; response =
    every completion's output (loss mask 1, the engine's log-probs and versions) and the template's tokens
    between them (loss mask 0, log-prob 0.0, the next completion's first version)."""
    completions = session.branches[index]
    first = completions[0]
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    before = first.prompt_ids
    for c in completions:
        if c.prompt_ids[:len(before)] != before:  # ``Session.add`` refuses it; a session built by hand may hold one
            raise NonAppendPrompt(f"agent session {session.session_id}: a completion's prompt does not extend the "
                                  f"one before in branch {index}")
        between = c.prompt_ids[len(before):]
        version = c.token_versions[0] if c.token_versions else (versions[-1] if versions else 0)
        response += between + c.output_ids
        mask += [0] * len(between) + [1] * len(c.output_ids)
        logprobs += [0.0] * len(between) + list(c.logprobs)
        versions += [version] * len(between) + list(c.token_versions)
        before = c.prompt_ids + c.output_ids
    last = completions[-1]
    return Sample(group_index=request.group_index, prompt_ids=list(first.prompt_ids), response_ids=response,
                  rollout_logprobs=logprobs, loss_mask=mask, token_versions=versions,
                  finish_reason=last.finish_reason, weight_version=min(versions) if versions else 0,
                  label=request.label, branch=index,
                  metadata={**request.metadata, "agent_session": session.session_id,
                            "agent_completions": len(completions), "agent_branch": index,
                            "agent_branches": len(session.branches)})


def assemble(session: Session, request: GenerateRequest) -> list[Sample]:
    """The session's samples, one per branch in the order the branches started (``assemble_branch``)."""
    if not session.branches:
        raise ValueError("assemble: the session has no completion")
    return [assemble_branch(session, i, request) for i in range(len(session.branches))]


__all__ = ["Completion", "NonAppendPrompt", "Session", "assemble", "assemble_branch"]

"""One agent session's trained sample, assembled from the engine's records of its completions, never from text.

Why from records: an agent sends messages (text); re-encoding the model's own turns from that text can give
other token ids than the engine sampled (a merging BPE joins what was drawn as two tokens), and the trainer
would then score tokens the policy never produced. Each completion the endpoint served is recorded as the
exact ``prompt_ids`` it was rendered to and the engine's ``output_ids``, log-probs and weight versions. When
every request's prompt extends the previous completion's prompt + output (an append-only chat template: the
history is rendered as it was), the session is one sample: the first prompt, then each completion (loss mask
1, its log-probs and versions) and the tokens the template put between it and the next completion (the turn
end, tool results, the next generation prompt: loss mask 0). A request whose prompt does not extend the one
before (a template that re-renders or drops history, e.g. Qwen3 dropping earlier thinking) is refused
(``NonAppendPrompt``), naming the first token where they differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_rl.data.types import GenerateRequest, Sample
from megatron_rl.errors import ConfigError


class NonAppendPrompt(ConfigError):
    """A request's rendered prompt is not an extension of the session's previous completion (module docstring)."""


@dataclass(frozen=True)
class Completion:
    """One served completion, exactly as the engine gave it."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]
    token_versions: list[int]
    finish_reason: str  # "stop" | "length"


@dataclass
class Session:
    """One agent session's completions, in order (``add`` checks each extends the one before)."""

    session_id: str
    completions: list[Completion] = field(default_factory=list)

    def context(self) -> Optional[list[int]]:
        """The previous completion's prompt + output (what the next prompt must extend), or None."""
        if not self.completions:
            return None
        last = self.completions[-1]
        return last.prompt_ids + last.output_ids

    def check_extends(self, prompt_ids: list[int]) -> None:
        """``NonAppendPrompt`` unless ``prompt_ids`` extends the previous completion's prompt + output."""
        before = self.context()
        if before is None or prompt_ids[:len(before)] == before:
            return
        at = next((i for i, (a, b) in enumerate(zip(before, prompt_ids)) if a != b), min(len(before), len(prompt_ids)))
        raise NonAppendPrompt(
            f"agent session {self.session_id}: request {len(self.completions) + 1}'s rendered prompt "
            f"({len(prompt_ids)} tokens) does not extend completion {len(self.completions)}'s prompt + output "
            f"({len(before)} tokens; first difference at token {at}): the chat template re-renders or drops "
            "earlier turns (or the agent edited its history), so one trajectory cannot hold the session; keep the "
            "history as the endpoint returned it, or use an append-only template")

    def response_length(self, prompt_ids: list[int]) -> int:
        """Response tokens the session would hold before a completion of ``prompt_ids``."""
        first = self.completions[0].prompt_ids if self.completions else prompt_ids
        return len(prompt_ids) - len(first)

    def add(self, completion: Completion) -> None:
        self.check_extends(completion.prompt_ids)
        self.completions.append(completion)


def assemble(session: Session, request: GenerateRequest) -> Sample:
    """The session's sample (module docstring): prompt = the first request's rendered prompt; response = every
    completion's output (loss mask 1, the engine's log-probs and versions) and the template's tokens between
    them (loss mask 0, log-prob 0.0, the next completion's first version)."""
    if not session.completions:
        raise ValueError("assemble: the session has no completion")
    first = session.completions[0]
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    at = len(first.prompt_ids)
    before = first.prompt_ids
    for c in session.completions:
        if c.prompt_ids[:at] != before:  # ``Session.add`` refuses it; a session built by hand may hold one
            raise NonAppendPrompt(f"agent session {session.session_id}: a completion's prompt does not extend the "
                                  "one before")
        between = c.prompt_ids[at:]
        version = c.token_versions[0] if c.token_versions else (versions[-1] if versions else 0)
        response += between + c.output_ids
        mask += [0] * len(between) + [1] * len(c.output_ids)
        logprobs += [0.0] * len(between) + list(c.logprobs)
        versions += [version] * len(between) + list(c.token_versions)
        before = c.prompt_ids + c.output_ids
        at = len(before)
    last = session.completions[-1]
    return Sample(group_index=request.group_index, prompt_ids=list(first.prompt_ids), response_ids=response,
                  rollout_logprobs=logprobs, loss_mask=mask, token_versions=versions,
                  finish_reason=last.finish_reason, weight_version=min(versions) if versions else 0,
                  label=request.label, metadata={**request.metadata, "agent_session": session.session_id,
                                                 "agent_completions": len(session.completions)})


__all__ = ["Completion", "NonAppendPrompt", "Session", "assemble"]

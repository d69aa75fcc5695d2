"""slime's ``Sample``: the fields, ``Status`` values and methods a slime rollout, generate or reward function
uses, with slime's names and meanings (written for megatron_rl; slime's own is used whenever it is installed).

Token layout as slime's: ``tokens`` is prompt + response, the last ``response_length`` of them the response;
``loss_mask`` and ``rollout_log_probs`` are response-aligned (``None``: all ones / not collected)."""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


def _ints(tokens) -> list:
    if tokens is None:
        return []
    if hasattr(tokens, "tolist"):
        tokens = tokens.tolist()
    return [int(t) for t in tokens]


def _floats(values):
    if values is None:
        return None
    if hasattr(values, "tolist"):
        values = values.tolist()
    return [float(v) for v in values]


@dataclass
class Sample:
    """One sample of a prompt group, as slime's rollout functions see it."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: Any = ""
    tokens: list = field(default_factory=list)
    multimodal_inputs: dict | None = None
    multimodal_train_inputs: dict | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict = field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: Any = None
    reward: Any = None
    loss_mask: list | None = None
    weight_versions: list = field(default_factory=list)
    rollout_log_probs: list | None = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    remove_sample: bool = False
    teacher_log_probs: list | None = None

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict = field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    def to_dict(self) -> dict:
        value = self.__dict__.copy()
        value["status"] = self.status.value
        return value

    @staticmethod
    def from_dict(data: dict) -> "Sample":
        data = dict(data)
        data["status"] = Sample.Status(data.get("status", "pending"))
        names = set(Sample.__dataclass_fields__)
        sample = Sample(**{k: v for k, v in data.items() if k in names})
        for key, value in data.items():
            if key not in names:
                setattr(sample, key, value)
        return sample

    def get_reward_value(self, args) -> float:
        key = getattr(args, "reward_key", None)
        return self.reward if not key else self.reward[key]

    @property
    def effective_response_length(self) -> int:
        return sum(self.loss_mask) if self.loss_mask is not None else self.response_length

    def append_response_tokens(self, args=None, *, tokens=None, log_probs=None, trainable: bool = True,
                               meta_info: dict | None = None, text: str | None = None,
                               update_terminal_info: bool = True) -> None:
        """Append response tokens keeping ``loss_mask`` and ``rollout_log_probs`` aligned (slime's rules: trainable
        tokens need their log-probs; others get loss-mask 0 and log-prob 0.0)."""
        tokens = _ints(tokens)
        log_probs = _floats(log_probs)
        if log_probs is not None and len(log_probs) != len(tokens):
            raise ValueError(f"log_probs length {len(log_probs)} != tokens length {len(tokens)}")
        if tokens and trainable and log_probs is None:
            raise ValueError("trainable response tokens require rollout log probabilities.")
        if tokens and not trainable:
            if log_probs is not None:
                raise ValueError("non-trainable response tokens should not pass rollout log probabilities.")
            log_probs = [0.0] * len(tokens)
        if text is not None:
            self.response += text
        before = self.response_length
        if tokens:
            self.tokens = list(self.tokens) + tokens
            self.response_length += len(tokens)
            if self.loss_mask is None:
                self.loss_mask = [1] * before
            self.loss_mask += [1 if trainable else 0] * len(tokens)
        if log_probs is not None:
            if self.rollout_log_probs is None:
                if trainable and before:
                    raise ValueError("Cannot append trainable rollout log probabilities to a sample with existing "
                                     "response tokens but no existing rollout_log_probs.")
                self.rollout_log_probs = [0.0] * before
            self.rollout_log_probs += log_probs
        if meta_info is not None and update_terminal_info and "finish_reason" in meta_info:
            if "weight_version" in meta_info:
                self.weight_versions.append(meta_info["weight_version"])
            kind = meta_info["finish_reason"]["type"]
            status = {"length": Sample.Status.TRUNCATED, "abort": Sample.Status.ABORTED,
                      "stop": Sample.Status.COMPLETED}.get(kind)
            if status is not None:
                self.status = status
        if self.loss_mask is not None and len(self.loss_mask) != self.response_length:
            raise ValueError(f"loss_mask length {len(self.loss_mask)} != response_length {self.response_length}")
        if self.rollout_log_probs is not None and len(self.rollout_log_probs) != self.response_length:
            raise ValueError(f"rollout_log_probs length {len(self.rollout_log_probs)} != response_length "
                             f"{self.response_length}")

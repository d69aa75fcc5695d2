"""Pre-flight: what the driver can check about the run's inputs before any worker collective.

Why here and not in ``config/validate.py``: validation reads flags and small JSON configs only (it
runs on every rank and in ``--dry-run``); these checks read whole prompt files and talk to servers,
so the driver (rank 0) runs them once, in ``train.main`` before ``run`` builds anything. A refusal
then ends the run before any process group exists: the driver records it for the launcher
(``MEGATRON_RL_STATUS_FILE``), the launcher prints the one ``error:`` line, and the other ranks,
still waiting for the driver to join their first collective, are ended by torchrun without a word.

What is checked, each named by flag, file, line or URL with the fix:

* ``--prompt-data`` and every ``--eval-prompt-data`` file, streamed line by line
  (``data.prompts.scan_prompt_file``): present, not empty, UTF-8, one JSON object per line (a JSON
  array file is named as one), ``--input-key`` and ``--label-key`` on every line, a prompt of a
  known type, every line within ``--max-prompt-line-mib``, token-id prompts within
  ``--rollout-max-prompt-len``;
* the tokenizer: text or chat prompts need tokenizer files in ``--hf-checkpoint``; chat messages
  need ``--apply-chat-template``, token ids refuse it;
* ``--rollout-engine-urls``: every server answers ``/health`` and ``/model_info`` within
  ``engine_timeout_s`` per request (``rollout.sglang.health.probe_servers``);
* every flag that names user code (``rollout.entry_points.USER_CODE``: ``--custom-generate-function-path``,
  ``--rollout-function-path``, ``--custom-rm-path``, ``--dynamic-sampling-filter-path``, ``--tools``):
  imported and checked by the loader the run uses (a module that does not import or has a syntax error, a
  missing name, a constant where a function belongs, a function that cannot take the call's arguments);
* ``--rm-url``: something accepts a connection at its host and port, with the retries a request gets
  (``rollout.remote_reward.probe_reward_server``); nothing is posted;
* the sandbox, where ``--rm-type code`` or a sandboxed tool of ``--tools`` uses it: a program started once under
  the ``--sandbox-*`` limits (``infra.sandbox.check_sandbox``: the namespaces this machine allows, an
  interpreter the sandbox's user can run, limits it starts under), and a wall bound below ``--tool-timeout``;
* on GPUs only, the memory estimate (``--dry-run``'s: ``plan/memory.py``, ``plan/activations.py``,
  ``plan/fit.py``) against the card this rank finds (or ``--gpu-memory-gib``): a plan that does not fit is refused
  naming the component, rank, shortfall and the best fix, unless ``--allow-over-memory`` (then a warning line). A
  CPU run (host memory is the only memory, the estimate is of GPU memory) is not checked.

What needs the tokenizer loaded (a prompt's token count against ``--rollout-max-prompt-len``, the
tokenizer's chat template) is checked when the rollout is built, after the workers started; such a
refusal ends the other ranks quietly too (``train.main``).
"""

from __future__ import annotations

import logging
import os
from typing import Optional

from megatron_rl.config import Config
from megatron_rl.data.prompts import MIB, PromptFileScan, scan_prompt_file
from megatron_rl.errors import ConfigError, EngineError
from megatron_rl.infra.sandbox import SandboxLimits, check_sandbox
from megatron_rl.rollout.agent import check_tools
from megatron_rl.rollout.base import TOKENIZER_FILES
from megatron_rl.rollout.entry_points import load_user_code
from megatron_rl.rollout.remote_reward import probe_reward_server
from megatron_rl.rollout.sglang.health import PROBE_TIMEOUT_S, probe_servers

log = logging.getLogger(__name__)


def preflight(cfg: Config, *, engine_timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise the first problem (``ConfigError`` for inputs, ``EngineError`` for servers) or return None."""
    check_memory_fit(cfg)
    if not cfg.has_rollout_engine:
        return  # rollouts come from a file or stored rollouts: no prompts are read, no engine is asked
    scans = [_scan(cfg, "--prompt-data", path) for path in cfg.data.prompt_files]
    scans += [_scan(cfg, f"--eval-prompt-data{' ' + name if name else ''}", path) for name, path in cfg.data.eval_sets]
    for flag, scan in scans:
        check_tokenizer_for(cfg, flag, scan)
    load_user_code(cfg)  # every user-code flag imported and checked, as the rollout will load it
    d = cfg.data
    check_tools(cfg)  # a sandboxed tool: the sandbox started once (nothing for tools without one)
    if d.rm_type == "code" and not (d.custom_rm_path or d.rm_url):
        check_sandbox(SandboxLimits.from_config(cfg))
    if d.rm_url:
        problem = probe_reward_server(d.rm_url, timeout_s=min(engine_timeout_s, d.rm_timeout),
                                      max_retries=d.rm_max_retries)
        if problem:
            raise EngineError(f"--rm-url {d.rm_url}: {problem} (checked before the workers started); start the "
                              "reward server and wait until it listens, or fix the URL (--rm-max-retries sets how "
                              "long a server still starting is waited for)")
    if cfg.rollout.rollout_backend == "sglang" and cfg.rollout.rollout_engine_urls:
        problems = probe_servers(cfg.rollout.rollout_engine_urls, timeout_s=engine_timeout_s)
        if problems:
            raise EngineError(f"--rollout-engine-urls: {len(problems)} server(s) do not answer as running SGLang "
                              "servers (checked before the workers started):\n  - " + "\n  - ".join(problems)
                              + "\nstart them (python -m sglang.launch_server ...) and wait until GET /health "
                              "answers 200, or fix the URLs; to have this run launch its own engines, drop "
                              "--rollout-engine-urls")


def check_memory_fit(cfg: Config, *, device_gib: Optional[float] = None) -> Optional[str]:
    """On GPUs: raise ``ConfigError`` when the memory estimate says the plan does not fit the card (``device_gib``:
    its memory in GiB; None: the first visible CUDA device's, or no check where there is none); with
    ``--allow-over-memory`` log a warning instead. Returns the warning, or None."""
    if device_gib is None:
        import torch  # lazy: the run imports it next anyway; only asked whether a CUDA device is there

        if not torch.cuda.is_available():
            return None  # a CPU run: host memory is the only memory, the estimate is of GPU memory
        device_gib = torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    from megatron_rl.runner.dry_run import memory_lines  # lazy: the planner's tables

    _, over = memory_lines(cfg, gpu_memory=cfg.memory.gpu_memory_gib or device_gib)
    if not over:
        return None
    if not cfg.memory.allow_over_memory:
        raise ConfigError(f"{over} (checked before the workers started; python -m megatron_rl.train ... --dry-run "
                          "prints the table and every fix; --allow-over-memory goes on anyway)")
    log.warning("%s; going on: --allow-over-memory", over)
    return over


def _scan(cfg: Config, flag: str, path: str) -> tuple[str, PromptFileScan]:
    d = cfg.data
    return flag, scan_prompt_file(path, input_key=d.input_key, label_key=d.label_key,
                                  metadata_key=d.metadata_key, tool_key=d.tool_key,
                                  max_line_bytes=d.max_prompt_line_mib * MIB,
                                  max_prompt_len=cfg.rollout.rollout_max_prompt_len, flag=flag)


def check_tokenizer_for(cfg: Config, flag: str, scan: PromptFileScan) -> None:
    """The prompts of ``scan`` can be tokenized the way the flags ask, as far as files on disk tell."""
    where = f"{flag} {scan.path}"
    if scan.first_chat_line is not None and not cfg.data.apply_chat_template:
        raise ConfigError(f"{where} {scan.unit} {scan.first_chat_line}: --input-key {cfg.data.input_key!r} holds chat "
                          "messages; pass --apply-chat-template")
    if scan.first_text_line is None:
        if cfg.data.apply_chat_template:
            raise ConfigError(f"{where}: every prompt holds token ids, which cannot take a chat template; drop "
                              "--apply-chat-template or store text")
        return  # token ids are used as they are
    hf = cfg.model.hf_checkpoint
    missing = _tokenizer_missing(hf)
    if missing:
        raise ConfigError(f"{where} {scan.unit} {scan.first_text_line} holds a text prompt, which needs a tokenizer, but "
                          f"{missing}; copy the base model's tokenizer files there, or store the prompts as token "
                          "ids")


def _tokenizer_missing(hf: Optional[str]) -> Optional[str]:
    """Why ``--hf-checkpoint`` gives no tokenizer (the rule ``rollout.base.load_tokenizer`` follows), or None."""
    if not hf:
        return "no --hf-checkpoint is given to load one from"
    if not any(os.path.exists(os.path.join(hf, name)) for name in TOKENIZER_FILES):
        return f"--hf-checkpoint {hf} holds no tokenizer files (none of {', '.join(TOKENIZER_FILES)})"
    return None

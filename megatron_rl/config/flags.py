"""Megatron-style command line (and YAML) -> one frozen ``Config``.

The parser is generated from ``schema.py``. Precedence: field defaults < the
``--config FILE.yaml`` keys < flags on the command line. Unknown flags are
errors (with the closest known flag suggested) except ``--sglang-*``, which are
passed through verbatim to the rollout engine. Validation lives in
``validate.py`` and runs once, on the finished object; nothing here mutates a
value after parsing.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import typing
from typing import Any, Optional, Sequence

from megatron_rl.errors import ConfigError

from .schema import GROUPS, Config, flag_name, iter_fields
from .placement import apply_allocation
from .slime_args import not_built_reason
from .validate import validate_config
from .verl_keys import translated_tokens

PASS_THROUGH_PREFIX = "--sglang-"


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message):  # noqa: D102 - argparse hook
        raise ConfigError(f"{message} (see --help or docs/flags.md)")


def _base_type(f: dataclasses.Field):
    hint = f.type
    if isinstance(hint, str):
        hint = eval(hint, vars(typing), {})  # noqa: S307 - our own annotations
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        hint = args[0]
    return hint


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m megatron_rl.train",
        description="RL post-training on megatron-core. Flags follow Megatron-LM / slime names.",
        allow_abbrev=False,
    )
    parser.add_argument("--config", metavar="FILE.yaml", default=None,
                        help="YAML file whose keys are flag names (dashes or underscores); CLI flags win.")
    parser.add_argument("--megatron-config-path", metavar="FILE.yaml", default=None,
                        help="slime's role config: a top-level 'megatron' list of entries {role: actor|critic, "
                             "overrides: {key: value}}. An actor entry's keys are flag names (the actor's); a "
                             "critic entry's keys are tensor_model_parallel_size, pipeline_model_parallel_size, "
                             "lr, lr_warmup_iters (the critic's own layout and schedule). As in slime, the "
                             "overrides win over the command line.")
    groups = {name: parser.add_argument_group(name) for name in GROUPS}
    for group_name, _, f in iter_fields():
        if f.name == "sglang_args":
            continue
        meta = f.metadata
        names = [flag_name(f), *meta["aliases"]]
        kwargs: dict[str, Any] = {"dest": f"{group_name}.{f.name}", "help": meta["help"]}
        base = _base_type(f)
        if base is bool:
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = meta["type"] or base
            if meta["choices"]:
                kwargs["choices"] = meta["choices"]
            if meta["nargs"]:
                kwargs["nargs"] = meta["nargs"]
            if meta["metavar"]:
                kwargs["metavar"] = meta["metavar"]
        groups[group_name].add_argument(*names, **kwargs)
    return parser


def _split_pass_through(argv: Sequence[str], declared: frozenset = frozenset()) -> tuple[list[str], dict[str, Any]]:
    """Pull ``--sglang-KEY [VALUE ...]`` out of argv (several values: a list, as SGLang's nargs
    arguments take them); ``--sglang-KEY=VALUE`` works too. A ``--sglang-*`` flag in ``declared`` is one of
    this parser's own (slime's --sglang-server-concurrency: a flag of slime's, not of SGLang's servers)."""
    rest: list[str] = []
    passed: dict[str, Any] = {}
    i = 0
    argv = list(argv)
    while i < len(argv):
        tok = argv[i]
        if tok.startswith(PASS_THROUGH_PREFIX) and tok.split("=", 1)[0] not in declared:
            key, eq, value = tok[len(PASS_THROUGH_PREFIX):].partition("=")
            key = key.replace("-", "_")
            if not key:
                raise ConfigError(f"{tok!r}: a pass-through flag needs a name, e.g. --sglang-mem-fraction-static 0.8")
            values = []
            while not eq and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                values.append(argv[i + 1])  # SGLang list arguments: --sglang-cuda-graph-bs 1 2 4 8
                i += 1
            if eq:
                passed[key] = value
            else:
                passed[key] = values[0] if len(values) == 1 else (values or True)
        else:
            rest.append(tok)
        i += 1
    return rest, passed


def _read_yaml(path: str, flag: str) -> Any:
    """``path``'s YAML document (``{}`` when empty); a missing file or bad YAML is an error naming ``flag``."""
    import yaml  # lazy: only a run given a YAML file reads one

    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: no such file")
    try:
        with open(path) as fh:
            return yaml.safe_load(fh) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{flag} {path}: not valid YAML ({exc})") from None


def _load_yaml(path: str) -> dict[str, Any]:
    data = _read_yaml(path, "--config")
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path}: expected a mapping of flag names to values at the top level")
    return data


def _yaml_to_dests(data: dict[str, Any], path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Map YAML keys to parser dests, converting values with each flag's type."""
    by_name = {f.name: (g, f) for g, _, f in iter_fields()}
    dests: dict[str, Any] = {}
    passed: dict[str, Any] = {}
    for key, value in data.items():
        norm = str(key).lstrip("-").replace("-", "_")
        if norm.startswith("sglang_") and norm != "sglang_args":
            passed[norm[len("sglang_"):]] = value
            continue
        if norm == "sglang_args":
            if not isinstance(value, dict):
                raise ConfigError(f"--config {path}: 'sglang_args' must be a mapping")
            passed.update(value)
            continue
        if norm not in by_name:
            close = difflib.get_close_matches(norm, by_name, n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"--config {path}: unknown key '{key}'{hint}")
        group, f = by_name[norm]
        conv = f.metadata["type"] or _base_type(f)
        if value is not None and conv is not bool and not isinstance(value, list):
            try:
                value = conv(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"--config {path}: key '{key}' = {value!r}: {exc}") from None
        if conv is bool and not isinstance(value, bool):
            raise ConfigError(f"--config {path}: key '{key}' must be true or false, got {value!r}")
        dests[f"{group}.{f.name}"] = value
    return dests, passed


# slime's critic role keys (--megatron-config-path) -> the critic's own fields here; other megatron arguments of a
# critic entry (its precision, its optimizer kind) are the actor's in this engine and are refused by name
CRITIC_ROLE_KEYS: dict[str, tuple[str, str]] = {
    "tensor_model_parallel_size": ("parallel", "critic_tensor_model_parallel_size"),
    "pipeline_model_parallel_size": ("parallel", "critic_pipeline_model_parallel_size"),
    "lr": ("optimizer", "critic_lr"),
    "lr_warmup_iters": ("optimizer", "critic_lr_warmup_iters"),
}


def _role_overrides(path: str) -> dict[str, Any]:
    """``--megatron-config-path``: the parser dests its role entries set (slime's
    ``parse_megatron_role_args``: at most one entry per role, ``overrides`` or ``args`` a mapping)."""
    flag_ = "--megatron-config-path"
    data = _read_yaml(path, flag_)
    entries = data.get("megatron") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ConfigError(f"{flag_} {path}: expected a top-level 'megatron' list, e.g. "
                          "megatron: [{name: default, role: critic, overrides: {tensor_model_parallel_size: 2}}]")
    dests: dict[str, Any] = {}
    seen: set[str] = set()
    by_name = {f.name: (g, f) for g, _, f in iter_fields()}
    for entry in entries:
        role = entry.get("role") if isinstance(entry, dict) else None
        if role not in ("actor", "critic"):
            raise ConfigError(f"{flag_} {path}: entry {entry!r} needs role: actor or role: critic")
        if role in seen:
            raise ConfigError(f"{flag_} {path}: more than one entry with role: {role}; keep one")
        seen.add(role)
        overrides = entry.get("overrides", entry.get("args")) or {}
        if not isinstance(overrides, dict):
            raise ConfigError(f"{flag_} {path}: the {role} entry's overrides must be a mapping")
        for key, value in overrides.items():
            norm = str(key).lstrip("-").replace("-", "_")
            if norm in ("num_nodes", "num_gpus_per_node"):
                raise ConfigError(f"{flag_} {path}: {role} key '{key}': GPU allocation follows the command line "
                                  "(--actor-num-nodes / --actor-num-gpus-per-node; the critic runs on the actor's "
                                  "ranks); drop the key")
            if role == "critic":
                if norm in ("save", "load"):
                    raise ConfigError(f"{flag_} {path}: critic key '{key}': the critic's model, optimizer and "
                                      "schedule go into each --save checkpoint beside the actor's and resume from "
                                      "it; its initial trunk is --critic-load (a model-only torch_dist dir) or "
                                      "--critic-hf-checkpoint: drop the key")
                if norm not in CRITIC_ROLE_KEYS:
                    raise ConfigError(f"{flag_} {path}: critic key '{key}' is not one the critic has of its own "
                                      f"here (it has {', '.join(CRITIC_ROLE_KEYS)}; the rest of its configuration is "
                                      "the actor's): drop it or set it for both on the command line")
                group, name = CRITIC_ROLE_KEYS[norm]
            else:
                if norm not in by_name:
                    close = difflib.get_close_matches(norm, by_name, n=1)
                    hint = f"; did you mean '{close[0]}'?" if close else ""
                    raise ConfigError(f"{flag_} {path}: actor key '{key}' is no flag here{hint}")
                group, name = by_name[norm][0], norm
            field_ = by_name[name][1]
            conv = field_.metadata["type"] or _base_type(field_)
            if conv is bool and not isinstance(value, bool):
                raise ConfigError(f"{flag_} {path}: {role} key '{key}' must be true or false, got {value!r}")
            try:  # YAML reads 1e-5 as a string (slime coerces it the same way)
                value = value if value is None or isinstance(value, list) else conv(value)
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{flag_} {path}: {role} key '{key}' = {value!r}: {exc}") from None
            dests[f"{group}.{name}"] = value
    return dests


def _unknown_flag_error(unknown: list[str], parser: argparse.ArgumentParser) -> ConfigError:
    known = [s for a in parser._actions for s in a.option_strings]
    parts = []
    prev_was_flag = False
    for tok in unknown:
        if not tok.startswith("-"):
            if not prev_was_flag:  # a value right after an unknown flag belongs to it
                parts.append(f"unexpected value {tok!r}")
            prev_was_flag = False
            continue
        prev_was_flag = "=" not in tok
        name = tok.split("=", 1)[0]
        slime = not_built_reason(name)
        if slime:  # one of slime's flags: say why there is none here (docs/migrating-from-slime.md)
            parts.append(f"unknown flag {name}: slime's flag is not built here ({slime})")
            continue
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"unknown flag {name}" + (f" (did you mean {close[0]}?)" if close else ""))
    return ConfigError("; ".join(parts))


# a choice under a peer's name -> ours (accepted by the flag, then the same run): verl's "gae" is PPO with a critic
VALUE_ALIASES: dict[tuple[str, str], dict[str, str]] = {("algorithm", "advantage_estimator"): {"gae": "ppo"}}


def parse_config(argv: Optional[Sequence[str]] = None, *, validate: bool = True) -> Config:
    """Parse flags (and an optional YAML file) into a validated frozen ``Config``.

    Raises ``ConfigError`` naming the flag, value and fix; never exits the process.
    """

    argv = list(argv if argv is not None else __import__("sys").argv[1:])
    argv = translated_tokens(argv)  # --verl-overrides / --verl-config: their flags first, so the command line wins
    parser = build_parser()
    argv, passed = _split_pass_through(argv, frozenset(
        s for a in parser._actions for s in a.option_strings if s.startswith(PASS_THROUGH_PREFIX)))
    pre, _ = parser.parse_known_args(argv)  # only to find --config
    yaml_passed: dict[str, Any] = {}
    if pre.config:
        dests, yaml_passed = _yaml_to_dests(_load_yaml(pre.config), pre.config)
        parser.set_defaults(**dests)
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        raise _unknown_flag_error(unknown, parser)
    if ns.megatron_config_path:  # slime's role overrides win over the command line, as in slime
        for dest, value in _role_overrides(ns.megatron_config_path).items():
            setattr(ns, dest, value)
    values: dict[str, dict[str, Any]] = {g: {} for g in GROUPS}
    for dest, value in vars(ns).items():
        if "." in dest and value is not None:
            group, name = dest.split(".", 1)
            values[group][name] = value
    values["rollout"]["sglang_args"] = {**yaml_passed, **passed}

    for (group, name), aliases in VALUE_ALIASES.items():  # a peer's name for the same choice: ours from here on
        if values[group].get(name) in aliases:
            values[group][name] = aliases[values[group][name]]
    apply_allocation(values)  # --allocation fills the sizes it states that no flag gave
    cfg = Config(**{g: cls(**values[g]) for g, cls in GROUPS.items()})
    if validate:
        validate_config(cfg)
    return cfg

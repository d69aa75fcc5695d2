"""Megatron-style flags -> validated frozen dataclasses.

    cfg = parse_config(sys.argv[1:])      # raises ConfigError naming flag, value and fix
    cfg.parallel.tensor_model_parallel_size, cfg.data_parallel_size, cfg.has_rollout_engine

See ``schema.py`` for every flag and ``docs/flags.md`` for the generated reference.
"""

from .flags import build_parser, parse_config
from .schema import Config, parse_duration
from .validate import collect_errors, validate_config

__all__ = ["Config", "build_parser", "collect_errors", "parse_config", "parse_duration", "validate_config"]

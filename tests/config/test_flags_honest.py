"""No flag is accepted and then ignored: every config field is read somewhere outside megatron_rl/config/.

Why: issue 10 found flags (``--fp8-format``, ``--log-probs-chunk-size``,
``--update-weight-disk-dir``, now read by the disk transport) that passed validation and reached nothing. This guard
walks every field of the schema (``iter_fields``) and looks, by AST (so comments,
strings and docstrings do not count), for an attribute access ``.<field_name>`` or a
``getattr(obj, "<field_name>")`` in the Python source of megatron_rl/ (config/
excluded: declaring, parsing and validating a flag is not using it), tools/ and scripts/.

A field read only by a derived property of the schema (``effective_global_batch_size``
reads ``global_batch_size``) counts as read when that property is read outside config/
(transitively: properties reading properties).

The match is by attribute name (``opt = cfg.optimizer; opt.lr`` is found, and so is an
unrelated ``.lr``): it catches a flag read NOWHERE, the failure seen; it does not prove
the right object is read.

``ALLOWED`` lists the justified exceptions. Each reason is checked, not just stated: the
entry's proof runs (a flag refused whenever set must raise ConfigError naming it; a flag
consumed while parsing must visibly set what it claims), and an entry whose field is
read after all, or that names no field, fails, so the list cannot go stale.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from megatron_rl.config.schema import iter_fields

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("megatron_rl", "tools", "scripts")
CONFIG = REPO / "megatron_rl" / "config"
SCHEMA = CONFIG / "schema.py"


def _refused(argv):
    """Proof for a flag that is refused whenever set: parsing ``argv`` raises ConfigError naming it."""
    return ("refused", argv)


# field -> (why nothing outside megatron_rl/config/ needs to read it, proof)
ALLOWED: dict[str, tuple[str, tuple]] = {
    "rollout_num_gpus": (
        "places SGLang engines on their own GPUs (read by the planner, config/placement); no engine this version "
        "runs is placed by it (the embedded engine runs in the driver rank, SGLang servers of "
        "--rollout-engine-urls run where their user started them; the launcher is issue 14), so it is refused "
        "in validation with either",
        _refused(["--rollout-num-gpus", "2"])),
    "rollout_num_gpus_per_engine": (
        "sizes SGLang engines (read by the planner, config/placement); with the embedded engine or external "
        "SGLang servers any value but the default 1 is refused in validation",
        _refused(["--rollout-num-gpus-per-engine", "2"])),
    "sglang_args": (
        "pass-through arguments of SGLang servers we launch; neither the embedded engine nor external servers "
        "(--rollout-engine-urls) start any, so any --sglang-KEY is refused in validation",
        ("refused-as", ["--sglang-mem-fraction-static", "0.5"], "--sglang-mem-fraction-static")),
    "allocation": (
        "consumed while parsing: config/placement.apply_allocation turns it into the parallel-size, placement "
        "and rollout-size flags (which the trainer reads) and refuses flags that disagree with it",
        ("sets", ["--allocation", "megatron:t2p2", "--actor-num-gpus-per-node", "4"],
         lambda cfg: (cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size) == (2, 2))),
}


def _source_files():
    for top in SOURCES:
        for path in sorted((REPO / top).rglob("*.py")):
            if not path.is_relative_to(CONFIG):
                yield path


def _attribute_names(tree: ast.AST) -> set[str]:
    """Every ``x.<name>`` and ``getattr(x, "<name>"[, d])`` under ``tree``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str)):
            names.add(node.args[1].value)
    return names


def _schema_properties() -> dict[str, set[str]]:
    """``property name -> attribute names its body reads``, for every property in schema.py."""
    props: dict[str, set[str]] = {}
    for cls in ast.walk(ast.parse(SCHEMA.read_text())):
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and any(
                    isinstance(d, ast.Name) and d.id == "property" for d in fn.decorator_list):
                props.setdefault(fn.name, set()).update(_attribute_names(fn))
    return props


def read_names() -> set[str]:
    """Attribute names read outside config/, closed over the schema properties they read."""
    read: set[str] = set()
    for path in _source_files():
        read |= _attribute_names(ast.parse(path.read_text(), filename=str(path)))
    props = _schema_properties()
    grew = True
    while grew:
        grew = False
        for name, uses in props.items():
            if name in read and not uses <= read:
                read |= uses
                grew = True
    return read


@pytest.fixture(scope="module")
def read():
    return read_names()


def test_the_scan_sees_the_sources(read):
    files = list(_source_files())
    assert any(p.parts[-2:] == ("megatron", "backend.py") for p in files)
    assert any(p.parts[-2] == "tools" for p in files) and not any(p.is_relative_to(CONFIG) for p in files)
    assert {"initialize", "optimizer_cpu_offload"} <= read
    # derived: global_batch_size is read through the effective_global_batch_size property
    assert "global_batch_size" in _schema_properties()["effective_global_batch_size"]


def test_every_flag_is_read_outside_config(read):
    unread = [f"--{f.name.replace('_', '-')} ({group}.{f.name})" for group, _, f in iter_fields()
              if f.name not in read and f.name not in ALLOWED]
    assert not unread, ("flags accepted but read nowhere outside megatron_rl/config/ (wire them, refuse them, "
                        "or add them to ALLOWED with a checked reason): " + ", ".join(unread))


def test_allow_list_is_current(read):
    fields = {f.name for _, _, f in iter_fields()}
    assert not set(ALLOWED) - fields, f"ALLOWED names no flag: {sorted(set(ALLOWED) - fields)}"
    assert not set(ALLOWED) & read, f"ALLOWED entries that are read after all: {sorted(set(ALLOWED) & read)}"


@pytest.mark.parametrize("field", sorted(ALLOWED))
def test_allow_list_reasons_hold(field, tmp_path, monkeypatch):
    from megatron_rl.config import parse_config
    from megatron_rl.errors import ConfigError
    from megatron_rl.models.hf_tiny import build_tiny_hf_model

    for var in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    reason, proof = ALLOWED[field]
    assert reason.strip()
    argv = ["--hf-checkpoint", build_tiny_hf_model("qwen2", tmp_path / "hf"), *proof[1]]
    if proof[0] in ("refused", "refused-as"):  # refused-as: the flag's spelling is not the field's name
        flag = proof[2] if proof[0] == "refused-as" else "--" + field.replace("_", "-")
        with pytest.raises(ConfigError, match=flag):
            parse_config(argv)
    else:
        assert proof[2](parse_config(argv)), (field, reason)

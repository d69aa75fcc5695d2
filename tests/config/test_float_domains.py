"""Every float flag has a declared domain, and every value outside it is refused in validation.

The walk is over the schema, not a hand-made list: a float flag added later without a domain
fails ``test_every_float_flag_declares_a_domain``, and one with a domain is fed NaN, +-inf and an
out-of-range value here without another line of test code."""

import math
import subprocess
import sys

import pytest

from megatron_rl.config import parse_config
from megatron_rl.config.flags import _base_type
from megatron_rl.config.schema import Domain, flag_name, iter_fields
from megatron_rl.errors import ConfigError
from tests._util import REPO

FLOAT_FIELDS = [(g, f) for g, _, f in iter_fields() if _base_type(f) is float]


def _outside(domain: Domain) -> list[str]:
    """Finite values just outside each finite end (the end itself where it is open)."""
    values = []
    if math.isfinite(domain.lo):
        values.append(repr(domain.lo) if domain.lo_open else repr(domain.lo - 1.0))
    if math.isfinite(domain.hi):
        values.append(repr(domain.hi) if domain.hi_open else repr(domain.hi + 1.0))
    return values


def _cases():
    for _, f in FLOAT_FIELDS:
        domain = f.metadata["domain"]
        for text in ("nan", "inf", "-inf", *(_outside(domain) if domain else [])):
            yield pytest.param(f, text, id=f"{f.name}={text}")


@pytest.fixture
def hf_dir(tiny_hf_models):
    return tiny_hf_models("qwen2")


def test_every_float_flag_declares_a_domain():
    assert FLOAT_FIELDS, "the walk found no float flag: the schema walk is broken"
    assert [flag_name(f) for _, f in FLOAT_FIELDS if f.metadata["domain"] is None] == []


@pytest.mark.parametrize("group, f", FLOAT_FIELDS, ids=[f.name for _, f in FLOAT_FIELDS])
def test_every_default_lies_in_its_domain(group, f):
    if f.default is not None:
        assert f.metadata["domain"].contains(float(f.default)), (flag_name(f), f.default)


@pytest.mark.parametrize("f, text", list(_cases()))
def test_every_float_flag_refuses_nan_inf_and_out_of_domain(hf_dir, f, text):
    domain = f.metadata["domain"]
    with pytest.raises(ConfigError) as exc:
        parse_config(["--hf-checkpoint", hf_dir, f"{flag_name(f)}={text}"])  # '=': argparse takes -inf for a flag
    msg = str(exc.value)
    assert f"{flag_name(f)} " in msg and f"it must lie in {domain}" in msg, msg


def test_domain_notation():
    d = Domain.parse("(0, 1]")
    assert (d.contains(1.0), d.contains(0.0), d.contains(0.5), d.contains(math.nan)) == (True, False, True, False)
    d = Domain.parse("[0, inf)")
    assert d.contains(0.0) and d.contains(1e300) and not d.contains(math.inf) and str(d) == "[0, inf)"
    assert str(Domain.parse("(-inf, inf)")) == "(-inf, inf)" and not Domain.parse("(-inf, inf)").contains(-math.inf)
    for bad in ("0, 1", "(1, 0)", "[x, 1]", "(nan, 1)"):
        with pytest.raises(ValueError):
            Domain.parse(bad)


@pytest.mark.e2e
def test_dry_run_refuses_nan_before_printing_a_plan(hf_dir):
    """--dry-run used to call ``--lr nan`` VALID; it is the same validation, one line, exit 2."""
    proc = subprocess.run([sys.executable, "-m", "megatron_rl.train", "--hf-checkpoint", hf_dir, "--dry-run",
                           "--lr", "nan", "--rollout-temperature", "inf"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert "--lr nan is not a finite number: it must lie in (0, inf)" in proc.stderr
    assert "--rollout-temperature inf is not a finite number: it must lie in [0, inf)" in proc.stderr
    assert "Traceback" not in proc.stderr and "VALID" not in proc.stdout

"""``--multimodal-keys`` (slime's): a JSON map from a modality to the prompt record's column holding it.

Parsed here, in the config layer (stdlib only), so validation refuses a bad value before any worker starts;
the images themselves are read by ``data/images.py``.
"""

from __future__ import annotations

import json
from typing import Any

from megatron_rl.errors import ConfigError

FLAG = "--multimodal-keys"
#: the modalities --multimodal-keys may name, with the record fields they fill
MODALITIES = ("image",)
#: modalities slime or verl read that are not built here, with the reason
REFUSED_MODALITIES = {
    "video": "video inputs are not built here (the model takes images only: docs/vlm.md)",
    "audio": "audio inputs are not built here",
}
_EXAMPLE = "--multimodal-keys '{\"image\": \"images\"}'"


def parse_multimodal_keys(value: "str | dict | None") -> dict[str, str]:
    """``--multimodal-keys``'s map ``{modality: column}`` ({} when unset). Raises ``ConfigError`` naming the flag,
    the value and the fix for text that is not a JSON object, an unknown or unbuilt modality, or a column that is
    not a non-empty string."""
    if value is None or value == "" or value == {}:
        return {}
    parsed: Any = value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{FLAG} {value!r}: not JSON ({exc.msg}); give a JSON object from modality to the "
                              f"prompt column, e.g. {_EXAMPLE}") from None
    if not isinstance(parsed, dict) or not parsed:
        raise ConfigError(f"{FLAG} {value!r}: expected a non-empty JSON object from modality to the prompt column, "
                          f"e.g. {_EXAMPLE}")
    for modality, column in parsed.items():
        if modality in REFUSED_MODALITIES:
            raise ConfigError(f"{FLAG} {value!r}: modality {modality!r}: {REFUSED_MODALITIES[modality]}; "
                              "keep only \"image\"")
        if modality not in MODALITIES:
            raise ConfigError(f"{FLAG} {value!r}: unknown modality {modality!r}; the modalities are "
                              f"{', '.join(MODALITIES)} (e.g. {_EXAMPLE})")
        if not isinstance(column, str) or not column:
            raise ConfigError(f"{FLAG} {value!r}: modality {modality!r} maps to {column!r}; give the name of the "
                              "prompt column that holds the images (a non-empty string)")
    return dict(parsed)

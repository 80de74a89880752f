"""Size limits the strategies draw within, raised or lowered from outside (``--smqa-limits L=130,H=20``)."""

from __future__ import annotations

# what a user writes -> the ``strategies.cases`` argument it sets
NAMES = {"B": "max_b", "S": "max_s", "Skv": "max_skv", "H": "max_h", "L": "max_l", "work": "max_work"}


def parse_limits(text: str, *, where: str = "--smqa-limits") -> dict:
    """``"L=130,H=20"`` -> ``{"max_l": 130, "max_h": 20}``; ValueError naming ``where`` and the allowed names."""
    out = {}
    for item in (x.strip() for x in (text or "").split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in NAMES:
            raise ValueError(f"{where}: {item!r} is not SIZE=N with SIZE one of {', '.join(NAMES)}")
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
        out[NAMES[name]] = int(value)
    return out

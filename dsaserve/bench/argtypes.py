"""argparse types the benchmark scripts share."""

from __future__ import annotations

import argparse


def positive_ints(text: str) -> list[int]:
    """"1,16,64" → [1, 16, 64]; an argparse error unless every value is an integer ≥ 1."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}"
                                         ) from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values

"""What the simulator's inputs share: argument checks that raise ValueError in words, and piecewise-linear curves."""

from __future__ import annotations

import bisect
import math


def need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def finite(value, lo: float = 0.0, strict: bool = False) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (value > lo if strict else value >= lo))


class Piecewise:
    """Piecewise-linear through sorted (x, y) points; linear extrapolation past either end (never below 0)."""

    def __init__(self, points):
        self.points = list(points)
        self.xs = [p[0] for p in self.points]
        self.cache: dict = {}

    def __call__(self, x: float) -> float:
        points = self.points
        if len(points) == 1:
            return points[0][1]
        i = min(max(bisect.bisect_right(self.xs, x) - 1, 0), len(points) - 2)
        (x0, y0), (x1, y1) = points[i], points[i + 1]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))

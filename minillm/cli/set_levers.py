"""`--set LEVER=VALUE`: the levers every command takes, read by minillm/levers.py; a bad pair stops the command."""

from __future__ import annotations

from ..levers import parse_levers


def _parse_levers(pairs: list[str]) -> dict:
    """['kv_cache=false', 'max_num_seqs=8'] -> {'kv_cache': False, 'max_num_seqs': 8} (minillm/levers.py reads each
    value by its field's type); a bad pair stops the command with the reason."""
    try:
        return parse_levers(pairs)
    except ValueError as error:
        raise SystemExit(str(error)) from None

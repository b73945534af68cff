"""StatelessProposer: the base of the proposers that keep nothing per sequence (n-gram lookup, the self-draft)."""

from __future__ import annotations


class StatelessProposer:
    """A proposer that keeps nothing per sequence: nothing to trim after a pass, nothing to free."""

    def accepted(self, seq: "Sequence", num_before: int, num_kept: int) -> None:
        pass

    def release(self, seq: "Sequence") -> None:
        pass

"""The fleet commands' replica profile: loaded from JSON or measured here (and saved), described in one line."""

from __future__ import annotations

from pathlib import Path

DEFAULT_PROFILE = Path("artifacts/fleet_profile.json")


def load_or_measure_profile(path: str | None, max_num_seqs: int, remeasure: bool = False):
    from ..fleet.profile import measure_profile
    from ..fleet.replica_profile import ReplicaProfile

    target = Path(path) if path else DEFAULT_PROFILE
    if target.is_file() and not remeasure:
        profile = ReplicaProfile.load(target)
        print(f"profile: {target} ({profile.conditions.get('how', 'given')})")
        if profile.max_measured_batch >= max_num_seqs:
            return profile
        print(f"it stops at batch {profile.max_measured_batch} < --max-num-seqs {max_num_seqs}: measuring again")
    if path and not remeasure and not target.is_file():
        raise FileNotFoundError(f"--profile {path}: no such file")
    sizes = sorted({1, 2, 4, 8, 16, max_num_seqs})
    sizes = [b for b in sizes if b <= max(16, max_num_seqs)]
    print(f"measuring a replica profile (default model, 1 thread, batch sizes {sizes}) ...")
    profile = measure_profile({}, batch_sizes=sizes, threads=1)
    profile.save(target)
    print(f"saved {target}")
    return profile


def describe_profile(profile, max_num_seqs: int) -> str:
    decode = ", ".join(f"{b}: {s * 1000:.0f}" for b, s in profile.decode_points)
    prefill = ", ".join(f"{n}: {s * 1000:.0f}" for n, s in profile.prefill_points)
    return (f"decode step ms by batch {{{decode}}}; prefill ms by prompt tokens {{{prefill}}}; "
            f"start-up {profile.startup_s:.1f} s; one replica at batch {max_num_seqs}: "
            f"{profile.tokens_per_s(max_num_seqs):.0f} output tok/s")

"""Speculative decoding: proposers guess the next tokens cheaply, the verifier keeps what the
target model agrees with (greedy) or what preserves its distribution (sampling)."""

"""Triton kernels, one per file, each beside its pure-torch reference and its launcher.

On the CPU they run under the Triton interpreter: set TRITON_INTERPRET=1 *before*
importing triton (tests and `minillm doctor` do this in a fresh process).
"""

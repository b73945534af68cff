"""Notebook helpers for the course: widgets, plotly figures, check_* functions (one module per
lab, common.py shared). The instructor pipeline (build, autograde) is not here: grading/ at the
repository root."""

"""Notebook helpers for the course: widgets, plotly figures, check_* functions, and the course
pipeline (build: masters -> labs/ + solutions/; grading: nbgrader autograde)."""

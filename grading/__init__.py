"""The instructor pipeline of the minillm course: importable from the repository root, not part of
the ``minillm`` package that learners install and read.

- :mod:`grading.build`     masters (grading/source) -> labs/ + solutions/  (``python -m grading.build [--check]``)
- :mod:`grading.grader`    autograde submissions with nbgrader, one row per (student, lab)
- :mod:`grading.execute`   nbgrader's Execute step, surviving a dead kernel and timing each cell
- :mod:`grading.feedback`  a feedback page per graded notebook, without the hidden tests
- :mod:`grading.screen`    the source screen of a student's solution cell (outside the kernel)
- :mod:`grading.guard`     the runtime guard inside the graded kernel (the graded copy's first cell)

``grading/autograde.py`` is the command line of :mod:`grading.grader`; ``grading/nbgrader_config.py``
is the nbgrader course configuration. This module imports nothing: the graded kernel imports
:mod:`grading.guard` and nothing else of the pipeline.
"""

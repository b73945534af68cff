"""The instructor pipeline of the minillm course: importable from the repository root, not part of
the ``minillm`` package that learners install and read.

- :mod:`grading.build`       masters (grading/source) -> labs/ + solutions/  (``python -m grading.build [--check]``)
- :mod:`grading.grader`      autograde submissions, one row per (student, lab): sandboxed runs, then nbgrader
- :mod:`grading.execute`     one graded copy run in step: the master's cells in the grader's kernel, the
                             student's in the sandbox; each cell timed, a dead kernel survived
- :mod:`grading.sandbox`     the sandbox a submission runs in (bubblewrap, limits, one tree that dies whole)
- :mod:`grading.remote`      the grader's side of the sandbox: learner names as data or handles, calls as data
- :mod:`grading.sandbox_runner`  the submission's side, inside the sandbox (a copy, with grading/wire.py)
- :mod:`grading.wire`        the data-only channel between them (JSON and raw tensor bytes, no pickle)
- :mod:`grading.references`  what the lab's exercises rebuild, stubbed in the sandbox's copy of minillm
- :mod:`grading.similarity`  solution cells close to a reference, the published solution or each other
- :mod:`grading.feedback`    a feedback page per graded notebook, without the hidden tests
- :mod:`grading.course`      nbgrader plug-ins of the course config: a release without model answers, a collect
                             that refuses a submission another account made
- :mod:`grading.hub`         a class on JupyterHub on one machine (``make class``, ``python -m grading.hub.classroom``)

``grading/autograde.py`` is the command line of :mod:`grading.grader`; ``grading/nbgrader_config.py``
is the nbgrader course configuration. This module imports nothing: the graded kernel imports
:mod:`grading.remote` (and through it :mod:`grading.sandbox` and :mod:`grading.wire`) only.
"""

"""nbgrader course configuration for minillm (instructors only).

Run nbgrader from this directory (`cd grading && nbgrader generate_assignment 01_prefill_decode`)
or use the scripts that wrap it: `python -m grading.build` (labs/ and solutions/) and
`python grading/autograde.py SUBMISSIONS_DIR` (grades). Both build a throwaway course in a
temporary directory from this file, so nothing generated lands in the repository.
"""
import os
import re
import sys

c = get_config()  # noqa: F821 (injected by traitlets when nbgrader loads this file)

GRADING_DIR = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.path.join(GRADING_DIR, "source")
# The grading pipeline (grading.execute below) is a package of the repository root, not of minillm.
REPO_ROOT = os.path.dirname(GRADING_DIR)
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

# The labs are the instructor masters under source/NN_topic/NN_topic.ipynb; a new lab is picked
# up by adding its master, nothing to register here.
LABS = sorted(
    name
    for name in (os.listdir(SOURCE_DIR) if os.path.isdir(SOURCE_DIR) else [])
    if re.fullmatch(r"\d\d_[a-z0-9_]+", name)
    and os.path.isfile(os.path.join(SOURCE_DIR, name, name + ".ipynb"))
)

c.CourseDirectory.course_id = "minillm"
c.CourseDirectory.root = GRADING_DIR
c.CourseDirectory.source_directory = "source"
c.CourseDirectory.release_directory = "release"
c.CourseDirectory.submitted_directory = "submitted"
c.CourseDirectory.autograded_directory = "autograded"
c.CourseDirectory.feedback_directory = "feedback"
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(GRADING_DIR, "gradebook.db")
c.CourseDirectory.ignore = [".ipynb_checkpoints", "*.pyc", "__pycache__", "feedback", "*.db"]

# The labs load a 135M-parameter model on CPU and measure it: a cell may run for minutes on a
# small laptop. Autograding runs in quick mode (MINILLM_QUICK=1, set by grading.grader).
c.Execute.timeout = 900
c.Execute.startup_timeout = 120
c.Execute.interrupt_on_timeout = True

# Keep the stub that nbgrader writes into solution cells (the student copies in labs/ show it).
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"

# A plotly figure or a widget-heavy cell can print a lot; the graded copy does not need it all.
c.LimitOutput.max_lines = 1000

# Autograding never runs a kernel here: python grading/autograde.py runs each submission first (the
# student's cells in a sandbox, the tests in the grader's kernel, grading.execute) and nbgrader then
# scores the outputs it recorded (grading.execute.ReplayOutputs in place of nbgrader's Execute). A plain
# `nbgrader autograde` would run student code with the instructor's rights: it finds no outputs here.
from nbconvert.preprocessors import ClearMetadataPreprocessor  # noqa: E402
from nbgrader.preprocessors import AssignLatePenalties, CheckCellMetadata, IgnorePattern, LimitOutput, SaveAutoGrades  # noqa: E402

from grading.execute import ReplayOutputs  # noqa: E402

c.Autograde.autograde_preprocessors = [
    ReplayOutputs, IgnorePattern, ClearMetadataPreprocessor, LimitOutput, SaveAutoGrades, AssignLatePenalties,
    CheckCellMetadata,
]

# A class on a shared machine (README.md, "A class on JupyterHub"; grading/course.py): the release replaces the
# model answers the masters hold, and collect takes a submission only from the account it names.
from nbgrader.converters import GenerateAssignment  # noqa: E402

from grading.course import OwnerCheckedCollect, ReleaseWithoutModelAnswers  # noqa: E402

c.GenerateAssignment.preprocessors = [
    ReleaseWithoutModelAnswers, *GenerateAssignment.class_traits()["preprocessors"].default()]
c.ExchangeFactory.collect = OwnerCheckedCollect

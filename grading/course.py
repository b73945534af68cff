"""nbgrader plug-ins that grading/nbgrader_config.py installs in the course, for a class on a shared machine.

- :class:`ReleaseWithoutModelAnswers`: ``nbgrader generate_assignment`` run in the course directory releases a
  master with its model answers replaced by "YOUR ANSWER HERE", as ``make labs`` writes labs/ (the masters keep
  them for solutions/). Without it, the release of a lab with explain questions would hand out their answers.
- :class:`OwnerCheckedCollect`: ``nbgrader collect`` refuses a submission that another account made. A
  submission in the exchange is a folder ``inbound/<student>+<lab>+<time>+<random>`` that ``nbgrader submit``
  names after the student it is told (``--student`` is any name), and the inbound folder is writable by every
  account; nbgrader 0.9 only warns when the folder's owner differs from that name, then collects it. Here a
  submission is taken only when the folder and everything in it belong to the student it names (or to the
  account collecting, or root: they could write ``submitted/`` themselves), and when it holds only folders and
  regular files: a symbolic link (which collect, running with the instructor's rights, would follow to, say, a
  master with its solutions) or a FIFO is refused too. A refused submission is logged with the name it claims
  and the owner, and never competes: the student's own latest submission is collected in its place.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

from nbgrader.exchange.default.collect import ExchangeCollect
from nbgrader.preprocessors import NbGraderPreprocessor
from nbgrader.utils import ignore_patterns

try:
    import pwd
except ImportError:  # Windows: nbgrader's exchange is not used there
    pwd = None

_REFUSED = "\0refused\0"  # a username no account has: a refused record is a group of its own, never the student's


class ReleaseWithoutModelAnswers(NbGraderPreprocessor):
    """Replace each ``### BEGIN MODEL ANSWER`` ... ``### END MODEL ANSWER`` region by MODEL_ANSWER_STUB."""

    def preprocess(self, nb, resources):
        from grading.build import MODEL_ANSWER_STUB, model_answer_regions

        for cell in nb.cells:
            regions = model_answer_regions(cell.source)
            if regions:
                lines = cell.source.split("\n")
                for first, last in reversed(regions):
                    lines[first:last + 1] = [MODEL_ANSWER_STUB]
                cell.source = "\n".join(lines)
        return nb, resources


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def _entries(folder: str):
    """(path relative to ``folder``, lstat) of everything below it; OSError when a part cannot be read."""
    def fail(error: OSError):
        raise error

    for parent, dirs, files in os.walk(folder, onerror=fail):
        for name in sorted(dirs + files):
            full = os.path.join(parent, name)
            yield os.path.relpath(full, folder), os.lstat(full)


def _not_plain(folder: str, relative: str, info: os.stat_result) -> str | None:
    if stat.S_ISLNK(info.st_mode):
        return f"holds a symbolic link, {relative} -> {os.readlink(os.path.join(folder, relative))}"
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
        return f"holds {relative}, neither a file nor a folder"
    return None


def refusal(path: str, student: str) -> str | None:
    """Why the submission folder ``path``, which says it is ``student``'s, is not collected; None to collect it."""
    if pwd is None:
        return None
    trusted = {student, _owner(os.geteuid()), "root"}
    claim = f"it claims to be submitted by {student} but"
    try:
        top = os.lstat(path)
        if not stat.S_ISDIR(top.st_mode):
            return f"{claim} is not a folder"
        if _owner(top.st_uid) not in trusted:
            return f"{claim} was made by {_owner(top.st_uid)}"
        for relative, info in _entries(path):
            reason = _not_plain(path, relative, info)
            if reason is not None:
                return f"{claim} {reason}"
            if _owner(info.st_uid) not in trusted:
                return f"{claim} its file {relative} belongs to {_owner(info.st_uid)}"
    except OSError as exc:
        return f"it cannot be read ({exc})"
    return None


class OwnerCheckedCollect(ExchangeCollect):
    """nbgrader's collect, refusing each submission that :func:`refusal` refuses (logged as an error).

    The student owns the folder and can change it while collect runs: nbgrader's copy (which follows links, with
    your rights) reads a snapshot instead, copied with links kept as links and checked again.
    """

    def _path_to_record(self, path):
        record = super()._path_to_record(path)
        reason = refusal(path, record["username"])
        if reason is not None:
            self.log.error("Refused submission %s: %s; %s's own latest submission is collected instead, if any.",
                           record["filename"], reason, record["username"])
            record.update(username=_REFUSED + record["filename"], refused=True)
        return record

    def copy_files(self):
        self.src_records = [record for record in self.src_records if not record.get("refused")]
        super().copy_files()

    def do_copy(self, src, dest, log=None):
        with tempfile.TemporaryDirectory(prefix="minillm-collect-") as scratch:
            snapshot = os.path.join(scratch, "submission")
            try:
                shutil.copytree(src, snapshot, symlinks=True, ignore=ignore_patterns(
                    exclude=self.coursedir.ignore, include=self.coursedir.include,
                    max_file_size=self.coursedir.max_file_size))
                reason = next(filter(None, (_not_plain(snapshot, *entry) for entry in _entries(snapshot))), None)
            except (OSError, shutil.Error) as exc:
                reason = f"it cannot be copied ({exc})"
            if reason is not None:
                self.log.error("Refused submission %s: it %s; nothing collected from it.", os.path.basename(src),
                               reason.removeprefix("it "))
                return
            super().do_copy(snapshot, dest, log)

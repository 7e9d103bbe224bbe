"""The course's exercise convention, and an in-process notebook executor for the exercise tests.

An exercise is a code cell whose solution lines sit between a line `### BEGIN SOLUTION` and a line
`### END SOLUTION` (nbgrader's markers); its metadata `exercise.wrong` holds a plausible wrong answer. The next
code cell is its check. The learner's edition (`scripts/make_exercises.py`) replaces each marked block with
`# YOUR CODE HERE` / `raise NotImplementedError()` and clears the outputs; `tests/test_exercises.py` plants the
wrong answer in each exercise and requires its check to fail.
"""

import copy
import os
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import nbformat

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
STUB = "# YOUR CODE HERE\nraise NotImplementedError()"
SKIP = "# NBVAL_SKIP"
NUMBERED = re.compile(r"^(\d\d)_")


def figures_dir() -> Path:
    """Where a notebook run saves its figures: `build/figures/` of the checkout (git-ignored), so that running
    the course leaves the tree clean; `figures/` holds the committed copies the README shows."""
    out = Path(__file__).resolve().parents[2] / "build" / "figures"
    out.mkdir(parents=True, exist_ok=True)
    return out


def number_of(path: Path) -> int | None:
    """The chapter number of `NN_topic.ipynb`, or None for a name without one."""
    m = NUMBERED.match(path.name)
    return int(m.group(1)) if m else None


def is_exercise(cell) -> bool:
    return cell.cell_type == "code" and "wrong" in cell.metadata.get("exercise", {})


def grade_id(cell) -> str:
    return cell.metadata.get("nbgrader", {}).get("grade_id", "?")


def replace_solution(source: str, replacement: str) -> str:
    """`source` with every BEGIN..END block (markers included) replaced by `replacement`, re-indented to the
    BEGIN line's indentation. Raises ValueError on unbalanced markers."""
    out, inside, found = [], False, False
    body = textwrap.dedent(replacement).strip("\n").splitlines()
    for line in source.splitlines():
        stripped = line.strip()
        if stripped == BEGIN:
            if inside:
                raise ValueError(f"nested {BEGIN!r}")
            inside, found = True, True
            indent = line[: len(line) - len(line.lstrip())]
            out.extend(indent + b if b else b for b in body)
        elif stripped == END:
            if not inside:
                raise ValueError(f"{END!r} without {BEGIN!r}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{BEGIN!r} without {END!r}")
    if not found:
        raise ValueError(f"no {BEGIN!r} / {END!r} block")
    return "\n".join(out)


def has_markers(source: str) -> bool:
    return any(line.strip() in (BEGIN, END) for line in source.splitlines())


def learner_edition(nb):
    """A copy of `nb` for the learner: solutions stubbed, outputs and counts cleared, the wrong answers gone."""
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        cell.metadata.pop("exercise", None)
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        if has_markers(cell.source):
            cell.source = replace_solution(cell.source, STUB)
    return nb


def exercises_of(nb) -> list[tuple[int, int]]:
    """(exercise cell index, check cell index) for each exercise of `nb`; raises ValueError where an exercise
    has no code cell after it, or a cell carries markers without the `exercise.wrong` metadata."""
    pairs = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and has_markers(cell.source) != is_exercise(cell):
            raise ValueError(f"cell {i} ({grade_id(cell)}): solution markers and exercise.wrong come together")
        if is_exercise(cell):
            nxt = next((j for j in range(i + 1, len(nb.cells)) if nb.cells[j].cell_type == "code"), None)
            if nxt is None:
                raise ValueError(f"exercise {grade_id(cell)} has no check cell after it")
            pairs.append((i, nxt))
    return pairs


# ---------------------------------------------------------------------------------------------------------------
@dataclass
class CellResult:
    error: BaseException | None  # None when the cell ran cleanly
    stdout: str


class NotebookShell:
    """Runs notebook cells in one in-process IPython shell, as a kernel would (magics included), with figures
    going to matplotlib's Agg backend and nothing displayed. `snapshot` / `restore` let a caller try a cell on a
    copy of the namespace (a shallow copy: names are restored, objects a cell mutated in place are not)."""

    def __init__(self, cwd: Path):
        # matplotlib.use, not MPLBACKEND: the environment would reach every process started after this one, the
        # kernels of `pytest --nbval` among them, whose figures would then never be displayed
        import matplotlib

        matplotlib.use("Agg")
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets.config import Config

        config = Config()
        config.HistoryManager.enabled = False
        self.shell = InteractiveShell(config=config)
        self.shell.register_magic_function(lambda line: None, "line", "matplotlib")  # the backend stays Agg
        self.cwd = cwd

    def run(self, source: str) -> CellResult:
        from IPython.utils.capture import capture_output

        if source.lstrip().startswith(SKIP):
            return CellResult(None, "")
        import matplotlib.pyplot as plt

        here = os.getcwd()
        os.chdir(self.cwd)
        try:
            with capture_output(display=True) as cap:
                result = self.shell.run_cell(source, store_history=False, silent=False)
            plt.close("all")
        finally:
            os.chdir(here)
        return CellResult(result.error_before_exec or result.error_in_exec, cap.stdout)

    def snapshot(self) -> dict:
        return dict(self.shell.user_ns)

    def restore(self, saved: dict) -> None:
        self.shell.user_ns.clear()
        self.shell.user_ns.update(saved)

    def close(self) -> None:
        self.shell.cleanup()
        self.shell.clear_instance()


def read(path: Path):
    return nbformat.read(path, as_version=4)

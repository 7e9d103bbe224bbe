"""The course as a workbook: every chapter 01-16 has exercises whose checks catch a wrong answer, the learner's
edition stops at its first exercise, and each chapter closes with review questions.

Each notebook's code cells run in order in one in-process IPython shell (cwd notebooks/, figures to Agg, cells
marked `# NBVAL_SKIP` skipped). At each exercise the planted wrong answer (`exercise.wrong`) and the check cell
run first on a copy of the namespace and must raise AssertionError; then the real cell and its check run.
The notebook runs only as far as its last check: `pytest --nbval` runs every cell anyway.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.notebooks import (
    NotebookShell,
    exercises_of,
    grade_id,
    number_of,
    read,
    replace_solution,
)

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHAPTERS = [p for p in NOTEBOOKS if number_of(p) is not None and 1 <= number_of(p) <= 16]
COURSE = [p for p in NOTEBOOKS if number_of(p) is not None and number_of(p) >= 1]  # 17 too, when present
MIN_EXERCISES = 30
QUESTION = re.compile(r"^\d+\.\s", re.MULTILINE)  # a numbered item of the Questions cell


def run_or_fail(shell: NotebookShell, source: str, where: str) -> None:
    result = shell.run(source)
    if result.error is not None:
        pytest.fail(f"{where} raised {type(result.error).__name__}: {result.error}\n{result.stdout[-2000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("path", COURSE, ids=lambda p: p.name)
def test_wrong_answers_fail_their_checks(path):
    nb = read(path)
    pairs = exercises_of(nb)
    if not pairs:
        pytest.fail(f"{path.name}: no exercises (every chapter 01-16 has at least one)")
    checks = dict(pairs)
    shell = NotebookShell(cwd=path.parent)
    try:
        for i, cell in enumerate(nb.cells[: pairs[-1][1] + 1]):
            if cell.cell_type != "code":
                continue
            if i in checks:
                name, check = grade_id(cell), nb.cells[checks[i]].source
                saved = shell.snapshot()
                wrong = shell.run(replace_solution(cell.source, cell.metadata["exercise"]["wrong"]))
                if wrong.error is None:
                    wrong = shell.run(check)
                shell.restore(saved)
                if not isinstance(wrong.error, AssertionError):
                    got = "passed" if wrong.error is None else f"raised {type(wrong.error).__name__}: {wrong.error}"
                    pytest.fail(
                        f"{path.name} {name}: the check must fail with AssertionError on the wrong answer, {got}"
                    )
            run_or_fail(shell, cell.source, f"{path.name} cell {i} ({grade_id(cell)})")
    finally:
        shell.close()


@pytest.fixture(scope="module")
def edition(tmp_path_factory) -> Path:
    """The learner's edition, written by the script a learner runs, beside a copy of notebooks/' neighbours
    (figures are read as ../figures)."""
    out = tmp_path_factory.mktemp("course") / "exercises"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_exercises.py"), "--out", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    (out.parent / "figures").symlink_to(ROOT / "figures")
    return out


def test_edition_has_every_notebook_and_no_solution(edition):
    names = sorted(p.name for p in edition.glob("*.ipynb"))
    assert names == [p.name for p in NOTEBOOKS], f"the edition holds {names}"
    for path in edition.glob("*.ipynb"):
        for i, cell in enumerate(read(path).cells):
            assert "exercise" not in cell.metadata, f"{path.name} cell {i}: the wrong answer is in the edition"
            assert "### BEGIN SOLUTION" not in cell.source, f"{path.name} cell {i}: a solution is in the edition"
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name} cell {i}: outputs kept"


@pytest.mark.slow
@pytest.mark.parametrize("path", COURSE, ids=lambda p: p.name)
def test_learner_edition_stops_at_first_exercise(path, edition):
    nb, stub = read(path), read(edition / path.name)
    pairs = exercises_of(nb)
    if not pairs:
        pytest.fail(f"{path.name}: no exercises (every chapter 01-16 has at least one)")
    assert stub.cells[0].metadata.get("edition_path"), f"edition {path.name}: no first cell putting exercises/ first"
    first, check = pairs[0][0] + 1, pairs[0][1] + 1  # after that first cell
    assert "raise NotImplementedError()" in stub.cells[first].source, f"{path.name}: the first exercise is not stubbed"
    shell = NotebookShell(cwd=edition)
    try:
        for i, cell in enumerate(stub.cells[1:first], start=1):  # (this process already imported minivllm)
            if cell.cell_type == "code":
                run_or_fail(shell, cell.source, f"edition {path.name} cell {i}")
        result = shell.run(stub.cells[first].source)
        if result.error is None:
            result = shell.run(stub.cells[check].source)
        assert isinstance(result.error, NotImplementedError), (
            f"edition {path.name}: the first exercise ({grade_id(nb.cells[first])}) must stop with "
            f"NotImplementedError, got {type(result.error).__name__ if result.error else 'no error'}"
        )
    finally:
        shell.close()


def test_course_has_enough_exercises():
    counts = {p.name: len(exercises_of(read(p))) for p in COURSE}
    assert sum(counts.values()) >= MIN_EXERCISES, f"{sum(counts.values())} exercises < {MIN_EXERCISES}: {counts}"


@pytest.mark.parametrize("path", COURSE, ids=lambda p: p.name)
def test_exercise_metadata(path):
    nb = read(path)
    for i, j in exercises_of(nb):
        ex, check = nb.cells[i].metadata.get("nbgrader", {}), nb.cells[j].metadata.get("nbgrader", {})
        name = ex.get("grade_id", "")
        assert re.fullmatch(rf"ex{number_of(path):02d}_\w+", name), f"{path.name} cell {i}: grade_id {name!r}"
        assert ex.get("solution") is True and ex.get("grade") is False, f"{path.name} {name}: nbgrader fields"
        assert check.get("grade_id") == f"{name}_check", f"{path.name} {name}: the next code cell is not its check"
        assert check.get("grade") is True and check.get("locked") is True, f"{path.name} {name}_check: nbgrader"


@pytest.mark.parametrize("path", COURSE, ids=lambda p: p.name)
def test_chapter_ends_with_questions(path):
    cells = read(path).cells
    heads = [(i, c.source.lstrip()) for i, c in enumerate(cells) if c.cell_type == "markdown"]
    questions = [i for i, text in heads if text.startswith("## Questions")]
    assert questions, f'{path.name}: no "## Questions" section'
    q = questions[-1]
    later = [text.splitlines()[0] for i, text in heads if i > q and text.startswith("#")]
    assert all("self-check" in h.lower() for h in later), f"{path.name}: {later} after the questions"
    items = [item.strip() for item in QUESTION.split(cells[q].source)[1:]]
    assert 3 <= len(items) <= 6, f"{path.name}: {len(items)} numbered questions (3-6 wanted)"
    for item in items:
        assert "→" in item, f"{path.name}: question {item!r} does not point (→ §N) to where the chapter answers it"


def test_shell_leaves_the_environment_alone(tmp_path, monkeypatch):
    """The shell draws to Agg in this process only: `pytest --nbval` starts its kernels after these tests, from
    this process's environment, and a kernel with MPLBACKEND=Agg displays no figure (its cells' image outputs
    would then differ from the committed ones)."""
    monkeypatch.delenv("MPLBACKEND", raising=False)
    shell = NotebookShell(cwd=tmp_path)
    try:
        assert shell.run("import matplotlib; backend = matplotlib.get_backend()").error is None
        assert shell.snapshot()["backend"].lower() == "agg"
        assert "MPLBACKEND" not in os.environ
    finally:
        shell.close()

"""The learner's edition of the package (scripts/make_exercises.py, notebooks/exercises.toml) and the course's
checks (tests/course/): the edition stubs every listed function with its message and at least 600 lines in all;
a notebook run from exercises/ imports that copy; with the reference's bodies filled back in, every course check
passes on it; and each planted wrong answer (tests/course/wrong_answers.py) fails its chapter's check with a
message naming the function."""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from course.wrong_answers import WRONG
from helpers.course_edition import ROOT, body_of, exercises, fill_package, find_function, stub_source

MIN_LINES = 600


def run_course(edition: Path, chapter: str | None, *extra: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = dict(os.environ, MINIVLLM_EDITION=str(edition))
    env["PYTHONPATH"] = os.pathsep.join([str(edition), str(ROOT / "tests")])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=short", str(ROOT / "tests" / "course")]
    if chapter:
        cmd += ["-k", f"test_{chapter}_"]
    return subprocess.run([*cmd, *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def edition(tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("edition") / "exercises"
    made = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "make_exercises.py"), "--out", str(out)],
        check=True,
        capture_output=True,
        text=True,
    )
    return out, made.stdout


def test_list_matches_the_package_and_notebooks():
    listed = exercises()
    assert len({(e.module, e.qualname) for e in listed}) == len(listed), "an exercise is listed twice"
    for e in listed:
        assert (ROOT / "notebooks" / e.notebook).exists(), f"{e.qualname}: no notebook {e.notebook}"
        body_of((ROOT / e.module).read_text(), e.qualname)  # raises if the function is gone or moved


def test_edition_stubs_every_listed_function(edition):
    out, printed = edition
    listed = exercises()
    total = int(printed.strip().splitlines()[-1].split()[2])  # "N functions, L lines to write -> ..."
    assert total >= MIN_LINES, f"the learner writes {total} lines, fewer than {MIN_LINES}:\n{printed}"
    for chapter in sorted({e.chapter for e in listed}):
        assert f"chapter {chapter}:" in printed, f"the script prints no count for chapter {chapter}"
    for e in listed:
        text = (out / e.module).read_text()
        assert body_of(text, e.qualname) == stub_source(e), f"{e.qualname}: not stubbed in the edition"
        ours, reference = (
            find_function(ast.parse(text), e.qualname),
            find_function(ast.parse((ROOT / e.module).read_text()), e.qualname),
        )
        assert ast.get_docstring(ours) == ast.get_docstring(reference), f"{e.qualname}: the docstring must be kept"
        assert ast.dump(ours.args) == ast.dump(reference.args), f"{e.qualname}: the signature changed"


CALL_EACH = """
import inspect, importlib, json, sys
done = []
for module, qualname in json.loads(sys.argv[1]):
    obj = importlib.import_module(module.removesuffix(".py").replace("/", "."))
    for part in qualname.split("."):
        obj = getattr(obj, part)
    fn = getattr(obj, "fn", obj)  # a Triton kernel: the Python function under @triton.jit
    params = list(inspect.signature(fn).parameters.values())
    args = {p.name: None for p in params if p.default is p.empty and p.kind is not p.VAR_KEYWORD
            and p.kind is not p.VAR_POSITIONAL}
    try:
        fn(**args)
        done.append([qualname, "returned"])
    except NotImplementedError as e:
        done.append([qualname, str(e)])
print(json.dumps(done))
"""


def test_each_stub_raises_its_message(edition):
    out, _ = edition
    listed = exercises()
    env = dict(os.environ, PYTHONPATH=str(out))
    spec = json.dumps([[e.module, e.qualname] for e in listed])
    result = subprocess.run(
        [sys.executable, "-c", CALL_EACH, spec], cwd=out, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    got = dict(map(tuple, json.loads(result.stdout.strip().splitlines()[-1])))
    for e in listed:
        assert got[e.qualname] == e.message, f"{e.qualname}: raised {got[e.qualname]!r}, expected {e.message!r}"
        assert e.chapter in e.message and e.notebook in e.message


def test_a_notebook_in_exercises_imports_the_edition(edition):
    """A kernel started in exercises/ with the reference first on PYTHONPATH (the worst case; an editable install
    comes later on the path) still imports the edition, through the notebook's first cell."""
    import nbformat
    from nbclient import NotebookClient

    out, _ = edition
    nb = nbformat.read(out / "01_rmsnorm.ipynb", as_version=4)
    nb.cells = nb.cells[:1] + [nbformat.v4.new_code_cell("import minivllm; print(minivllm.__file__)")]
    os.environ["PYTHONPATH"], saved = os.pathsep.join([str(ROOT), str(ROOT / "tests")]), os.environ.get("PYTHONPATH")
    try:
        NotebookClient(nb, kernel_name="python3", timeout=120, resources={"metadata": {"path": str(out)}}).execute()
    finally:
        os.environ["PYTHONPATH"] = saved if saved is not None else ""
    assert nb.cells[0].outputs[0]["text"].strip() == f"minivllm imported from {out.name}/minivllm", nb.cells[0].outputs
    assert Path(nb.cells[1].outputs[0]["text"].strip()) == out / "minivllm" / "__init__.py"


@pytest.fixture(scope="module")
def filled(edition, tmp_path_factory) -> Path:
    out, _ = edition
    copy = tmp_path_factory.mktemp("filled")
    shutil.copytree(out / "minivllm", copy / "minivllm")
    fill_package(copy, exercises())
    return copy


def test_filled_edition_matches_the_reference(filled):
    for e in exercises():
        got, want = (filled / e.module).read_text(), (ROOT / e.module).read_text()
        assert got == want, f"{e.module}: filling the bodies back in did not give the reference's file"


@pytest.mark.slow
def test_course_checks_pass_on_the_filled_edition(filled):
    result = run_course(filled, None)
    assert result.returncode == 0, result.stdout[-5000:]
    assert f"course checks against {filled / 'minivllm'}" in result.stdout or " passed" in result.stdout


@pytest.mark.slow
def test_each_wrong_answer_fails_its_chapter(filled):
    """Each planted wrong answer, in the filled edition, fails its chapter's checks with a message naming the
    function (helpers/course_plant.py: one process per chapter plants its wrong answers one after another)."""
    listed = {e.qualname: e for e in exercises()}
    assert {w.qualname for w in WRONG} == set(listed), (
        f"exercises without a planted wrong answer: {sorted(set(listed) - {w.qualname for w in WRONG})}"
    )
    env = dict(os.environ, MINIVLLM_EDITION=str(filled))
    env["PYTHONPATH"] = os.pathsep.join([str(filled), str(ROOT / "tests")])
    problems = []
    for chapter in sorted({e.chapter for e in listed.values()}):
        indices = [i for i, w in enumerate(WRONG) if listed[w.qualname].chapter == chapter]
        result = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "helpers" / "course_plant.py"), chapter, *map(str, indices)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, f"chapter {chapter}: planting failed\n{result.stderr[-3000:]}"
        for i, (code, failures) in json.loads(result.stdout.strip().splitlines()[-1]).items():
            w = WRONG[int(i)]
            if code == 0:
                problems.append(f"{w.qualname} ({w.why}): chapter {chapter}'s checks pass")
            elif listed[w.qualname].name not in failures:
                problems.append(f"{w.qualname} ({w.why}): the failure does not name it:\n{failures[-1500:]}")
    assert not problems, "\n".join(problems)

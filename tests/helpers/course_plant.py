"""Plants wrong answers into the package this process imports, one at a time, and runs their chapter's course
checks in this process after each: one process per chapter instead of one per wrong answer (torch's import and
the tiny checkpoints are paid once). A wrong body is compiled in its module's source and swapped in as the
function's `__code__`, so every reference to the function (the module's name, a class's attribute, a kernel's
Python function, a name another module imported) runs it; the reference's code is put back after the run.

    MINIVLLM_EDITION=DIR PYTHONPATH=DIR:tests python3 tests/helpers/course_plant.py CHAPTER INDEX...

prints one JSON line: per index of tests/course/wrong_answers.py, [pytest's exit code, the failure lines].
"""

import contextlib
import importlib
import io
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def function_of(module, qualname: str):
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "fn", obj)  # a Triton kernel: the Python function under @triton.jit


def wrong_code(module, qualname: str, body: str):
    """The code object of `qualname` compiled from its module's source with `body` in place of its body."""
    from helpers.course_edition import replace_body

    path = Path(module.__file__)
    source = replace_body(path.read_text(), qualname, body)
    namespace: dict = {"__name__": module.__name__ + "._wrong", "__file__": str(path)}
    exec(compile(source, str(path), "exec"), namespace)
    obj = namespace
    for part in qualname.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return getattr(obj, "fn", obj).__code__


def run_chapter(chapter: str) -> tuple[int, str]:
    import pytest

    from minivllm.layers.rotary_embedding import get_rope

    get_rope.cache_clear()  # a rotary table built by an earlier run's code must not be reused
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = pytest.main(
            [
                str(ROOT / "tests" / "course"),
                "-q",
                "-x",
                "-m",
                "not slow",
                "-k",
                f"test_{chapter}_",
                "-p",
                "no:cacheprovider",
                "--tb=short",
            ]
        )
    failures = "\n".join(line for line in out.getvalue().splitlines() if line.startswith("E "))
    return int(code), failures


def main() -> None:
    from helpers.course_edition import body_of, exercises

    sys.path.insert(0, str(ROOT / "tests" / "course"))
    from wrong_answers import WRONG

    chapter, indices = sys.argv[1], [int(i) for i in sys.argv[2:]]
    listed = {e.qualname: e for e in exercises()}
    results = {}
    for i in indices:
        w, e = WRONG[i], listed[WRONG[i].qualname]
        module = importlib.import_module(e.module.removesuffix(".py").replace("/", "."))
        fn = function_of(module, e.qualname)
        reference = fn.__code__
        wrong = wrong_code(module, e.qualname, w.wrong_body(body_of(Path(module.__file__).read_text(), e.qualname)))
        fn.__code__ = wrong
        try:
            results[i] = run_chapter(chapter)
        finally:
            fn.__code__ = reference
    print(json.dumps(results))


if __name__ == "__main__":
    main()

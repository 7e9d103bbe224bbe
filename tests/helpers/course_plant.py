"""Plants wrong answers into the package this process imports, one at a time, and runs their chapter's course
checks in this process after each: one process per chapter instead of one per wrong answer (torch's import and
the tiny checkpoints are paid once). A wrong body is compiled in its module's source and swapped in as the
function's `__code__`, so every reference to the function (the module's name, a class's attribute, a name another
module imported) runs it; a Triton kernel replaces the module's name for it (its launcher, in the same module,
looks it up there). The reference is put back after the run.

    MINIVLLM_EDITION=DIR PYTHONPATH=DIR:tests python3 tests/helpers/course_plant.py CHAPTER INDEX...

prints one JSON line: per index of tests/course/wrong_answers.py, [pytest's exit code, the failure lines].
"""

import contextlib
import importlib
import io
import json
import linecache
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def function_of(module, qualname: str):
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "fn", obj)  # a Triton kernel: the Python function under @triton.jit


def wrong_object(module, qualname: str, body: str):
    """`qualname` compiled from its module's source with `body` in place of its body (a function, or a Triton
    kernel)."""
    from helpers.course_edition import replace_body

    path = Path(module.__file__)
    source = replace_body(path.read_text(), qualname, body)
    name = f"<wrong answer in {path}>"  # the source under a name of its own: Triton's interpreter reads it back
    linecache.cache[name] = (len(source), None, source.splitlines(keepends=True), name)
    namespace: dict = {"__name__": module.__name__ + "._wrong", "__file__": str(path)}
    exec(compile(source, name, "exec"), namespace)
    obj = namespace
    for part in qualname.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


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
    from course.wrong_answers import WRONG
    from helpers.course_edition import body_of, exercises

    chapter, indices = sys.argv[1], [int(i) for i in sys.argv[2:]]
    listed = {e.qualname: e for e in exercises()}
    results = {}
    for i in indices:
        w, e = WRONG[i], listed[WRONG[i].qualname]
        module = importlib.import_module(e.module.removesuffix(".py").replace("/", "."))
        body = w.wrong_body(body_of(Path(module.__file__).read_text(), e.qualname))
        wrong = wrong_object(module, e.qualname, body)
        if hasattr(wrong, "fn"):  # a Triton kernel (its interpreter reads the source): swap the module's name
            reference = getattr(module, e.qualname)
            setattr(module, e.qualname, wrong)
            restore = lambda: setattr(module, e.qualname, reference)
        else:
            fn = function_of(module, e.qualname)
            reference = fn.__code__
            fn.__code__ = wrong.__code__
            restore = lambda: setattr(fn, "__code__", reference)
        try:
            results[i] = run_chapter(chapter)
        finally:
            restore()
    print(json.dumps(results))


if __name__ == "__main__":
    # tests/, not this script's folder, first on the path: there `course` is tests/course, not helpers/course.py
    sys.path[0] = str(ROOT / "tests")
    main()

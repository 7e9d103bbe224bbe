"""The course's per-chapter checks run against one edition of the package: the reference `minivllm/` by default
(CI), or the learner's with `MINIVLLM_EDITION=exercises` (the directory that holds the edition's `minivllm/`):

    MINIVLLM_EDITION=exercises python3 -m pytest tests/course -k 06

The edition's directory goes first on sys.path (and on PYTHONPATH, for the processes a check starts) before any
test module imports minivllm; a minivllm imported from elsewhere by then is an error, not a silent switch."""

import os
import sys
from pathlib import Path

import pytest

EDITION = os.environ.get("MINIVLLM_EDITION")
if EDITION:
    EDITION = str(Path(EDITION).resolve())
    if not (Path(EDITION) / "minivllm" / "__init__.py").exists():
        raise pytest.UsageError(f"MINIVLLM_EDITION={EDITION}: no minivllm/ there (python3 scripts/make_exercises.py)")
    loaded = sys.modules.get("minivllm")
    if loaded is not None and not str(Path(loaded.__file__).resolve()).startswith(EDITION + os.sep):
        raise pytest.UsageError(
            f"MINIVLLM_EDITION={EDITION}, but minivllm was already imported from {loaded.__file__}: "
            "run tests/course in a pytest of its own"
        )
    sys.path.insert(0, EDITION)
    os.environ["PYTHONPATH"] = os.pathsep.join([EDITION, os.environ.get("PYTHONPATH", "")])


def pytest_report_header(config) -> str:
    import minivllm

    return f"course checks against {Path(minivllm.__file__).parent}"


@pytest.hookimpl(wrapper=True)
def pytest_pyfunc_call(pyfuncitem):
    """A raw error (an IndexError, a shape mismatch in torch) becomes an AssertionError that names the package
    function it came from; NotImplementedError (an unwritten exercise) and AssertionError pass as they are."""
    try:
        return (yield)
    except (AssertionError, NotImplementedError, pytest.skip.Exception):
        raise
    except Exception as e:
        import minivllm
        from helpers.course import raised_in

        where = raised_in(e.__traceback__, str(Path(minivllm.__file__).parent))
        raise AssertionError(
            f"{where or pyfuncitem.name} raised {type(e).__name__}: {e}" + ("" if where else " (in the check itself)")
        ) from e

"""Writes the learner's edition of the course: `exercises/minivllm/`, the package with the functions the learner
writes stubbed, and `exercises/NN_*.ipynb` from `notebooks/`.

The package: a full copy of `minivllm/` in which every function of `notebooks/exercises.toml` keeps its signature
and docstring and its body becomes `raise NotImplementedError("chapter NN: write <name> (see notebooks/NN_...)")`.
A notebook run from exercises/ imports this copy (its directory comes first on sys.path), and
`MINIVLLM_EDITION=exercises python3 -m pytest tests/course -k NN` checks chapter NN against it.

Every notebook is copied (those without exercises too); in each exercise cell the solution lines between
`### BEGIN SOLUTION` and `### END SOLUTION` become `# YOUR CODE HERE` / `raise NotImplementedError()`, outputs and
execution counts are cleared, and the planted wrong answers (`exercise.wrong` metadata) are removed.

    python3 scripts/make_exercises.py            # writes exercises/, keeping notebooks and package already there
    python3 scripts/make_exercises.py --force    # overwrites them (a learner's work there is lost)
    python3 scripts/make_exercises.py --out DIR  # writes DIR/
"""

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tests/helpers

from helpers.course_edition import exercises, write_package  # noqa: E402
from helpers.notebooks import exercises_of, learner_edition, read  # noqa: E402

# The first cell of every learner's notebook: the edition beside it comes first on the path, whatever else is
# installed (an editable install of the reference, a PYTHONPATH), and the cell says which minivllm it imported.
FIRST_CELL = """# Your minivllm: the copy beside this notebook (exercises/minivllm), whose functions you write
import sys
from pathlib import Path

sys.path.insert(0, str(Path.cwd()))
import minivllm  # noqa: E402

print("minivllm imported from", Path(minivllm.__file__).parent.relative_to(Path.cwd().parent))"""


def make_exercises(src: Path, out: Path, force: bool = False) -> list[tuple[str, int, bool]]:
    """Writes the edition of every `src/*.ipynb` into `out`, keeping files already there unless `force`;
    returns (name, exercise count, written) per notebook."""
    out.mkdir(parents=True, exist_ok=True)
    done = []
    for path in sorted(src.glob("*.ipynb")):
        nb = read(path)
        count = len(exercises_of(nb))  # raises on a malformed exercise
        target = out / path.name
        write = force or not target.exists()
        if write:
            edition = learner_edition(nb)
            first = nbformat.v4.new_code_cell(FIRST_CELL, metadata={"edition_path": True})
            edition.cells.insert(0, first)
            nbformat.write(edition, target)
        done.append((path.name, count, write))
    return done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, default=ROOT / "notebooks")
    parser.add_argument("--out", type=Path, default=ROOT / "exercises")
    parser.add_argument("--force", action="store_true", help="overwrite notebooks already in --out")
    args = parser.parse_args()
    if args.out.resolve() == args.src.resolve():
        parser.error("--out must differ from --src: the edition would overwrite the solutions")
    done = make_exercises(args.src, args.out, force=args.force)
    for name, count, write in done:
        print(f"{name:<40} {count:>2} exercises  {'written' if write else 'kept (exists; --force overwrites)'}")
    print(f"{sum(c for _, c, _ in done)} exercises in {len(done)} notebooks -> {args.out}")
    helpers = args.out / "helpers"  # the test helpers the notebooks import (notebooks/helpers is the same link)
    if not helpers.exists():
        helpers.symlink_to(ROOT / "tests" / "helpers", target_is_directory=True)
    listed = exercises()
    if (args.out / "minivllm").exists() and not args.force:
        print(f"{args.out / 'minivllm'}: kept (exists; --force overwrites)")
        return
    lines = write_package(args.out, listed)
    for chapter, n in sorted(lines.items()):
        names = [e.qualname for e in listed if e.chapter == chapter]
        print(f"chapter {chapter}: {len(names):>2} functions, {n:>3} lines  ({', '.join(names)})")
    print(f"{len(listed)} functions, {sum(lines.values())} lines to write -> {args.out / 'minivllm'}")


if __name__ == "__main__":
    main()

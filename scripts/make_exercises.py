"""Writes the learner's edition of the course: `exercises/NN_*.ipynb` from `notebooks/`.

Every notebook is copied (those without exercises too); in each exercise cell the solution lines between
`### BEGIN SOLUTION` and `### END SOLUTION` become `# YOUR CODE HERE` / `raise NotImplementedError()`, outputs and
execution counts are cleared, and the planted wrong answers (`exercise.wrong` metadata) are removed.

    python3 scripts/make_exercises.py            # writes exercises/, keeping notebooks already there
    python3 scripts/make_exercises.py --force    # overwrites them (a learner's work there is lost)
    python3 scripts/make_exercises.py --out DIR  # writes DIR/
"""

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tests/helpers

from helpers.notebooks import exercises_of, learner_edition, read  # noqa: E402


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
            nbformat.write(learner_edition(nb), target)
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


if __name__ == "__main__":
    main()

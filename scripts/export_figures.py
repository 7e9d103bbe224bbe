"""Writes figures/: for each figure a notebook draws, the image its committed outputs display.

Run it after re-executing a notebook that draws one, and commit figures/ with the notebook; the figure copies then
show what the notebook shows (`tests/test_notebook_figures.py` fails while one is stale). Which cell draws which
figure: `tests/helpers/figures.py`.

    python3 scripts/export_figures.py            # writes every drawn figure, removes a copy no notebook draws
    python3 scripts/export_figures.py --check    # writes nothing; exit status 1 if figures/ is stale
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # tests/helpers

from helpers.figures import drawn_figures, stale  # noqa: E402


def export(notebooks: Path, figures: Path) -> list[str]:
    """Writes every drawn figure into `figures/` and removes copies no notebook draws; returns what changed."""
    changed = stale(notebooks, figures)
    drawn = drawn_figures(notebooks)
    figures.mkdir(exist_ok=True)
    for name, fig in drawn.items():
        (figures / name).write_bytes(fig.png)
    for path in figures.glob("*.png"):
        if path.name not in drawn:
            path.unlink()
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if figures/ is stale")
    args = parser.parse_args()
    notebooks, figures = ROOT / "notebooks", ROOT / "figures"
    lines = stale(notebooks, figures) if args.check else export(notebooks, figures)
    print("\n".join(lines) if lines else "figures/ = what the notebooks display")
    if args.check and lines:
        sys.exit(1)


if __name__ == "__main__":
    main()

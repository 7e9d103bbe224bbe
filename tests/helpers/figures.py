"""The committed figures/ and the notebooks that draw them.

`figures/X.png` is a copy of the image a notebook displays for X in its committed outputs (the learner reads the
notebook; the copy is what a page outside it shows). A notebook cell names its figure where it saves it
(`fig.savefig(FIGURES / "X.png")` or `figures_dir() / "X.png"`, both under the git-ignored build/), and its
image output is that figure. A figure a notebook only displays (its numbers are the machine's timings, so a run
must not rewrite it) is named in DISPLAYED_ONLY by a piece of its cell's source. `scripts/export_figures.py` writes
the copies; `tests/test_notebook_figures.py` fails when one differs from what its notebook shows.
"""

import base64
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SAVED = re.compile(r"""(?:FIGURES|figures_dir\(\))\s*/\s*["']([\w.-]+\.png)["']""")
DISPLAYED_ONLY = {  # figure -> (notebook, a piece of the source of the one cell that draws it)
    "14_step_time.png": ("14_engine.ipynb", "where a step's time goes"),
}


@dataclass
class DrawnFigure:
    name: str  # file name under figures/
    notebook: str  # the notebook's file name
    cell: int | None  # the cell's execution count
    png: bytes  # the image its committed output displays


def _images(cell: dict) -> list[bytes]:
    return [
        base64.b64decode("".join(o["data"]["image/png"]))
        for o in cell.get("outputs", [])
        if "image/png" in o.get("data", {})
    ]


def drawn_figures(
    notebooks: Path, displayed_only: dict[str, tuple[str, str]] = DISPLAYED_ONLY
) -> dict[str, DrawnFigure]:
    """Every named figure of `notebooks/*.ipynb` with the image its committed output displays. Raises ValueError
    where a cell saves a different number of figures than it displays, or a `displayed_only` cell is not found once."""
    found: dict[str, DrawnFigure] = {}
    wanted = {nb: (name, text) for name, (nb, text) in displayed_only.items()}
    for path in sorted(notebooks.glob("*.ipynb")):
        cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
        for c in cells:
            names, images = SAVED.findall("".join(c["source"])), _images(c)
            if names and len(names) != len(images):
                raise ValueError(
                    f"{path.name} cell {c['execution_count']}: saves {names}, its outputs hold {len(images)} images"
                )
            for name, png in zip(names, images):
                if name in found:
                    raise ValueError(f"{name}: drawn by {found[name].notebook} and {path.name}")
                found[name] = DrawnFigure(name, path.name, c["execution_count"], png)
        if path.name in wanted:
            name, text = wanted[path.name]
            hits = [c for c in cells if text in "".join(c["source"])]
            if len(hits) != 1 or len(_images(hits[0])) != 1:
                raise ValueError(f"{name}: want one cell of {path.name} holding {text!r} and one image in its outputs")
            found[name] = DrawnFigure(name, path.name, hits[0]["execution_count"], _images(hits[0])[0])
    missing = set(displayed_only) - set(found)
    if missing:
        raise ValueError(f"displayed-only figures whose notebook is missing: {sorted(missing)}")
    return found


def stale(notebooks: Path, figures: Path, displayed_only: dict[str, tuple[str, str]] = DISPLAYED_ONLY) -> list[str]:
    """What differs between `figures/` and what the notebooks display: one line per stale, missing or orphaned copy
    (pixels compared, so a re-encoded PNG of the same image is not stale)."""
    drawn = drawn_figures(notebooks, displayed_only)
    out = []
    for name, fig in sorted(drawn.items()):
        path = figures / name
        if not path.exists():
            out.append(f"{name}: drawn by {fig.notebook}, no copy in figures/")
            continue
        have, want = pixels(path.read_bytes()), pixels(fig.png)
        if have.shape != want.shape or not (have == want).all():
            out.append(f"{name}: differs from what {fig.notebook} cell {fig.cell} displays")
    orphans = [p.name for p in sorted(figures.glob("*.png")) if p.name not in drawn]
    out += [f"{name}: in figures/, drawn by no notebook" for name in orphans]
    return out


def pixels(png: bytes) -> np.ndarray:
    """(height, width, 4) uint8: the RGBA pixels of a PNG (two encodings of one image compare equal)."""
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGBA"))

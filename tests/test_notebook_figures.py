"""Figures are shown where the learner reads (issue 14): a notebook cell that saves a figure to figures/ also
displays it (plt.show() under the inline backend; `matplotlib.use("Agg")` would hide it), the committed
outputs hold the images, and each image stays small (the repository and a GPU machine's upload stay light)."""

import base64
import io
import json
import re
from pathlib import Path

import pytest

from helpers.figures import drawn_figures, stale

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MAX_IMAGE_CHARS = 160_000  # base64 of one PNG in a committed output


def code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def images(cell: dict) -> list[str]:
    return ["".join(o["data"]["image/png"]) for o in cell["outputs"] if "image/png" in o.get("data", {})]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_saved_figures_are_displayed(path):
    cells = code_cells(path)
    for c in cells:
        assert 'matplotlib.use("Agg")' not in source(c), f"{path.name}: the Agg backend hides figures in Jupyter"
        if ".savefig(" in source(c):
            assert "plt.show()" in source(c), f"{path.name} cell {c['execution_count']}: saves a figure, never shows it"
    if any(".savefig(" in source(c) for c in cells):
        assert any(images(c) for c in cells), f"{path.name}: draws figures but no image is in its committed outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_images_are_small(path):
    for c in code_cells(path):
        for png in images(c):
            assert len(png) <= MAX_IMAGE_CHARS, f"{path.name} cell {c['execution_count']}: image of {len(png)} chars"


TRACKED_FIGURE = re.compile(r"""savefig\(\s*f?["'](?:\.\./)?figures/""")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_runs_do_not_rewrite_tracked_figures(path):
    """Running the course leaves `git status` clean: a notebook saves its figures under build/figures/
    (`helpers.notebooks.figures_dir()`, git-ignored), never into the tracked figures/."""
    for c in code_cells(path):
        assert not TRACKED_FIGURE.search(source(c)), (
            f"{path.name} cell {c['execution_count']}: saves into the tracked figures/; save to figures_dir()"
        )


# ---------------------------------------------------------------------------------------------------------------
def test_committed_figures_are_what_the_notebooks_display():
    """figures/X.png is the image its notebook displays in the committed outputs, pixel for pixel: re-executing a
    notebook (on new recorded results, or a redrawn figure) without exporting its figures fails here."""
    problems = stale(ROOT / "notebooks", ROOT / "figures")
    assert not problems, "figures/ is stale; run python3 scripts/export_figures.py:\n" + "\n".join(problems)


def _png(color: str) -> bytes:
    from matplotlib.figure import Figure  # no pyplot: the process's backend stays as it is

    fig = Figure(figsize=(1, 1))
    fig.add_subplot().set_facecolor(color)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=20)
    return buf.getvalue()


def _notebook(cells: list[tuple[str, list[bytes]]]) -> str:
    def outputs(pngs: list[bytes]) -> list[dict]:
        return [{"output_type": "display_data", "data": {"image/png": base64.b64encode(p).decode()}} for p in pngs]

    return json.dumps(
        {
            "cells": [
                {"cell_type": "code", "execution_count": i + 1, "source": src, "outputs": outputs(pngs)}
                for i, (src, pngs) in enumerate(cells)
            ]
        }
    )


def test_stale_figures_are_found(tmp_path):
    """The check above can fail: a stale copy, a missing one, an orphan, and a cell whose saves and images
    disagree are each reported; an exact or re-encoded copy is not; a displayed-only figure is found by its cell."""
    red, blue = _png("red"), _png("blue")
    notebooks, figures = tmp_path / "notebooks", tmp_path / "figures"
    notebooks.mkdir(), figures.mkdir()
    (notebooks / "01_a.ipynb").write_text(
        _notebook([('fig.savefig(FIGURES / "01_a.png", dpi=80)', [red]), ('fig.savefig(FIGURES / "01_b.png")', [blue])])
    )
    (notebooks / "02_b.ipynb").write_text(_notebook([("print(1)", []), ("ax.set_title('timings')", [red])]))
    only = {"02_t.png": ("02_b.ipynb", "'timings'")}
    (figures / "01_a.png").write_bytes(red)
    (figures / "02_t.png").write_bytes(red)
    assert stale(notebooks, figures, only) == ["01_b.png: drawn by 01_a.ipynb, no copy in figures/"]
    (figures / "01_b.png").write_bytes(red)  # an old drawing
    (figures / "01_c.png").write_bytes(red)
    (figures / "02_t.png").write_bytes(blue)
    assert stale(notebooks, figures, only) == [
        "01_b.png: differs from what 01_a.ipynb cell 2 displays",
        "02_t.png: differs from what 02_b.ipynb cell 2 displays",
        "01_c.png: in figures/, drawn by no notebook",
    ]
    (figures / "01_c.png").unlink()
    (figures / "02_t.png").write_bytes(red)
    from PIL import Image

    Image.open(io.BytesIO(blue)).save(figures / "01_b.png", optimize=True, compress_level=1)  # re-encoded, same pixels
    assert (figures / "01_b.png").read_bytes() != blue and stale(notebooks, figures, only) == []
    with pytest.raises(ValueError, match="want one cell"):
        drawn_figures(notebooks, {"02_t.png": ("02_b.ipynb", "print")})  # a cell without its image
    (notebooks / "01_a.ipynb").write_text(_notebook([('f.savefig(figures_dir() / "01_a.png")', [])]))
    with pytest.raises(ValueError, match="saves"):
        drawn_figures(notebooks, {})

"""Figures are shown where the learner reads (issue 14): a notebook cell that saves a figure to figures/ also
displays it (plt.show() under the inline backend; `matplotlib.use("Agg")` would hide it), the committed
outputs hold the images, and each image stays small (the repository and a GPU machine's upload stay light)."""

import json
import re
from pathlib import Path

import pytest

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

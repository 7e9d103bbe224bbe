"""Every committed notebook was executed once, top to bottom, and its outputs are clean (nbdev's and d2l's
CI gate): execution counts 1..N, a first markdown cell naming the minivllm/ module it builds, no errors, and
no temp paths or object addresses in what `pytest --nbval` compares. Whether each self-check still passes is
not read from the committed text here: `pytest --nbval` (.ci/run) runs every cell again against the package
and compares what it prints."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
MODULE = re.compile(r"minivllm/[\w/]*\w(?:\.py)?")
TMP_PATH = re.compile(r"/tmp/|/var/folders/|pytest-of-|\\Temp\\|\btmp[a-z0-9_]{6,}\b")
ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{8,}\b")  # `<object at 0x7f3a...>`: 64-bit pointers


def load(path: Path) -> list[dict]:
    return json.loads(path.read_text())["cells"]


def code_cells(path: Path) -> list[dict]:
    return [c for c in load(path) if c["cell_type"] == "code"]


def text_of(output: dict) -> str:
    """The text an output shows (streams, text/plain results, errors); images are skipped."""
    if output["output_type"] == "stream":
        return "".join(output["text"])
    if output["output_type"] == "error":
        return "\n".join(output.get("traceback", []))
    data = output.get("data", {})
    return "".join("".join(v) if isinstance(v, list) else str(v) for k, v in data.items() if k.startswith("text/"))


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_executed_once_top_to_bottom(path):
    cells = code_cells(path)
    counts = [c["execution_count"] for c in cells]
    assert counts == list(range(1, len(cells) + 1)), f"{path.name}: execution counts {counts}"
    for c in cells:
        for out in c["outputs"]:
            assert out["output_type"] != "error", f"{path.name} cell {c['execution_count']}: committed error"
            if out["output_type"] == "execute_result":
                assert out["execution_count"] == c["execution_count"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_cell_names_its_module(path):
    first = load(path)[0]
    assert first["cell_type"] == "markdown", f"{path.name}: the first cell must be markdown"
    named = MODULE.findall("".join(first["source"]))
    assert any((ROOT / m).exists() for m in named), (
        f"{path.name}: first cell names no existing minivllm/ module ({named})"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_outputs_hold_no_tmp_paths_or_addresses(path):
    for c in code_cells(path):
        for out in c["outputs"]:
            text = text_of(out)
            for name, pattern in (("a temp path", TMP_PATH), ("an object address", ADDRESS)):
                hit = pattern.search(text)
                assert hit is None, (
                    f"{path.name} cell {c['execution_count']} prints {name}: "
                    f"{text[max(0, hit.start() - 40) : hit.end() + 40]!r}"
                )

"""The core's size beside nano-vllm's (scripts/core_size.py): the targets the core meets stay met, and the
chapters' table names modules that exist (a module moved without the table moving with it fails here)."""

import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def core_size():
    spec = importlib.util.spec_from_file_location("core_size", ROOT / "scripts" / "core_size.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_files_with_nano_vllms_names_stay_near_its_size():
    cs = core_size()
    ours = {f: cs.lines(cs.ROOT / f) for f in cs.NANO_VLLM}
    assert sum(ours.values()) <= 1.4 * sum(cs.NANO_VLLM.values()), ours
    too_long = {f: n for f, n in ours.items() if cs.NANO_VLLM[f] >= 30 and n > 2 * cs.NANO_VLLM[f]}
    assert too_long == {}


def test_no_package_file_over_250_lines():
    long = {str(p): n for p in (ROOT / "minivllm").rglob("*.py") if (n := len(p.read_text().splitlines())) > 250}
    assert long == {}


def test_the_chapters_table_names_modules_that_exist():
    cs = core_size()
    missing = [m for modules in cs.CHAPTERS.values() for m in modules if not (cs.ROOT / m).is_file()]
    assert missing == []
    assert sorted(cs.CHAPTERS) == [f"{i:02d}" for i in range(1, 15)]
    learner = cs.learner_files()
    assert "layers/layernorm.py" in learner and "kernels/triton/store_kvcache.py" in learner
    assert not any(f.startswith("serve/") for f in learner)  # the chapters never reach the server


def test_the_chapters_table_is_what_each_first_cell_names():
    """CHAPTERS lists, for notebooks 01-14, the modules each first cell names in bold (**`minivllm/...py`**) as the
    ones it builds and verifies; a module a chapter only uses (default_model_dir() in 10) or a kernel moved to a
    later notebook (18) is named without bold, or not at all."""
    cs = core_size()
    bold = re.compile(r"\*\*`minivllm/([\w/]+\.py)`\*\*")
    named = {}
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        if path.name[:2] in cs.CHAPTERS:
            named[path.name[:2]] = bold.findall("".join(json.loads(path.read_text())["cells"][0]["source"]))
    assert named == cs.CHAPTERS

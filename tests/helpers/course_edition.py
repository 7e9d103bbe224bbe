"""The learner's edition of the package: which functions the learner writes (`notebooks/exercises.toml`), and the
source surgery that stubs them, fills them back in, or plants a wrong answer in them.

A function is named by its module file (`minivllm/layers/layernorm.py`) and its qualified name (`RMSNorm.forward`).
Its *body* is what follows the signature and the docstring: the lines from the first statement after the
docstring (comment lines just above it included) to the function's last line, found with `ast`, so the engine's
source carries no markers. Stubbing keeps the signature and the docstring and puts one line in place of the body:
`raise NotImplementedError("chapter NN: write <qualname> (see notebooks/NN_topic.ipynb)")`.
"""

import ast
import re
import shutil
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIST = ROOT / "notebooks" / "exercises.toml"


@dataclass(frozen=True, slots=True)
class Exercise:
    chapter: str  # "06"
    module: str  # file under the repository root: "minivllm/kernels/triton/store_kvcache.py"
    qualname: str  # "store_kvcache_kernel", "RMSNorm.forward"
    notebook: str  # "06_store_kvcache_triton.ipynb"

    @property
    def name(self) -> str:
        """The function's own name: `forward` of `RMSNorm.forward`."""
        return self.qualname.rsplit(".", 1)[-1]

    @property
    def message(self) -> str:
        return f"chapter {self.chapter}: write {self.qualname} (see notebooks/{self.notebook})"


def exercises(path: Path = LIST) -> list[Exercise]:
    """The list, in course order; raises ValueError on an entry that misses a field or names no notebook."""
    out = []
    for i, entry in enumerate(read_list(path.read_text())):
        missing = {"chapter", "module", "qualname", "notebook"} - entry.keys()
        if missing:
            raise ValueError(f"{path.name}: exercise {i} ({entry}) misses {sorted(missing)}")
        if not entry["notebook"].startswith(entry["chapter"] + "_"):
            raise ValueError(f"{path.name}: {entry['qualname']}: notebook {entry['notebook']} is not chapter's")
        out.append(Exercise(entry["chapter"], entry["module"], entry["qualname"], entry["notebook"]))
    return out


FIELD = re.compile(r'^(\w+)\s*=\s*"([^"]*)"\s*$')


def read_list(text: str) -> list[dict[str, str]]:
    """The `[[exercise]]` tables of the list: the subset of TOML it uses (tomllib is Python 3.11+), strictly:
    any other line is an error naming it."""
    entries: list[dict[str, str]] = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line == "[[exercise]]":
            entries.append({})
        elif (m := FIELD.match(line)) and entries:
            entries[-1][m.group(1)] = m.group(2)
        else:
            raise ValueError(f'exercises.toml line {n}: {line!r} is not `[[exercise]]` or `key = "value"`')
    return entries


# --- finding a body ---------------------------------------------------------------------------------------------


def find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    node: ast.AST = tree
    for part in qualname.split("."):
        found = [
            n
            for n in getattr(node, "body", [])
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) and n.name == part
        ]
        if not found:
            raise KeyError(f"{qualname}: no {part!r} found")
        node = found[-1]
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        raise KeyError(f"{qualname} is not a function")
    return node


def body_span(source: str, qualname: str) -> tuple[int, int, str]:
    """(first, last) 0-based line indices of the body of `qualname` in `source` (last inclusive), and the body's
    indentation. Comment lines right above the first statement belong to the body."""
    fn = find_function(ast.parse(source), qualname)
    body = fn.body
    has_doc = isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
    has_doc = has_doc and isinstance(body[0].value.value, str)
    if has_doc and len(body) == 1:
        raise ValueError(f"{qualname} has a docstring and no body")
    first_stmt = body[1] if has_doc else body[0]
    lines = source.splitlines()
    floor = body[0].end_lineno if has_doc else fn.lineno  # 1-based: nothing at or above this line is body
    first = first_stmt.lineno - 1
    while first - 1 >= floor and lines[first - 1].strip().startswith("#"):
        first -= 1
    indent = lines[first_stmt.lineno - 1][: first_stmt.col_offset]
    return first, fn.end_lineno - 1, indent


def body_of(source: str, qualname: str) -> str:
    """The body's text, dedented."""
    first, last, _ = body_span(source, qualname)
    return textwrap.dedent("\n".join(source.splitlines()[first : last + 1]))


def replace_body(source: str, qualname: str, body: str) -> str:
    """`source` with the body of `qualname` replaced by `body` (any indentation: re-indented to the function's)."""
    first, last, indent = body_span(source, qualname)
    lines = source.splitlines()
    new = [indent + line if line.strip() else "" for line in textwrap.dedent(body).strip("\n").splitlines()]
    return "\n".join(lines[:first] + new + lines[last + 1 :]) + "\n"


def stub_source(exercise: Exercise) -> str:
    return f"raise NotImplementedError({exercise.message!r})"


# --- the edition --------------------------------------------------------------------------------------------------


def count_lines(body: str) -> int:
    """Lines of code of a body: not blank, not a comment."""
    return sum(1 for line in body.splitlines() if line.strip() and not line.strip().startswith("#"))


def write_package(out: Path, listed: list[Exercise], src: Path = ROOT) -> dict[str, int]:
    """Copies `src/minivllm` to `out/minivllm` with every listed function stubbed; returns lines of body stubbed
    per chapter."""
    target = out / "minivllm"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(src / "minivllm", target, ignore=shutil.ignore_patterns("__pycache__", "*.so", "build"))
    per_chapter: dict[str, int] = {}
    for module in dict.fromkeys(e.module for e in listed):
        path = out / module
        text = (src / module).read_text()
        for e in (e for e in listed if e.module == module):
            per_chapter[e.chapter] = per_chapter.get(e.chapter, 0) + count_lines(body_of(text, e.qualname))
            text = replace_body(text, e.qualname, stub_source(e))
        path.write_text(text)
    return per_chapter


def fill_package(edition: Path, listed: list[Exercise], src: Path = ROOT) -> None:
    """Puts the reference bodies back into the edition at `edition/minivllm` (what a learner who wrote every
    function as the reference does would have)."""
    for module in dict.fromkeys(e.module for e in listed):
        path, reference = edition / module, (src / module).read_text()
        text = path.read_text()
        for e in (e for e in listed if e.module == module):
            text = replace_body(text, e.qualname, body_of(reference, e.qualname))
        path.write_text(text)

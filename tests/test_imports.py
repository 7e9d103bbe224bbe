"""The package's import graph, read with `ast` from the sources (nothing imported): no module imports back a
module that imports it, directly or through others (function-level imports count too), and no module starts a
process or a thread when it is imported (only a function an engine calls may)."""

import ast
from pathlib import Path

import minivllm

ROOT = Path(minivllm.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def imports_of(name: str) -> set[str]:
    """The minivllm modules `name` imports anywhere in its file: `import a.b`, `from a import b` (b a module, or
    a name of a), relative imports resolved."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_reader_sees_what_a_module_imports():
    graph = {name: imports_of(name) for name in MODULES}
    assert "minivllm.kernels.torch_attention" in graph["minivllm.kernels.cpu.ops"]  # a module-level import
    assert "minivllm.kernels.cpu.ops" in graph["minivllm.kernels.table"]  # one inside pick()
    assert "minivllm.llm" in graph["minivllm"]  # one inside the package's __getattr__()
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_circles():
    graph = {name: imports_of(name) for name in MODULES}
    assert cycles(graph) == []


STARTS = ("start", "spawn", "popen", "process", "thread", "submit", "run")  # in a called name: it may start one


def calls_at_import(tree: ast.Module) -> list[str]:
    """Calls that run when the module is imported: in its top-level statements (not inside a def or a class
    body's methods), `if __name__ == "__main__":` blocks left out."""
    found = []

    def scan(node: ast.AST) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            return
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if any(word in name.lower() for word in STARTS):
                found.append(ast.unparse(node)[:80])
        for child in ast.iter_child_nodes(node):
            scan(child)

    for statement in tree.body:
        scan(statement)
    return found


def test_no_module_starts_a_process_or_thread_at_import():
    started = {name: calls_at_import(ast.parse(path.read_text())) for name, path in MODULES.items()}
    assert {name: calls for name, calls in started.items() if calls} == {}
    planted = ast.parse("import threading\nthreading.Thread(target=print).start()\ndef later():\n    run()\n")
    assert calls_at_import(planted) == ["threading.Thread(target=print).start()", "threading.Thread(target=print)"]
    assert calls_at_import(ast.parse("from minivllm.engine import attention_compile\nattention_compile.start_helper()"))


def test_the_core_reaches_the_kernels_through_the_table_and_one_seam():
    """Layers, models and utils import the kernel table only (what a layer binds at construction); the runner
    imports `minivllm.kernels` alone (pick and the start-up seam), never the CPU, Triton or start-up modules."""
    graph = {name: imports_of(name) for name in MODULES}
    for name in MODULES:
        if name.startswith(("minivllm.layers", "minivllm.models", "minivllm.utils")):
            kernels = {m for m in graph[name] if m.startswith("minivllm.kernels")}
            assert kernels <= {"minivllm.kernels.table"}, (name, kernels)
    runner = {m for m in graph["minivllm.engine.model_runner"] if m.startswith("minivllm.kernels")}
    assert runner == {"minivllm.kernels"}


def test_no_private_torch_distributed_api():
    """Each engine's process group is passed to the layers: nothing swaps torch's default group around."""
    for name, path in MODULES.items():
        source = path.read_text()
        for private in ("distributed_c10d", "_update_default_pg", "_world"):
            assert private not in source, (name, private)


# --- the core and the extras ---------------------------------------------------------------------------
# The core reads file for file beside nano-vllm; what minivllm adds plugs into it from outside. The core never
# imports an extra (minivllm.kernels itself is the seam: `pick` and the tables it returns).
CORE = ("minivllm.config", "minivllm.sampling_params", "minivllm.engine", "minivllm.layers", "minivllm.models")
CORE += ("minivllm.utils",)
EXTRAS = ("minivllm.frontend", "minivllm.serve", "minivllm.kernels.cpu", "minivllm.kernels.triton")
EXTRAS += ("minivllm.kernels.startup", "minivllm.kernels.attention_backends", "minivllm.kernels.flash_attention")
EXTRAS += ("minivllm.kernels.attention_backend", "minivllm.kernels.torch_attention")


def within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def core_imports_of_extras(graph: dict[str, set[str]]) -> dict[str, list[str]]:
    return {
        name: sorted(m for m in imported if within(m, EXTRAS))
        for name, imported in graph.items()
        if within(name, CORE) and any(within(m, EXTRAS) for m in imported)
    }


def test_the_core_never_imports_an_extra():
    graph = {name: imports_of(name) for name in MODULES}
    assert core_imports_of_extras(graph) == {}
    planted = dict(graph, **{"minivllm.engine.scheduler": {"minivllm.serve.core", "minivllm.kernels"}})
    assert core_imports_of_extras(planted)["minivllm.engine.scheduler"] == ["minivllm.serve.core"]


def test_no_test_code_in_the_package():
    assert not (ROOT / "testing").exists()
    assert not [name for name in MODULES if name.rpartition(".")[2].startswith(("test_", "conftest"))]

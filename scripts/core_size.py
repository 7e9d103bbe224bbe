"""The core's size beside nano-vllm's: non-blank lines of each file a reader of the core opens (the core's own files
and every minivllm module they import, followed to the end), file for file against nano-vllm's counterpart where it
has one. The extras (kernels' implementations, frontend/, serve/) are listed apart: a learner of the core can skip
them.

  python3 scripts/core_size.py            # the table
  python3 scripts/core_size.py --json     # the same as JSON"""

import argparse
import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "minivllm"
# nano-vllm at commit bb823b3: non-blank lines of its files (its whole package: 1,197 lines)
NANO_VLLM = {
    "config.py": 22,
    "sampling_params.py": 8,
    "llm.py": 3,
    "engine/sequence.py": 65,
    "engine/block_manager.py": 102,
    "engine/scheduler.py": 80,
    "engine/model_runner.py": 235,
    "engine/llm_engine.py": 81,
    "layers/activation.py": 8,
    "layers/attention.py": 66,
    "layers/embed_head.py": 56,
    "layers/layernorm.py": 44,
    "layers/linear.py": 127,
    "layers/rotary_embedding.py": 51,
    "layers/sampler.py": 9,
    "models/qwen3.py": 193,
    "utils/context.py": 21,
    "utils/loader.py": 24,
}
CORE = ["config.py", "sampling_params.py", "llm.py", "engine", "layers", "models", "utils/context.py"]
CORE += ["utils/loader.py", "utils/dist.py"]
EXTRAS = ("kernels/", "frontend/", "serve/")


def lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def imports(path: Path) -> set[Path]:
    """The minivllm modules a file imports (module-level and inside functions), as files."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] != "minivllm":
                continue
            base = ROOT.joinpath(*name.split(".")[1:])
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    found.add(candidate)
    return found


def reached(start: list[Path]) -> set[Path]:
    seen, todo = set(), list(start)
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            if not str(path.relative_to(ROOT)).startswith(EXTRAS):  # an extra's own imports are not the core's
                todo += imports(path)
    return seen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    start = [f for c in CORE for f in ((ROOT / c).rglob("*.py") if (ROOT / c).is_dir() else [ROOT / c])]
    files = {str(f.relative_to(ROOT)): lines(f) for f in reached(start) if lines(f)}
    core = {f: n for f, n in files.items() if not f.startswith(EXTRAS)}
    extras = {f: n for f, n in files.items() if f.startswith(EXTRAS)}
    named = {f: (core.get(f, 0), n) for f, n in NANO_VLLM.items()}
    report = dict(
        core_files=len(core),
        core_lines=sum(core.values()),
        extras_the_core_reaches=extras,
        named_lines=sum(ours for ours, _ in named.values()),
        named_nano_vllm_lines=sum(n for _, n in named.values()),
        files=dict(sorted(core.items())),
    )
    if args.json:
        print(json.dumps(report, indent=1))
        return
    print(f"{'file':<32} {'minivllm':>8} {'nano-vllm':>9} {'ratio':>6}")
    for f, n in sorted(core.items()):
        theirs = NANO_VLLM.get(f)
        ratio = f"{n / theirs:6.2f}" if theirs else ""
        print(f"{f:<32} {n:>8} {theirs or '':>9} {ratio}")
    print(f"core: {report['core_lines']} lines in {report['core_files']} files")
    ratio = report["named_lines"] / report["named_nano_vllm_lines"]
    print(f"the {len(NANO_VLLM)} files with nano-vllm's names: {report['named_lines']} lines, {ratio:.2f}x nano-vllm's")
    if extras:
        print(f"extras the core imports (the seams, and llm.py's front end): {sorted(extras)}")


if __name__ == "__main__":
    main()

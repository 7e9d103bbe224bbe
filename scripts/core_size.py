"""The core's size beside nano-vllm's: non-blank lines of each file a reader of the core opens (the core's own files
and every minivllm module they import, followed to the end), file for file against nano-vllm's counterpart where it
has one. The extras (kernels' implementations, frontend/, serve/) are listed apart: a learner of the core can skip
them. Then what a learner opens for chapters 01-14: the modules each notebook names in its first cell as the ones it
builds and verifies, and every minivllm module they import (an extra's own imports not followed: the seams), the
Triton kernels the chapters build included.

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
CORE += ["utils/loader.py"]
EXTRAS = ("kernels/", "frontend/", "serve/")
# chapter -> the modules its notebook names in its first cell as the ones it builds and verifies
CHAPTERS = {
    "01": ["layers/layernorm.py"],
    "02": ["layers/rotary_embedding.py"],
    "03": ["layers/activation.py"],
    "04": ["layers/linear.py"],
    "05": ["layers/embed_head.py"],
    "06": ["kernels/triton/store_kvcache.py", "layers/attention.py"],
    "07": ["kernels/attention_backend.py", "kernels/torch_attention.py", "kernels/triton/paged_decode.py"],
    "08": ["models/qwen3.py", "layers/attention.py"],
    "09": ["layers/sampler.py"],
    "10": ["models/qwen3.py", "utils/loader.py"],
    "11": ["engine/block_manager.py"],
    "12": ["engine/scheduler.py"],
    "13": ["engine/model_runner.py", "engine/cuda_graphs.py"],
    "14": ["llm.py", "engine/llm_engine.py"],
}
LEARNER_LIMIT = (3000, 32)  # lines, files


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


def reached(start: list[Path], follow_extras: tuple[str, ...] = ()) -> set[Path]:
    """The files `start` opens, and every minivllm module they import, followed to the end; an extra's own imports
    are not followed (they are not the core's), except under `follow_extras` (a chapter's own kernels)."""
    seen, todo = set(), list(start)
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            rel = str(path.relative_to(ROOT))
            if not rel.startswith(EXTRAS) or rel in follow_extras:
                todo += imports(path)
    return seen


def learner_files() -> dict[str, int]:
    """What a learner opens for chapters 01-14: each chapter's named modules and what they import."""
    named = sorted({m for modules in CHAPTERS.values() for m in modules})
    files = reached([ROOT / m for m in named], follow_extras=tuple(named))
    return {str(f.relative_to(ROOT)): lines(f) for f in files if lines(f)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    start = [f for c in CORE for f in ((ROOT / c).rglob("*.py") if (ROOT / c).is_dir() else [ROOT / c])]
    files = {str(f.relative_to(ROOT)): lines(f) for f in reached(start) if lines(f)}
    core = {f: n for f, n in files.items() if not f.startswith(EXTRAS)}
    extras = {f: n for f, n in files.items() if f.startswith(EXTRAS)}
    named = {f: (core.get(f, 0), n) for f, n in NANO_VLLM.items()}
    learner = learner_files()
    report = dict(
        learner_files=len(learner),
        learner_lines=sum(learner.values()),
        learner=dict(sorted(learner.items())),
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
    print(f"\nwhat a learner opens for chapters 01-14 (limit {LEARNER_LIMIT[0]} lines in {LEARNER_LIMIT[1]} files):")
    for f, n in sorted(learner.items()):
        print(f"  {f:<40} {n:>5}")
    print(f"chapters 01-14: {report['learner_lines']} lines in {report['learner_files']} files")


if __name__ == "__main__":
    main()

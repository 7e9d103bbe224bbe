"""The engine the learner built against the reference engine: greedy token ids from `LLM` on the package this
process imports, and the same from the repository's minivllm run in a fresh process (chapter 14's check and the
end of notebook 14).

    python3 tests/helpers/course_engine.py MODEL '{"prompts": [[1, 2, 3]], "max_tokens": 8, "engine": {...}}'
"""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# The engine on the package's own torch definitions: without these options an engine binds its kernels in their
# place (C++ norms, RoPE, SiLU-mul, KV store, decode attention and packed linears on a CPU; Triton and
# FlashAttention on a GPU), and the functions the learner wrote would never run. On a GPU the KV store stays a
# Triton kernel: the learner's (chapter 06).
ON_THE_PACKAGE = dict(
    attention_backend="torch",
    kernels=dict(compile=False, cpu_ops=False, cpu_packed_linear=False, fused_prologue=False),
)


def greedy(model: str, prompts: list[list[int]], max_tokens: int, engine: dict) -> list[list[int]]:
    """Greedy token ids of `LLM(model, **engine)` from the minivllm this process imports, on its torch definitions
    (ON_THE_PACKAGE: the functions of the package under check, not the kernels bound in their place)."""
    from minivllm import LLM, SamplingParams

    llm = LLM(model, **{**ON_THE_PACKAGE, **engine})
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.exit()


def reference_greedy(model: str, prompts: list[list[int]], max_tokens: int, engine: dict) -> list[list[int]]:
    """The same from the reference engine: the repository's minivllm, in a process of its own."""
    env = {k: v for k, v in os.environ.items() if k != "MINIVLLM_EDITION"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests")])
    spec = json.dumps({"prompts": prompts, "max_tokens": max_tokens, "engine": engine})
    out = subprocess.run(
        [sys.executable, __file__, model, spec], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    if out.returncode != 0:
        raise RuntimeError(f"the reference engine failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(result["package"]).resolve().is_relative_to(ROOT / "minivllm"):
        raise RuntimeError(f"the reference run imported {result['package']}, not the repository's minivllm")
    return result["tokens"]


def first_difference(got: list[list[int]], want: list[list[int]]) -> tuple[int, int] | None:
    """(prompt, token) of the first place two sets of answers differ, or None."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g != w:
            return i, next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
    return None


def chat_prompts(model: str, questions: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
        for q in questions
    ]


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())  # the repository's minivllm (cwd), before tests/helpers' directory
    import minivllm

    spec = json.loads(sys.argv[2])
    tokens = greedy(sys.argv[1], spec["prompts"], spec["max_tokens"], spec["engine"])
    print(json.dumps({"package": minivllm.__file__, "tokens": tokens}))

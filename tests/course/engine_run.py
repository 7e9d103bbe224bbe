"""Greedy token ids from an engine, printed as JSON: chapter 14 runs it in a fresh process on the repository's
minivllm (the reference engine) and compares with the package the check imports.

    python3 tests/course/engine_run.py MODEL '{"prompts": [[1, 2, 3]], "max_tokens": 8, "engine": {...}}'
"""

import json
import sys


def greedy(model: str, prompts: list[list[int]], max_tokens: int, engine: dict) -> list[list[int]]:
    from minivllm import LLM, SamplingParams

    llm = LLM(model, **engine)
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.exit()


if __name__ == "__main__":
    import minivllm

    spec = json.loads(sys.argv[2])
    tokens = greedy(sys.argv[1], spec["prompts"], spec["max_tokens"], spec["engine"])
    print(json.dumps({"package": minivllm.__file__, "tokens": tokens}))

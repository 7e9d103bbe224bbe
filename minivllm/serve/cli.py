"""`python3 -m minivllm serve [--model DIR] [--host H] [--port P] [engine arguments]` (and `minivllm serve`):
the OpenAI-compatible server (openai_server.py) on a checkpoint, by default the embedded SmolLM2-135M-Instruct.
The arguments are parsed before anything heavy is imported, so --help and a bad value answer at once."""

import argparse
import socket
import sys

DEFAULT_NAME = "SmolLM2-135M-Instruct"  # the served name of the embedded default model


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="minivllm serve", description="Serve a model over the OpenAI API (vLLM's serve).")
    p.add_argument("--model", metavar="DIR", help="Hugging Face checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument("--served-model-name", help="the model's name in the API (default: --model, as vLLM)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, metavar="N", help="tensor-parallel processes")
    p.add_argument("--max-model-len", type=int, help="prompt + output tokens per request at most")
    p.add_argument("--max-num-seqs", type=int, help="sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=int, help="tokens per step")
    p.add_argument("--gpu-memory-utilization", type=float, help="fraction of GPU memory the engine may use")
    p.add_argument("--block-size", type=int, dest="kvcache_block_size", help="tokens per KV-cache block")
    p.add_argument("--enforce-eager", action="store_true", default=None, help="no CUDA graphs")
    p.add_argument("--no-enable-prefix-caching", action="store_false", dest="enable_prefix_caching", default=None)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], help="weights and activations")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="default: CUDA if there is a GPU per TP rank")
    p.add_argument("--seed", type=int, help="the sampler's seed for requests without their own")
    p.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        metavar="N",
        help="API-server processes sharing the port and the one engine core (default: one per 4 CPU cores, 1 to 4)",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        metavar="N",
        help="a stream's tokens per event after its first (vLLM's; default 1: every token at once; more: fewer "
        "writes, less CPU per token)",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=60.0,  # openai_server.TIMEOUT_KEEP_ALIVE (not imported here: the server loads only when serving)
        metavar="SECONDS",
        help="close idle keep-alive connections after this long (default 60; uvicorn's 5 s can lose a request "
        "when a kernel compiling in the engine stalls the server, see openai_server.py)",
    )
    p.add_argument("--api-key", nargs="+", metavar="KEY", help="tokens /v1 requests must carry (env VLLM_API_KEY)")
    json_list = lambda text: _json_list(p, text)
    p.add_argument("--allowed-origins", type=json_list, default=["*"], help='CORS origins, JSON (default ["*"])')
    p.add_argument("--allowed-methods", type=json_list, default=["*"], help='CORS methods, JSON (default ["*"])')
    p.add_argument("--allowed-headers", type=json_list, default=["*"], help='CORS headers, JSON (default ["*"])')
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat template a request brings (chat_template); else such a request is a 400",
    )
    return p.parse_args(argv)


def _json_list(p: argparse.ArgumentParser, text: str) -> list[str]:
    import json

    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        p.error(f'expected a JSON list of strings such as ["*"], got {text!r}')
    return value


ENGINE_ARGS = (
    "tensor_parallel_size",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "kvcache_block_size",
    "enforce_eager",
    "enable_prefix_caching",
    "dtype",
    "device",
    "seed",
)


def port_free(host: str, port: int) -> bool:
    """Whether uvicorn could listen there: bound as uvicorn binds, with SO_REUSEADDR, so that the connections a
    server just stopped left in TIME_WAIT do not count (only a socket listening there does)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def serve_main(argv: list[str]) -> int:
    args = parse_serve_args(argv)
    fail = lambda message: print(f"minivllm serve: error: {message}", file=sys.stderr) or 2
    if args.timeout_keep_alive <= 0:
        return fail(f"--timeout-keep-alive must be > 0 seconds, got {args.timeout_keep_alive}")
    if args.stream_interval < 1:
        return fail(f"--stream-interval must be >= 1, got {args.stream_interval}")
    from minivllm.serve.api_servers import default_api_server_count, listen

    count = args.api_server_count if args.api_server_count is not None else default_api_server_count()
    if count < 1:
        return fail(f"--api-server-count must be >= 1, got {count}")
    sock = None
    try:  # before the engine takes its seconds to start; several API servers share the parent's socket
        sock = listen(args.host, args.port) if count > 1 else None
    except OSError:
        pass
    if (count > 1 and sock is None) or (count == 1 and not port_free(args.host, args.port)):
        return fail(f"cannot listen on {args.host}:{args.port}: the address is in use or not available")
    from minivllm.serve.messages import EngineDeadError
    from minivllm.serve.openai_server import run_server  # FastAPI and uvicorn: only when serving
    from minivllm.serve.server_options import ServerOptions

    options = ServerOptions.from_env(
        api_keys=args.api_key or [],
        allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
        trust_request_chat_template=args.trust_request_chat_template,
    )

    name = args.served_model_name or args.model or DEFAULT_NAME
    if args.model is None:
        from minivllm.frontend.default_model import default_model_dir

        args.model = default_model_dir()
    engine_args = {k: getattr(args, k) for k in ENGINE_ARGS if getattr(args, k) is not None}
    serve = dict(model=args.model, host=args.host, port=args.port, served_model_name=name)
    serve.update(log_level=args.log_level, timeout_keep_alive=args.timeout_keep_alive, options=options)
    serve.update(stream_interval=args.stream_interval)
    if sock is not None:  # several API-server processes (api_servers.py)
        from minivllm.serve.api_servers import run_multi_api_server

        return run_multi_api_server(sock, count, engine_args, serve)
    try:
        run_server(**serve, **engine_args)
    except EngineDeadError as e:  # the core died while serving: exit non-zero, for a supervisor to restart us
        print(f"minivllm serve: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError, TypeError, RuntimeError) as e:  # a bad checkpoint, a TP worker that died
        return fail(str(e))
    return 0

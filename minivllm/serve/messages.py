"""The messages between the API server process and the engine-core process (vLLM V1's EngineCoreRequest /
EngineCoreOutputs), as msgspec structs sent as MessagePack over two ZeroMQ PUSH/PULL sockets (core.py,
core_client.py):

    API server process                                      engine-core process
    ------------------                                      -------------------
    AddRequest(id, prompt token ids, params) ------------>  engine.add_request
    Abort(ids) / AbortAll() / Utility(call, name) ------->  engine.abort_request / reset_prefix_cache
    Shutdown() ------------------------------------------>  abort everything, stop the engine and TP workers
                 <--------------------------------------    Ready(model facts) once, or Ready(error=...)
                 <--------------------------------------    StepOutputs: ONE per engine step, every request
                                                            that got tokens (new ids, logprobs, finish reason)

Why msgspec: a step's outputs for 256 streams encode and decode in tens of microseconds, typed, without
pickle's cost; only SamplingParams travels pickled (a dataclass others extend, which may hold objects that
MessagePack cannot carry). A request in the core has one sequence: the front end fans `n` out into `n`
requests, as vLLM V1 does (ParentRequest), so that a stop string found by its detokeniser ends one of them."""

import pickle

import msgspec

from minivllm.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine (its thread or its process) stopped on an error or was shut down: no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine could not run this request (an error of its own, finish_reason "error"): it alone fails (a 500)."""


# --- to the core ----------------------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: bytes  # pickled SamplingParams, n == 1

    @staticmethod
    def make(request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> "AddRequest":
        return AddRequest(request_id, prompt_token_ids, pickle.dumps(params))

    def sampling_params(self) -> SamplingParams:
        return pickle.loads(self.params)


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class AbortAll(msgspec.Struct, tag=True, array_like=True):
    pass


class Utility(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    name: str  # a method of the engine core that takes no argument ("reset_prefix_cache")


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToCore = AddRequest | Abort | AbortAll | Utility | Shutdown


# --- from the core --------------------------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The engine started (what the front end needs to tokenise and validate), or why it could not."""

    error: str | None = None
    model: str = ""
    max_model_len: int = 0
    kvcache_block_size: int = 0
    num_kvcache_blocks: int = 0
    vocab_size: int = 0
    eos_token_ids: list[int] = []
    seed: int | None = None
    tensor_parallel_size: int = 1
    tokenizer: str = ""  # the directory the core loaded its tokenizer from (the front end loads the same)


class RequestStep(msgspec.Struct, array_like=True):
    """What one request got in one step."""

    request_id: str
    new_token_ids: list[int]
    # per new token: [(token id, logprob, rank, decoded text)], the sampled token first; None without logprobs
    new_logprobs: list[list[tuple[int, float, int | None, str | None]]] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort", or "error" (then stop_reason is the message)
    stop_reason: int | str | None = None
    # once, when the prompt is scored: per prompt token, as new_logprobs (the actual token first); the first None
    prompt_logprobs: list[list[tuple[int, float, int | None, str | None]] | None] | None = None
    error_status: int = 400  # of an "error": 400, the core refused the request; 500, it failed in a step


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    num_preemptions: int


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[RequestStep]
    stats: SchedulerStats
    utility: tuple[int, bool] | None = None  # (call id, result) of a Utility call


FromCore = Ready | StepOutputs


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(kind) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)

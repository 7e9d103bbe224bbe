"""The messages between the API server process and the engine-core process (vLLM V1's EngineCoreRequest /
EngineCoreOutputs), as msgspec structs sent as MessagePack over two ZeroMQ PUSH/PULL sockets (core.py,
core_client.py):

    API server process                                      engine-core process
    ------------------                                      -------------------
    AddRequest(id, prompt token ids, params) ------------>  engine.add_request
    Abort(ids) / AbortAll() / Utility(call, name) ------->  engine.abort_request / reset_prefix_cache
    FinishSequences([(id, index)]) ---------------------->  engine.finish_sequences (their text hit a stop string)
    Shutdown() ------------------------------------------>  abort everything, stop the engine and TP workers
                 <--------------------------------------    Ready(model facts) once, or Ready(error=...)
                 <--------------------------------------    StepOutputs: ONE per engine step, the engine's
                                                            EngineOutputs (new token ids, raw logprob rows,
                                                            finish reasons), requests refused, gauges

Why msgspec: a step's outputs for 256 streams encode and decode in tens of microseconds, typed, without
pickle's cost; only SamplingParams travels pickled (a dataclass others extend, which may hold objects that
MessagePack cannot carry). The engine's EngineOutput (a dataclass) travels as it is: the API server's output
processor (frontend/output_processor.py) reads the same objects as `LLM`'s does."""

import pickle

import msgspec

from minivllm.engine.request import EngineOutput
from minivllm.sampling_params import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine (its thread or its process) stopped on an error or was shut down: no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine could not run this request (an error of its own, finish_reason "error"): it alone fails (a 500)."""


def failure_of(output):
    """What a finished output's stream receives: RequestFailedError when the engine failed the request (engine/
    request.py's fail ends every sequence of it with finish_reason "error" and the message), else the output."""
    failed = [c.stop_reason for c in output.outputs if c.finish_reason == "error"]
    return RequestFailedError(failed[0]) if failed else output


# --- to the core ----------------------------------------------------------------------------------------


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: bytes  # pickled SamplingParams (resolved by the front end's Processor)

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


class FinishSequences(msgspec.Struct, tag=True, array_like=True):
    targets: list[tuple[str, int]]  # (request id, sequence index): their text reached a stop string


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToCore = AddRequest | Abort | AbortAll | Utility | FinishSequences | Shutdown


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


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks in use
    num_preemptions: int


class StepOutputs(msgspec.Struct, tag=True, array_like=True):
    outputs: list[EngineOutput]
    stats: SchedulerStats
    utility: tuple[int, bool] | None = None  # (call id, result) of a Utility call
    refused: list[tuple[str, str]] = []  # (request id, why): requests the engine did not queue


FromCore = Ready | StepOutputs


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def decoder(kind) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(kind)

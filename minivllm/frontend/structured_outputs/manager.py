"""The engine's side of structured outputs: it compiles each request's grammar off the step loop, gives each of
the request's sequences its own matcher, and after each step advances the matchers by the tokens just sampled,
finishing a sequence whose matcher has terminated.

Compiling a grammar against the vocabulary can take seconds (a large schema, a regex with many states, a big
vocabulary); in the step loop it would stall every running stream that long. So, as vLLM's, a request with a
grammar waits out of the scheduler while a thread of a small pool compiles it (`submit`), and the engine takes it
into the scheduler at the first step after the compile is done (`ready`). xgrammar compiles without the GIL, so
the steps go on meanwhile. Whether the grammar parses was checked when the request was made (processor.py): an
invalid one is refused before it is queued.

The compiler is built at the first request with a grammar (reading the vocabulary into xgrammar takes ~0.25 s
for SmolLM2's 49,152 tokens), in the pool too, under a lock."""

import concurrent.futures
import logging
import threading

from minivllm.engine.sequence import Sequence
from minivllm.frontend.structured_outputs.bitmask import matcher_of

logger = logging.getLogger(__name__)


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, list(stop_token_ids)
        self._compiler = None
        self._lock = threading.Lock()
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None  # made at the first grammar
        self.pending: dict[str, tuple] = {}  # request id -> (request, future of its compiled grammar)

    @property
    def compiler(self):
        """This engine's GrammarCompiler (grammar.py), made at first use."""
        with self._lock:
            if self._compiler is None:
                from minivllm.frontend.structured_outputs.grammar import GrammarCompiler  # loads xgrammar

                self._compiler = GrammarCompiler.from_tokenizer(self.tokenizer, self.vocab_size, self.stop_token_ids)
            return self._compiler

    def submit(self, request_id: str, seqs: list[Sequence]) -> bool:
        """Start compiling the grammar of a request's sequences in the pool; False when it has none (it can be
        scheduled now)."""
        params = seqs[0].sampling_params.structured_outputs
        if params is None:
            return False
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="minivllm-grammar")
        self.pending[request_id] = (seqs, self.pool.submit(lambda: self.compiler.compile(params)))
        return True

    def ready(self, wait: float = 0.0) -> list[tuple[str, Exception | None]]:
        """The requests whose grammar finished compiling (waiting up to `wait` seconds for one), each with its
        sequences' matchers attached, or with the compile's error: (request id, error or None)."""
        if wait and self.pending:
            futures = [f for _, f in self.pending.values()]
            concurrent.futures.wait(futures, timeout=wait, return_when=concurrent.futures.FIRST_COMPLETED)
        done = []
        for rid, (seqs, future) in list(self.pending.items()):
            if not future.done():
                continue
            del self.pending[rid]
            try:
                compiled = future.result()
            except Exception as e:
                done.append((rid, e))
                continue
            for seq in seqs:
                seq.grammar = self.compiler.matcher(compiled)
            done.append((rid, None))
        return done

    def shutdown(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)

    def advance(self, sampled: list[tuple[Sequence, int]], finish) -> list[Sequence]:
        """A step's tokens are in (scheduler.on_result): each grammar sequence still running accepts its new
        token; one whose matcher has terminated (it accepted end-of-sequence, e.g. with ignore_eos) is ended by
        `finish(seq, "stop")` (the scheduler's). Returns the sequences it finished."""
        finished = []
        for seq, pos in sampled:
            matcher = matcher_of(seq)
            if matcher is None or seq.is_finished:
                continue
            token = seq.token_ids[pos]
            accepted = matcher.accept_token(token)
            if not accepted:  # the mask allowed only what the grammar accepts: not expected
                logger.error("request %s: its grammar rejected token %d; the sequence stops", seq.request_id, token)
            if not accepted or matcher.is_terminated():
                finish(seq, "stop")
                finished.append(seq)
        return finished

"""Text of one sequence's output, one token at a time, and its stop strings (vLLM's incremental detokeniser).

Decoding each new token alone is wrong: a character may span tokens (UTF-8 bytes of byte-level BPE), and some
tokenizers decode a token differently at the start of a text (SentencePiece drops the leading space). The
`tokenizers` library's `DecodeStream` does it right: it keeps a short window of the tokens before, decodes it
with and without the new token, and gives the difference, or None while a character is not complete. When the
sequence ends on such a character, the text is completed from one decode of the whole output (its U+FFFD),
so the final text is exactly `tokenizer.decode(output)`.

A stop string may straddle tokens, so it is searched in the text around the new characters. The text a stream
shows holds back the last `len(longest stop) - 1` characters until the sequence ends, so that a client never
sees the start of a stop string that is then cut."""

from tokenizers.decoders import DecodeStream

from minivllm.sampling_params import SamplingParams


class Detokenizer:
    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer  # a fast (Rust-backed) Hugging Face tokenizer
        self.backend = tokenizer.backend_tokenizer  # (its `tokenizers` object: DecodeStream steps on it)
        self.skip_special_tokens = params.skip_special_tokens
        self.stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop, self.include_stop = params.stop, params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.hold = max(map(len, self.stop)) - 1 if self.stop and not self.include_stop else 0
        self.text = ""
        self.ids: list[int] = []  # the tokens whose text this is
        self.incomplete = 0  # tokens fed since the stream last gave text (a character not complete yet)

    def add(self, token_ids: list[int], final: bool = False) -> str | None:
        """Extend the text by `token_ids` (with `final`, also by a character still incomplete). Returns the stop
        string found in the new text, if any: the text is then cut before it (or after it, with
        include_stop_str_in_output)."""
        start = len(self.text)
        for token in token_ids:
            self.ids.append(token)
            piece = self.stream.step(self.backend, token)
            if piece is None:
                self.incomplete += 1
            else:
                self.text, self.incomplete = self.text + piece, 0
        if final and self.incomplete:  # the stream holds back a partial character: decode's text has it
            whole = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
            self.text += whole[len(self.text) :]
            self.incomplete = 0
        num_new = len(self.text) - start
        if not self.stop or num_new == 0 or len(self.ids) <= self.min_tokens:
            return None
        return self.find_stop(num_new)

    def find_stop(self, num_new: int) -> str | None:
        """The earliest stop string that ends in the last `num_new` characters; cuts the text there."""
        found = None
        for s in self.stop:
            i = self.text.find(s, max(0, len(self.text) - num_new - len(s) + 1))
            if i != -1 and (found is None or i < found[1]):
                found = (s, i)
        if found is None:
            return None
        s, i = found
        self.text = self.text[: i + len(s) if self.include_stop else i]
        return s

    def visible(self, finished: bool) -> str:
        """The text a stream may show now (all of it once finished)."""
        return self.text if finished or not self.hold else self.text[: max(0, len(self.text) - self.hold)]

    def visible_since(self, start: int, finished: bool) -> str:
        """visible(finished)[start:], without copying the text before `start` (a stream's next piece)."""
        end = len(self.text) if finished or not self.hold else max(0, len(self.text) - self.hold)
        return self.text[start:end]

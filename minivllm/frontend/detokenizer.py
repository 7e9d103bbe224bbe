"""Text of one sequence's output, one token at a time, and its stop strings (vLLM's incremental detokeniser).

Decoding each new token alone is wrong: a character may span tokens (UTF-8 bytes of byte-level BPE), and
some tokenizers decode a token differently at the start of a text (SentencePiece drops the leading space).
So each step decodes a short window twice, `ids[prefix:read]` (text already emitted) and `ids[prefix:]`
(the same with the new tokens); the new text is the difference. While the window ends inside a character
(the text ends in U+FFFD) nothing is emitted and the window grows. Two small decodes per token, and only
for sequences that need text at every step (stop strings, streaming); the others decode once at the end.

A stop string may straddle tokens, so it is searched in the text around the new characters. The text a
stream shows holds back the last `len(longest stop) - 1` characters until the sequence ends, so that a
client never sees the start of a stop string that is then cut."""

from minivllm.sampling_params import SamplingParams


class Detokenizer:
    def __init__(self, tokenizer, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop, self.include_stop = params.stop, params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        self.hold = max(map(len, self.stop)) - 1 if self.stop and not self.include_stop else 0
        self.text = ""
        self.prefix = self.read = 0  # window: ids[prefix:read] is decoded text already emitted

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, ids: list[int], final: bool = False) -> str | None:
        """`ids` is the output so far, its newest token last. Extend the text (with `final`, also by a character
        still incomplete). Returns the stop string found in the new text, if any: the text is then cut before
        it (or after it, with include_stop_str_in_output)."""
        before = self.decode(ids[self.prefix : self.read])
        after = self.decode(ids[self.prefix :])
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return None  # nothing new yet: a special token skipped, or a character not complete
        new = after[len(before) :]
        self.prefix, self.read = self.read, len(ids)
        self.text += new
        if not self.stop or len(ids) <= self.min_tokens:
            return None
        return self.find_stop(len(new))

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

"""The engine's grammar compiler: a request's StructuredOutputsParams compiled by xgrammar against this engine's
vocabulary, into a grammar whose matchers say which token ids may come next (vLLM's xgrammar backend).

The vocabulary is the model's (its logits' width), which may be wider than the tokenizer's: the ids beyond the
tokenizer are never allowed. The end-of-sequence ids are the engine's, so that the grammar allows them exactly
where it may end. Compiled grammars are cached by the compiler (a schema sent again compiles once), per engine:
two engines in one process have two caches. An invalid schema, regex or grammar is a ValueError naming it."""

import json
import re

import xgrammar as xgr

from minivllm.frontend.structured_outputs.params import StructuredOutputsParams

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # vLLM's json_object: any JSON object (not any JSON value)
WHAT = dict(json="JSON schema", json_object="JSON schema", regex="regex", choice="choice", grammar="EBNF grammar")


def choice_grammar(choice: list[str]) -> str:
    """An EBNF grammar whose language is exactly `choice`: `root ::= "a" | "b"` (JSON string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choice)


def reason(e: Exception) -> str:
    """xgrammar's message without its C++ prefix ("[12:00:00] /project/cpp/x.cc:12: Check failed: ... is false: ")."""
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
    text = re.sub(r"^Check failed: .*? is false: ", "", text)
    return text if len(text) <= 300 else text[:300] + "..."


def grammar_of(params: StructuredOutputsParams) -> xgr.Grammar:
    """The request's grammar over characters, without a vocabulary: what the API server checks before it
    sends a request to the engine core (ValueError naming an invalid schema, regex or grammar)."""
    kind = params.kind
    try:
        if kind in ("json", "json_object"):
            return xgr.Grammar.from_json_schema(schema_of(params), any_whitespace=not params.disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(params.regex)
        return xgr.Grammar.from_ebnf(choice_grammar(params.choice) if kind == "choice" else params.grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs {kind} is not a valid {WHAT[kind]}: {reason(e)}") from None


def schema_of(params: StructuredOutputsParams) -> str:
    """The JSON schema's text of a json or json_object constraint."""
    schema = params.json if params.kind == "json" else JSON_OBJECT_SCHEMA
    return schema if isinstance(schema, str) else json.dumps(schema)


class GrammarCompiler:
    def __init__(self, info: xgr.TokenizerInfo) -> None:
        self.vocab_size = info.vocab_size
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=True)

    @classmethod
    def from_tokenizer(cls, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> "GrammarCompiler":
        """The compiler of a Hugging Face tokenizer's vocabulary, padded to the model's `vocab_size`."""
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids))

    def compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        """The compiled grammar of `params` (ValueError when its schema, regex or grammar is invalid): its grammar
        over characters (`grammar_of`), compiled against this engine's vocabulary."""
        return self.compiler.compile_grammar(grammar_of(params))

    @staticmethod
    def matcher(grammar: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        """A matcher at the start of `grammar`: one per sequence, advanced by each of its tokens."""
        return xgr.GrammarMatcher(grammar)

"""`StructuredOutputsParams`, vLLM's `SamplingParams.structured_outputs`: which language a request's output must
belong to. Exactly one constraint is set; a bad value is a ValueError naming the field (whether a schema, regex or
grammar is valid is known when it is compiled: grammar.py)."""

import json as json_lib
from dataclasses import dataclass

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema, as a dict or its JSON text
    regex: str | None = None  # a regular expression the whole output matches
    choice: list[str] | None = None  # the output is one of these strings
    grammar: str | None = None  # an EBNF grammar (xgrammar's dialect: `root ::= ...`)
    json_object: bool | None = None  # True: any JSON object
    disable_any_whitespace: bool = False  # JSON: no whitespace beyond the separators ", " and ": "

    def __post_init__(self) -> None:
        kinds = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            found = f"got {', '.join(kinds)}" if kinds else "got none"
            raise ValueError(f"structured_outputs needs exactly one of {', '.join(KINDS)}; {found}")
        if self.json is not None:
            if isinstance(self.json, str):
                try:
                    json_lib.loads(self.json)
                except (ValueError, RecursionError) as e:  # (RecursionError: nested too deeply)
                    raise ValueError(f"structured_outputs json is not valid JSON text: {e}") from None
            elif not isinstance(self.json, dict):
                raise ValueError(f"structured_outputs json must be a JSON schema (dict or str), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise ValueError(
                    f"structured_outputs choice must be a non-empty list of non-empty strings, got {choice!r}"
                )
            self.choice = list(choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs json_object must be a boolean, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        """The constraint set: json, regex, choice, grammar or json_object."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

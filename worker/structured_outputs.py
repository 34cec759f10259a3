"""What a request's output must match: a JSON Schema, any JSON object, a regex, an EBNF grammar,
one of a list of strings, or an xgrammar structural tag (vLLM's `StructuredOutputsParams`,
spelled as vLLM spells it; tool calls are enforced by a structural tag, worker/tools.py).

Torch-free and free of the grammar engine: a router builds and checks these; the group's engine
compiles them (worker/engine/grammar.py), where a constraint the grammar engine refuses is
refused with its message. Checked here is only what needs no compiler: exactly one kind, its
type, a JSON Schema that parses to an object, and sizes (a grammar too large would hold the
compiler's thread for long; generous against real use).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

MAX_CONSTRAINT_CHARS = 64 * 1024  # a schema, regex or grammar, as text
MAX_CHOICES = 256
MAX_CHOICE_CHARS = 1024
KINDS = ("json", "regex", "grammar", "choice", "json_object", "structural_tag")


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint on a request's output; exactly one field is set.

    json: a JSON Schema (a dict, or its text); regex: a regular expression the whole output
    matches; grammar: an EBNF (GBNF) grammar whose `root` rule the output derives; choice: the
    output is one of these strings; json_object: any JSON object; structural_tag: an xgrammar
    structural tag (a dict, or its text: `{"type": "structural_tag", "format": {...}}`), whose
    JSON Schemas are written without free whitespace as `json`'s are. Every bad value raises a
    ValueError naming the field.
    """

    json: dict | str | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    json_object: bool = False
    structural_tag: dict | str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, str):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"StructuredOutputs takes exactly one of {', '.join(KINDS)}; got {len(given)}"
                + (f" ({', '.join(given)})" if given else "")
            )
        check = {
            "json": self._check_json,
            "regex": self._check_text,
            "grammar": self._check_text,
            "choice": self._check_choice,
            "json_object": self._check_flag,
            "structural_tag": self._check_json,
        }
        check[given[0]](given[0])

    @property
    def kind(self) -> str:
        """The field that is set: json, regex, grammar, choice or json_object."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """The constraint's canonical form: (kind, text). Two constraints with the same key
        compile to the same grammar, so compiled grammars are cached by it (a schema's
        whitespace dropped; not its keys' order, which is the order the output's properties
        are written in)."""
        kind = self.kind
        if kind in ("json", "structural_tag"):
            return kind, canonical_json(self._object(kind))
        if kind == "choice":
            return kind, json.dumps(list(self.choice), ensure_ascii=False)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)

    @property
    def schema(self) -> dict:
        """The JSON Schema as a dict (json only)."""
        return self._object("json")

    def _object(self, name: str) -> dict:
        value = getattr(self, name)
        return json.loads(value) if isinstance(value, str) else value

    def _check_json(self, name: str) -> None:
        value = getattr(self, name)
        what = "a JSON Schema object" if name == "json" else "a JSON object"
        if isinstance(value, str):
            _check_size(name, value)
            try:
                value = json.loads(value)
            except ValueError as e:
                raise ValueError(f"StructuredOutputs.{name} is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"StructuredOutputs.{name} must be {what}, got {type(value).__name__}")
        try:
            text = canonical_json(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"StructuredOutputs.{name} cannot be written as JSON: {e}") from None
        _check_size(name, text)

    def _check_text(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, str) or not value:
            raise ValueError(f"StructuredOutputs.{name} must be a non-empty string")
        _check_size(name, value)

    def _check_choice(self, name: str) -> None:
        choices = self.choice
        if isinstance(choices, str) or not choices:
            raise ValueError("StructuredOutputs.choice must be a non-empty list of strings")
        if len(choices) > MAX_CHOICES:
            raise ValueError(f"StructuredOutputs.choice has {len(choices)} entries; at most {MAX_CHOICES} allowed")
        for i, c in enumerate(choices):
            if not isinstance(c, str) or not 0 < len(c) <= MAX_CHOICE_CHARS:
                raise ValueError(
                    f"StructuredOutputs.choice[{i}] must be a non-empty string of at most {MAX_CHOICE_CHARS} characters"
                )

    def _check_flag(self, name: str) -> None:
        if self.json_object is not True:
            raise ValueError("StructuredOutputs.json_object must be True or False")


StructuredOutputsParams = StructuredOutputs  # vLLM's name for the same thing


def canonical_json(value: object) -> str:
    """`value` as JSON without whitespace, its keys in their order."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def _check_size(name: str, text: str) -> None:
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"StructuredOutputs.{name} is {len(text)} characters; at most {MAX_CONSTRAINT_CHARS} allowed")

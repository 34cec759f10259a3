"""JSON Schemas for the validity suite of structured outputs: objects, arrays, enums, nested
objects, `anyOf`, `pattern`, numeric bounds, required and optional fields, `const`, booleans and
nulls. Every string, array and number is bounded, so that a random model at temperature 1 ends
each output within a short max_tokens (a string only ends when its closing quote is drawn)."""

from __future__ import annotations

SHORT = {"type": "string", "maxLength": 6}
WORD = {"type": "string", "pattern": "^[a-z]{1,5}$"}
SMALL = {"type": "integer", "minimum": 0, "maximum": 99}
COLOR = {"enum": ["red", "green", "blue"]}


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required}


SCALARS = [
    SHORT,
    WORD,
    SMALL,
    COLOR,
    {"type": "boolean"},
    {"type": "null"},
    {"type": "integer", "minimum": -50, "maximum": 50},
    {"type": "integer", "minimum": 1000, "maximum": 1010},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"},
    {"type": "string", "pattern": "^(yes|no)$"},
    {"const": "fixed"},
    {"enum": [1, 2, 3, "x", None, True]},
    {"anyOf": [SMALL, {"type": "boolean"}]},
    {"anyOf": [WORD, {"type": "null"}]},
]

SCHEMAS: list[dict] = (
    [obj({"v": s}) for s in SCALARS]  # 15: each scalar as an object's property
    + [{"type": "array", "items": s, "minItems": 1, "maxItems": 3} for s in SCALARS[:10]]  # 10 arrays
    + [
        obj({"name": SHORT, "age": SMALL}),
        obj({"name": SHORT, "age": SMALL}, required=["name"]),
        obj({"a": COLOR, "b": {"type": "boolean"}, "c": SMALL}, required=["a", "c"]),
        obj(
            {
                "id": {"type": "integer", "minimum": 1, "maximum": 9},
                "tags": {"type": "array", "items": WORD, "maxItems": 2},
            }
        ),
        obj({"point": obj({"x": SMALL, "y": SMALL})}),
        obj({"outer": obj({"inner": obj({"leaf": WORD})})}),
        obj({"items": {"type": "array", "items": obj({"k": WORD, "v": SMALL}), "maxItems": 2}}),
        obj({"choice": {"anyOf": [obj({"cat": WORD}), obj({"dog": SMALL})]}}),
        obj({"status": {"enum": ["ok", "error"]}, "code": {"type": "integer", "minimum": 100, "maximum": 599}}),
        obj({"flag": {"type": "boolean"}, "note": {"anyOf": [SHORT, {"type": "null"}]}}),
        obj(
            {
                "rgb": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 255},
                    "minItems": 3,
                    "maxItems": 3,
                }
            }
        ),
        obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
        obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}),
        obj({"kind": {"const": "book"}, "pages": SMALL}),
        obj({"first": WORD, "last": WORD, "middle": WORD}, required=["first", "last"]),
        obj({"colors": {"type": "array", "items": COLOR, "minItems": 1, "maxItems": 3}}),
        obj({"matrix": {"type": "array", "items": {"type": "array", "items": SMALL, "maxItems": 2}, "maxItems": 2}}),
        obj({"empty": obj({})}),
        obj({"n": {"type": "integer", "minimum": 5, "maximum": 5}}),
        obj({"pair": {"type": "array", "prefixItems": [WORD, SMALL], "items": False, "minItems": 2}}),
        obj({"level": {"enum": ["low", "mid", "high"]}, "score": {"type": "integer", "minimum": 0, "maximum": 10}}),
        obj({"user": obj({"name": SHORT, "admin": {"type": "boolean"}}), "group": WORD}),
        obj({"x": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]}}),
        obj({"letters": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}}),
        obj({"ok": {"type": "boolean"}, "errors": {"type": "array", "items": SHORT, "maxItems": 2}}),
        obj({"a": SMALL, "b": SMALL, "c": SMALL, "d": SMALL}),
        obj({"a": SMALL, "b": SMALL, "c": SMALL, "d": SMALL}, required=[]),
        obj({"nested": {"type": "array", "items": obj({"p": obj({"q": {"type": "boolean"}})}), "maxItems": 2}}),
        obj({"version": {"type": "string", "pattern": "^v[0-9]\\.[0-9]$"}}),
        obj({"maybe": {"anyOf": [obj({"yes": {"type": "boolean"}}), {"type": "null"}]}}),
        {"type": "array", "items": obj({"id": SMALL}), "minItems": 1, "maxItems": 2},
        {"type": "array", "items": {"anyOf": [SMALL, COLOR]}, "maxItems": 3},
        {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, "maxItems": 2},
        {"anyOf": [obj({"a": SMALL}), obj({"b": WORD})]},
        {"anyOf": [SMALL, COLOR, {"type": "null"}]},
        {"enum": ["alpha", "beta", "gamma", "delta"]},
        {"type": "integer", "minimum": 10, "maximum": 20},
        {"type": "boolean"},
        {"type": "string", "pattern": "^[a-f0-9]{4}$"},
        obj(
            {
                "title": {"type": "string", "minLength": 1, "maxLength": 3},
                "year": {"type": "integer", "minimum": 1990, "maximum": 2024},
            }
        ),
    ]
)
assert len(SCHEMAS) >= 60, len(SCHEMAS)

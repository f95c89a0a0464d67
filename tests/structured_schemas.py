"""JSON schemas for the structured-output tests and bench: (name, prompt, schema) triples.

Every schema bounds its output (enums, ``maxLength``, ``maxItems``, integer ranges), so a
constrained generation ends well within ``MAX_TOKENS`` whatever the model prefers; an output cut
by the length limit would not parse and the test would (rightly) fail.
"""

from __future__ import annotations

MAX_TOKENS = 96

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
_WORD = {"type": "string", "pattern": "^[a-z]{1,8}$"}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False}


SCHEMAS: list[tuple[str, str, dict]] = [
    ("person", "A person as JSON: ", _obj({"name": _NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("boolean_flag", "Is the sky blue? Answer in JSON: ", _obj({"answer": {"type": "boolean"}})),
    ("color_enum", "Pick a color, JSON: ", _obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("city", "A city and its country as JSON: ", _obj({"city": _NAME, "country": _NAME})),
    ("tags", "Three tags for a blog post about cats, as JSON: ",
     _obj({"tags": {"type": "array", "items": _WORD, "minItems": 1, "maxItems": 3}})),
    ("nested_address", "A user with an address, JSON: ",
     _obj({"user": _NAME, "address": _obj({"street": _NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})),
    ("optional_fields", "A book as JSON: ",
     _obj({"title": _NAME, "year": {"type": "integer", "minimum": 1000, "maximum": 2100}}, required=["title"])),
    ("nullable", "A product with an optional discount, JSON: ",
     _obj({"product": _NAME, "discount": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 90},
                                                    {"type": "null"}]}})),
    ("const_version", "A config file as JSON: ", _obj({"version": {"const": 2}, "name": _WORD})),
    ("int_enum", "Rate the movie from 1 to 5, JSON: ", _obj({"stars": {"enum": [1, 2, 3, 4, 5]}})),
    ("top_level_array", "A list of up to three numbers as JSON: ",
     {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3}),
    ("array_of_objects", "Two pets as JSON: ",
     {"type": "array", "minItems": 1, "maxItems": 2,
      "items": _obj({"kind": {"enum": ["cat", "dog", "fish"]}, "name": _NAME})}),
    ("defs_ref", "A point in 2D as JSON: ",
     {"$defs": {"coord": {"type": "integer", "minimum": -100, "maximum": 100}},
      "type": "object", "properties": {"x": {"$ref": "#/$defs/coord"}, "y": {"$ref": "#/$defs/coord"}},
      "required": ["x", "y"], "additionalProperties": False}),
    ("one_of_shapes", "A shape as JSON: ",
     {"anyOf": [_obj({"circle": {"type": "integer", "minimum": 1, "maximum": 9}}),
                _obj({"square": {"type": "integer", "minimum": 1, "maximum": 9}})]}),
    ("status_code", "An HTTP response as JSON: ",
     _obj({"code": {"enum": [200, 301, 404, 500]}, "ok": {"type": "boolean"}})),
    ("date_pattern", "Today's date as JSON: ",
     _obj({"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}})),
    ("email_pattern", "A contact as JSON: ",
     _obj({"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}})),
    ("matrix", "A 2x2 matrix of digits as JSON: ",
     _obj({"rows": {"type": "array", "minItems": 2, "maxItems": 2,
                    "items": {"type": "array", "minItems": 2, "maxItems": 2,
                              "items": {"type": "integer", "minimum": 0, "maximum": 9}}}})),
    ("weather", "The weather report as JSON: ",
     _obj({"temp_c": {"type": "integer", "minimum": -40, "maximum": 50},
           "sky": {"enum": ["sunny", "cloudy", "rain"]}, "windy": {"type": "boolean"}})),
    ("translation", "Translate 'hello' to French, JSON: ", _obj({"source": _WORD, "target": _WORD})),
    ("inventory", "A shop inventory entry as JSON: ",
     _obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
           "count": {"type": "integer", "minimum": 0, "maximum": 999}, "tags": {"type": "array", "items": _WORD,
                                                                              "maxItems": 2}})),
    ("string_enum_list", "Days of a weekend as JSON: ",
     {"type": "array", "items": {"enum": ["sat", "sun"]}, "minItems": 1, "maxItems": 2}),
]

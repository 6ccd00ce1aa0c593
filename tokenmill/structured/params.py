"""What a request asks its output to look like: vLLM's `StructuredOutputsParams`, and OpenAI `response_format`.

`StructuredOutputsParams` is a msgspec struct so it travels inside `SamplingParams` to the engine-core process.
Exactly one constraint kind is set per request:

    json            a JSON schema (dict, or its JSON text)
    regex           a regular expression the whole output must match
    choice          the output is exactly one of these strings
    grammar         an EBNF (GBNF, `root ::= ...`) grammar, or a Lark grammar (`start: ...`)
    json_object     any JSON object (OpenAI's response_format json_object)
    structural_tag  xgrammar structural tag, as JSON text (vLLM's format, legacy `structures` or `format`)

The options (disable_any_whitespace, disable_additional_properties) refine `json` / `json_object`. Checks here are
cheap and structural; whether a schema, regex or grammar actually compiles is `backend_xgrammar.validate`'s job.
"""
from __future__ import annotations

import json as _json
from typing import Any

import msgspec

CONSTRAINT_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One request's output constraint, with vLLM's field names and meanings."""
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def __post_init__(self) -> None:
        # A pydantic model class is accepted offline for convenience (vLLM examples pass Model.model_json_schema()).
        if isinstance(self.json, type) and hasattr(self.json, "model_json_schema"):
            self.json = self.json.model_json_schema()
        if isinstance(self.json, bool):  # the schemas `true` (anything) and `false` (nothing)
            if not self.json:
                raise ValueError("structured_outputs.json is the schema `false`, which no output can match")
            self.json = {}
        if isinstance(self.structural_tag, dict):
            self.structural_tag = _json.dumps(self.structural_tag)
        set_fields = self.constraint_fields()
        if len(set_fields) != 1:
            got = "none of them" if not set_fields else " and ".join(set_fields)
            raise ValueError("structured_outputs needs exactly one of " + ", ".join(CONSTRAINT_FIELDS)
                             + f"; got {got}")
        self._check_types()

    def constraint_fields(self) -> list[str]:
        """Names of the constraint fields that are set (json_object counts only when true)."""
        return [name for name in CONSTRAINT_FIELDS
                if (bool(self.json_object) if name == "json_object" else getattr(self, name) is not None)]

    def _check_types(self) -> None:
        def bad(name: str, want: str, got: Any) -> ValueError:
            return ValueError(f"structured_outputs.{name} must be {want}; got {got!r:.200}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise bad("json", "a JSON schema (object or JSON text)", self.json)
        for name in ("regex", "grammar", "structural_tag", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise bad(name, "a string", value)
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise bad(name, "a non-empty string", value)
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise bad("choice", "a non-empty list of strings", self.choice)
            if not all(isinstance(c, str) for c in self.choice):
                raise bad("choice", "a list of strings", self.choice)
            self.choice = list(self.choice)
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise bad(name, "true or false", getattr(self, name))

    @property
    def kind(self) -> str:
        """The constraint kind: one of CONSTRAINT_FIELDS."""
        return self.constraint_fields()[0]

    def key(self) -> str:
        """A stable cache key: equal for requests whose compiled grammars are interchangeable.

        Key order inside a schema is kept (it decides property order in the output); a schema given as JSON text
        and the same schema given as a dict share a key. disable_fallback does not change the grammar.
        """
        kind = self.kind
        if kind == "json":
            spec: Any = self.json
            if isinstance(spec, str):
                try:
                    spec = _json.loads(spec)
                except ValueError:
                    pass  # invalid JSON: keyed by its text, rejected when compiled
        elif kind == "json_object":
            spec = True
        else:
            spec = getattr(self, kind)
        options = [self.disable_any_whitespace, self.disable_additional_properties, self.whitespace_pattern]
        return _json.dumps([kind, spec, options], separators=(",", ":"), ensure_ascii=False)

    @staticmethod
    def from_response_format(response_format: Any) -> StructuredOutputsParams | None:
        return from_response_format(response_format)



# Backends a request may name: tokenmill compiles every constraint with xgrammar ("auto" picks it).
_ACCEPTED_BACKENDS = (None, "auto", "xgrammar")


class GuidedDecodingParams(StructuredOutputsParams, kw_only=True, omit_defaults=True):
    """vLLM's older name for `StructuredOutputsParams` (`from vllm.sampling_params import GuidedDecodingParams`),
    with its extra `backend` field. `SamplingParams(guided_decoding=...)` turns it into `structured_outputs`
    (`to_structured_outputs`), so the engine only ever sees the new type. A backend other than xgrammar/"auto" is a
    ValueError: tokenmill has no other, and silently swapping engines would change what the output may look like.
    """
    backend: str | None = None
    backend_was_auto: bool = False

    def __post_init__(self) -> None:
        if self.backend not in _ACCEPTED_BACKENDS:
            raise ValueError(f"GuidedDecodingParams.backend {self.backend!r} is not available: tokenmill compiles "
                             "structured outputs with xgrammar (give 'xgrammar', 'auto' or leave it unset).")
        super().__post_init__()

    @staticmethod
    def from_optional(json: Any = None, regex: str | None = None, choice: list[str] | None = None,
                      grammar: str | None = None, json_object: bool | None = None, backend: str | None = None,
                      whitespace_pattern: str | None = None,
                      structural_tag: str | None = None) -> "GuidedDecodingParams | None":
        """None when no constraint is given (vLLM's helper for optional request fields)."""
        if all(v is None for v in (json, regex, choice, grammar, json_object, structural_tag)):
            return None
        return GuidedDecodingParams(json=json, regex=regex, choice=choice, grammar=grammar, json_object=json_object,
                                    backend=backend, whitespace_pattern=whitespace_pattern,
                                    structural_tag=structural_tag)

    def to_structured_outputs(self) -> StructuredOutputsParams:
        fields = {f: getattr(self, f) for f in StructuredOutputsParams.__struct_fields__}
        return StructuredOutputsParams(**fields)


def as_structured_outputs(value: Any, field: str) -> StructuredOutputsParams:
    """A StructuredOutputsParams from what a caller passed as `field`: the struct itself, its older
    GuidedDecodingParams form, or a dict of either's fields (`backend` included). Anything else is a ValueError."""
    if isinstance(value, GuidedDecodingParams):
        return value.to_structured_outputs()
    if isinstance(value, StructuredOutputsParams):
        return value
    if isinstance(value, dict):
        try:
            return GuidedDecodingParams(**value).to_structured_outputs()
        except TypeError as e:  # an unknown key
            raise ValueError(f"SamplingParams.{field}: {e}") from None
    raise ValueError(f"SamplingParams.{field} must be a StructuredOutputsParams (or a dict of its fields), "
                     f"got {value!r:.200}")


_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")


def from_response_format(response_format: Any) -> StructuredOutputsParams | None:
    """OpenAI `response_format` -> StructuredOutputsParams (None for plain text).

    Accepts the dict or a pydantic model of it: {"type": "text"}, {"type": "json_object"},
    {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": bool}}, and vLLM's
    {"type": "structural_tag", ...}. A malformed one raises ValueError naming the field.
    """
    if response_format is None:
        return None
    if hasattr(response_format, "model_dump"):
        response_format = response_format.model_dump(by_alias=True, exclude_none=True)
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object; got {response_format!r:.200}")
    kind = response_format.get("type")
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise ValueError("response_format.type must be one of " + ", ".join(_RESPONSE_FORMAT_TYPES)
                         + f"; got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "structural_tag":
        return StructuredOutputsParams(structural_tag=_json.dumps(response_format))
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema must be an object with 'name' and 'schema' when "
                         f"response_format.type is 'json_schema'; got {spec!r:.200}")
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"response_format.json_schema.name must be a non-empty string; got {name!r:.100}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"response_format.json_schema.strict must be true or false; got {strict!r:.100}")
    # pydantic models in protocols often alias "schema" to "json_schema" to dodge BaseModel.schema.
    schema = spec.get("schema", spec.get("json_schema"))
    if schema is None:
        raise ValueError("response_format.json_schema.schema is required (the JSON schema of the output)")
    if isinstance(schema, str):
        try:
            schema = _json.loads(schema)
        except ValueError as e:
            raise ValueError(f"response_format.json_schema.schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):  # `true` is allowed: any JSON value
        raise ValueError(f"response_format.json_schema.schema must be a JSON schema object; got {schema!r:.200}")
    # strict=true is what xgrammar does anyway: the output always follows the schema exactly.
    return StructuredOutputsParams(json=schema)

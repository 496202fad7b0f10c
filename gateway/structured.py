"""A request's structured output (specserve/grammar.py) from the fields clients send:
OpenAI's response_format (json_schema, json_object, text), vLLM's structured_outputs (json,
regex, choice, grammar, json_object) and its older guided_json, guided_regex, guided_choice
and guided_grammar. At most one may ask for something; a 400 names the field otherwise."""

from __future__ import annotations

from gateway.errors import bad_request
from specserve.errors import InvalidArgument
from specserve.grammar import Grammar

ANY_JSON_OBJECT = {"type": "object"}
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")
IGNORED_KEYS = ("disable_fallback", "backend")  # vLLM's choice among libraries: this server has one
REFUSED_KEYS = ("whitespace_pattern", "disable_additional_properties")  # not implemented: a 400 where set


def grammar_of(request) -> tuple[str, Grammar] | None:
    """The one grammar the request asks for, with the field that asks, or None."""
    asked = [(name, grammar) for name, grammar in _asked(request) if grammar is not None]
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise bad_request(f"ask for one structured output, not several ({names})", asked[1][0])
    return asked[0] if asked else None


def _asked(request):
    yield "response_format", _response_format(request.response_format)
    yield "structured_outputs", _structured(request.structured_outputs, "structured_outputs")
    for name, key in GUIDED.items():
        value = getattr(request, name)
        if value is not None:
            yield name, _kind(key, value, name)


def _response_format(value) -> Grammar | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request('response_format.type is "text", "json_object" or "json_schema"', "response_format")
    if value["type"] == "text":
        return None
    if value["type"] == "json_object":
        return _kind("json", ANY_JSON_OBJECT, "response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise bad_request("response_format.json_schema needs its schema: {name, schema, strict}", "response_format")
    return _kind("json", spec["schema"], "response_format.json_schema.schema")


def _structured(value, field: str) -> Grammar | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad_request(f"{field} is an object: one of {', '.join(STRUCTURED_KEYS)}", field)
    known = (*STRUCTURED_KEYS, *IGNORED_KEYS, *REFUSED_KEYS, "disable_any_whitespace")
    unknown = [key for key in value if key not in known]
    if unknown:
        raise bad_request(f"{field} takes {', '.join(STRUCTURED_KEYS)}; not {', '.join(unknown)}", field)
    refused = [key for key in REFUSED_KEYS if value.get(key) not in (None, False)]
    if refused:
        raise bad_request(f"{field}.{refused[0]} is not supported; leave it out", field)
    asked = [key for key in STRUCTURED_KEYS if value.get(key) not in (None, False)]
    if len(asked) != 1:
        raise bad_request(f"{field} asks for exactly one of {', '.join(STRUCTURED_KEYS)}", field)
    key, compact = asked[0], bool(value.get("disable_any_whitespace"))
    if key == "json_object":
        return _kind("json", ANY_JSON_OBJECT, field, compact)
    return _kind(key, value[key], f"{field}.{key}", compact)


def _kind(key: str, value, field: str, compact: bool = False) -> Grammar:
    try:
        if key == "json":
            return Grammar.json_schema(value, compact)
        if key == "choice":
            if not isinstance(value, list):
                raise InvalidArgument("choice is a list of strings")
            return Grammar.choice(value)
        if not isinstance(value, str) or not value:
            raise InvalidArgument(f"{key} is a non-empty string")
        return Grammar("regex" if key == "regex" else "lark", value)
    except InvalidArgument as error:
        raise bad_request(f"{field}: {error}", field) from None

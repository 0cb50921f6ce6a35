"""What a tool is: an OpenAI function schema and the function the model's arguments go to.

The schema is the contract: a call's arguments are checked against it before the function runs (so a bad call is
an answer the model can learn from, not an exception), and the function is checked at load time to accept every
call the schema allows.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

from mindrl.config.errors import ConfigError

#: JSON schema types and the Python values that fit them (bool is no number here, as in JSON)
_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}
#: annotations (or their names, under `from __future__ import annotations`) → the JSON type a schema gives them
_ANNOTATED = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
              "dict": "object"}


class ToolFailure(Exception):
    """A call that ran and did not succeed (timed out, was killed, refused its input): the status and the text the
    model gets, raised by a tool rather than returned so its ordinary answer stays a plain string."""

    def __init__(self, status: str, text: str) -> None:
        super().__init__(text)
        self.status, self.text = status, text


@dataclass(frozen=True)
class Tool:
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}
    fn: Callable[..., str]
    #: the most memory one call may hold outside the rollout process (a sandbox's processes and files)
    footprint_bytes: int = 0

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]


def function_schema(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


def schema_from_signature(name: str, fn: Callable, leave_out: set[str]) -> dict:
    """A custom tool's schema when its entry gives none: its keyword parameters (those in `leave_out`, its
    settings, are not the model's), typed from their annotations, required where they have no default."""
    properties, required = {}, []
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.name in leave_out or parameter.kind not in (parameter.POSITIONAL_OR_KEYWORD,
                                                                  parameter.KEYWORD_ONLY):
            continue
        annotation = getattr(parameter.annotation, "__name__", parameter.annotation)
        properties[parameter.name] = {"type": _ANNOTATED[annotation]} if annotation in _ANNOTATED else {}
        if parameter.default is parameter.empty:
            required.append(parameter.name)
    description = (inspect.getdoc(fn) or "").split("\n\n")[0]
    return function_schema(name, description, properties, required)


def check_accepts(fn: Callable, schema: dict, where: str) -> None:
    """Refuse at load time a function that some call its schema allows would fail on: it must take the schema's
    arguments as keywords, all of them and only the required ones."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a C function may not describe itself: nothing to compare with
        return
    parameters = schema["function"]["parameters"]
    for names in (list(parameters.get("properties", {})), parameters.get("required", [])):
        try:
            signature.bind(**dict.fromkeys(names))
        except TypeError as err:
            raise ConfigError(f"{where}: tool {schema['function']['name']!r} cannot be called as {usage(schema)} "
                              f"({err}); a tool's function must take the arguments of its schema as keyword "
                              f"arguments.") from None


def bad_arguments(schema: dict, arguments: object) -> str | None:
    """Why `arguments` do not fit `schema`, in one sentence for the model; None when they do."""
    name, parameters = schema["function"]["name"], schema["function"]["parameters"]
    properties = parameters.get("properties", {})
    if not isinstance(arguments, dict):
        problem = "the arguments must be a JSON object"
    elif unknown := [key for key in arguments if key not in properties]:
        problem = f"it takes no argument {unknown[0]!r}"
    elif missing := [key for key in parameters.get("required", []) if key not in arguments]:
        problem = f"missing {missing[0]!r}"
    elif wrong := [key for key, value in arguments.items() if not _fits(value, properties[key].get("type"))]:
        problem = f"{wrong[0]!r} must be a JSON {properties[wrong[0]]['type']}"
    else:
        return None
    return f"bad arguments for {name}: {problem}; call it as {usage(schema)}."


def usage(schema: dict) -> str:
    """`python(code: string)`: how the model calls the tool, for refusals."""
    properties = schema["function"]["parameters"].get("properties", {})
    listed = ", ".join(f"{key}: {spec['type']}" if "type" in spec else key for key, spec in properties.items())
    return f"{schema['function']['name']}({listed})"


def _fits(value: object, json_type: str | list | None) -> bool:
    if json_type is None:
        return True
    for kind in [json_type] if isinstance(json_type, str) else json_type:
        if isinstance(value, bool) and kind in ("integer", "number"):
            continue
        if isinstance(value, _JSON_TYPES.get(kind, object)):
            return True
    return False

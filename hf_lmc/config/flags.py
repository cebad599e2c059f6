"""The command line's flags, generated from the option models (:mod:`hf_lmc.config.options`).

:class:`OptionFlags` turns the fields of one options model into argparse flags (name, type,
choices, help, the default shown) and builds the model back from the parsed flags, naming the
flag of any value the model refuses. :mod:`hf_lmc.cli` declares which models and fields each
command offers; this module holds no command.

The module imports neither torch nor transformers: ``hf-lmc --help`` builds its parser from it.
"""

from __future__ import annotations

import argparse
import types
import typing
from collections.abc import Mapping, Sequence

from pydantic import ValidationError

from hf_lmc.config.options import UsageError, flag_of


class OptionFlags:
    """The command-line flags of one options model (:mod:`hf_lmc.config.options`), generated from its
    fields: the flag is the field's name (``worst_fraction`` -> ``--worst-fraction``) unless
    renamed, the help its description, the choices its ``Literal``, the default the model's own
    (shown, never copied: an absent flag leaves the field to the model). Bounds are the model's
    too: :meth:`build` validates, and names the flag of any field it refuses.

    ``defaults`` may also map what the flags apply to onto its defaults (the batching flags of
    ``--data`` and ``--eval-data``): the help then shows each, and :meth:`given` is the way to
    read the flags. ``metavars`` names a field's value where the last word of its name does not
    (``--push-to-hub REPO_ID``); a field may also declare its flag's wording, value name, type,
    arity and aliases (:class:`hf_lmc.config.options.Flag`), as :class:`~hf_lmc.config.options.MergeRequest`'s
    do. ``choices`` and ``helps`` give what reads the method registry, which the options cannot
    import.

    A model that cannot be built without arguments (a merge request names its models) has no
    defaults to leave its fields to: with ``defaults="fields"`` every flag is parsed to its
    field's default when absent, as the commands read them."""

    def __init__(
        self,
        model,
        *,
        only: tuple[str, ...] | None = None,
        flags: dict[str, str] | None = None,
        defaults=None,
        prefix: str = "",
        metavars: dict[str, str] | None = None,
        choices: dict[str, Sequence[str]] | None = None,
        helps: dict[str, str] | None = None,
    ):
        self.model, self.prefix, self.metavars = model, prefix, metavars or {}
        self.choices, self.helps = choices or {}, helps or {}
        self.fields = {name: field for name, field in model.model_fields.items() if only is None or name in only}
        self.flags = {name: (flags or {}).get(name, flag_for(name, field)) for name, field in self.fields.items()}
        self.parsed_defaults = defaults == "fields"
        if self.parsed_defaults:
            defaults = types.SimpleNamespace(
                **{name: None if field.is_required() else field.default for name, field in self.fields.items()}
            )
        self.defaults = defaults if defaults is not None else model()

    def add_to(self, group, names: Sequence[str] | None = None, **required: bool) -> None:
        """Add one flag per field (or per field in ``names``, in that order) to ``group`` (a parser
        or an argument group); ``required`` says, per field, whether this command needs the flag."""
        for name in self.fields if names is None else names:
            field, declared = self.fields[name], flag_of(self.fields[name])
            kind, choices = argument_type(field.annotation)
            kind, choices = declared.type or kind, self.choices.get(name) or declared.choices or choices
            help_text = self.helps.get(name) or declared.help or field.description or ""
            if "default" not in help_text:
                help_text += self._shown_default(name)
            default = getattr(self.defaults, name) if self.parsed_defaults else argparse.SUPPRESS
            options = {"dest": self.prefix + name, "default": default, "help": help_text}
            if required.get(name, declared.required):
                options["required"] = True
            names_of_flag = (self.flags[name], *declared.aliases)
            if kind is bool:
                action = "store_false" if _on_by_default(self.fields[name]) else "store_true"
                group.add_argument(*names_of_flag, action=action, **options)
            elif kind is tuple:
                group.add_argument(*names_of_flag, type=float, nargs=2, metavar=("LOW", "HIGH"), **options)
            else:
                named = (
                    self.metavars.get(name) or declared.metavar or ("N" if kind is int else name.split("_")[-1].upper())
                )
                metavar = None if choices else named
                if declared.nargs is not None:
                    options["nargs"] = declared.nargs
                if declared.const is not None:
                    options["const"] = declared.const
                group.add_argument(*names_of_flag, type=kind, choices=choices, metavar=metavar, **options)

    def _shown_default(self, name: str) -> str:
        """`` (default: 8)``, or per use `` (default: 32 for --data, 8 for --eval-data)``; empty for none."""
        uses = self.defaults if isinstance(self.defaults, Mapping) else {"": self.defaults}
        shown = {use: shown_value(getattr(defaults, name)) for use, defaults in uses.items()}
        if all(value is None for value in shown.values()):
            return ""
        if len(set(shown.values())) == 1:
            return f" (default: {next(iter(shown.values()))})"
        return (
            " (default: " + ", ".join(f"{value} for {use}" for use, value in shown.items() if value is not None) + ")"
        )

    def given(self, args: argparse.Namespace) -> dict:
        """The fields set on the command line."""
        return {name: getattr(args, self.prefix + name) for name in self.fields if hasattr(args, self.prefix + name)}

    def build(self, args: argparse.Namespace, **fixed):
        """The options model from the flags given (the model's defaults for the rest)."""
        if isinstance(self.defaults, Mapping):
            raise TypeError("flags with defaults per use have no one model to build; read them with given()")
        # Parsed defaults (``defaults="fields"``) arrive with the flags themselves; a model's own
        # defaults contribute only the fields that were set on it.
        chosen = () if self.parsed_defaults else self.defaults.model_fields_set
        values = {name: getattr(self.defaults, name) for name in self.model.model_fields if name in chosen}
        try:
            return self.model(**{**values, **self.given(args), **fixed})
        except ValidationError as err:
            raise UsageError("; ".join(self._flag_message(e) for e in err.errors())) from None

    def _flag_message(self, error: dict) -> str:
        message = error["msg"].removeprefix("Value error, ")
        if error["loc"]:
            name = str(error["loc"][0])
            if error["type"] != "value_error":  # pydantic's own checks do not say what they refused; ours do
                message += f", got {error['input']!r}"
        else:  # a check across fields names its field first ("frame: ...")
            name, sep, rest = message.partition(": ")
            if not sep or name not in self.flags:
                return message
            message = rest
        return f"{self.flags.get(name) or flag_for(name)}: {message}"


#: Library keywords whose flag is not their name: the Python API's ``barrier(..., fit_data=)``
#: is the command line's ``--data``, which means fitting data in every command.
RENAMED = {"fit_data": "--data"}


def shown_value(default) -> str | None:
    """A default as its help text shows it (a pair as ``LOW HIGH``)."""
    if default is None:
        return None
    return " ".join(map(str, default)) if isinstance(default, tuple) else str(default)


def flag_for(parameter: str, field=None) -> str:
    """The flag of a parameter (``seq_len`` -> ``--seq-len``): one name across commands. A bool
    field that is on by default is offered as its negation (``save_transforms`` ->
    ``--no-save-transforms``), the flag turning it off."""
    flag = RENAMED.get(parameter) or "--" + parameter.replace("_", "-")
    return "--no-" + flag.removeprefix("--") if field is not None and _on_by_default(field) else flag


def _on_by_default(field) -> bool:
    """Whether a pydantic field is a bool whose default is ``True``."""
    return field.annotation is bool and field.default is True


def argument_type(annotation) -> tuple[type, list[str] | None]:
    """``(type, choices)`` of a field: ``Literal`` gives choices, ``X | None`` gives X's type."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Literal:
        return str, list(typing.get_args(annotation))
    if typing.get_origin(annotation) is tuple or annotation is tuple:
        return tuple, None
    if args and annotation not in (int, float, str, bool):
        literal = next((a for a in args if typing.get_origin(a) is typing.Literal), None)
        if literal is not None:
            return str, list(typing.get_args(literal))
        if int in args and str in args:  # sizes: "5GB" or bytes
            return str, None
        return argument_type(args[0])
    return annotation, None

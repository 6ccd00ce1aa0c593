"""The `tokenmill serve` command line, generated from the config dataclasses (vLLM's flag names and conventions).

Every dataclass field becomes `--kebab-name` (the `--snake_name` spelling is accepted too); bools get `--no-name`;
dict fields take JSON or dotted keys (`--hf-overrides.rope_scaling.factor 2`); list fields take several values and
`--name+ value` appends to the default. `--config file.yaml` supplies defaults that command-line flags override.
vLLM flags tokenmill cannot honour yet are accepted only with their default value (config/unsupported.py: the same
table and message serve LLM(...) and EngineArgs).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
import types
import typing
from typing import Any

from tokenmill.config import CONFIG_CLASSES
from tokenmill.config.frontend import FrontendConfig
from tokenmill.config.help_zh import (GROUP_TITLES_ZH, HELP_ZH, HelpFormatter, group_doc, help_language,
                                      render_help, ui_text)
from tokenmill.config.model import parse_human_int
from tokenmill.config.unsupported import NOT_YET_SUPPORTED, check_not_yet_supported

HUMAN_INT_FIELDS = ("max_model_len", "max_num_batched_tokens", "kv_cache_memory_bytes")
SHORT_ALIASES = {"tensor_parallel_size": ("-tp",), "pipeline_parallel_size": ("-pp",), "data_parallel_size": ("-dp",),
                 "quantization": ("-q",), "enable_expert_parallel": ("-ep",), "api_server_count": ("-asc",),
                 "nnodes": ("-n",), "node_rank": ("-r",),
                 "data_parallel_size_local": ("-dpl",), "data_parallel_start_rank": ("-dpr",),
                 "data_parallel_address": ("-dpa",), "data_parallel_rpc_port": ("-dpp",),
                 "compilation_config": ("-cc",), "optimization_level": ("-O",),
                 "speculative_config": ("-sc",)}
PARSER_CLASSES = (*CONFIG_CLASSES, FrontendConfig)
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}
_DOTTED = "\x00dotted:"


GENERAL_HELP = {"model_tag": "Model to serve (same as --model).",
                "config": "Read options from a YAML or JSON file (keys in either spelling); flags on the command "
                          "line win.",
                "help": "Show help: --help=all, --help=<group>, --help=<option> or --help=<text to search>.",
                "help_lang": "Language of the help text (default: Chinese when LANG/LC_ALL/LANGUAGE start with zh)."}
# Old vLLM spellings kept working: flag -> (field, value it sets). --enable-reasoning only makes sense with a parser.
LEGACY_FLAGS = {"disable_log_requests": ("enable_log_requests", False), "enable_reasoning": ("_enable_reasoning", True)}


@dataclasses.dataclass
class _Opt:
    dest: str
    kind: str  # bool | int | human_int | float | str | list | json
    default: Any
    help: str
    group: str
    choices: list | None = None
    aliases: tuple[str, ...] = ()
    elem: type = str


def _kind(tp: Any, name: str) -> tuple[str, type]:
    members = [a for a in typing.get_args(tp) if a is not type(None)] \
        if typing.get_origin(tp) in (typing.Union, types.UnionType) else [tp]
    if name in HUMAN_INT_FIELDS:
        return "human_int", int
    for m in members:
        if m is list or typing.get_origin(m) is list:
            args = typing.get_args(m)
            return "list", args[0] if args and args[0] in (int, float) else str
    if any(m is dict or typing.get_origin(m) is dict for m in members):
        return "json", str
    return {bool: "bool", int: "int", float: "float"}.get(members[0], "str"), str


def option_specs() -> list[_Opt]:
    """Every option of `tokenmill serve`, in help order."""
    opts = [_Opt(name, "str", None, text, "General") for name, text in GENERAL_HELP.items()]
    taken = set()
    for cls in PARSER_CLASSES:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind, elem = _kind(hints[f.name], f.name)
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            opts.append(_Opt(f.name, kind, default, f.metadata["help"], cls.__name__, f.metadata.get("choices"),
                             SHORT_ALIASES.get(f.name, ()), elem))
            taken.add(f.name)
    for name, nys in NOT_YET_SUPPORTED.items():
        if name not in taken:  # a dataclass that grows the field takes over the flag
            opts.append(_Opt(name, nys.kind, nys.default, nys.help, "NotYetSupported", aliases=nys.aliases,
                             elem=int if name == "numa_bind_nodes" else str))
    return opts


def _loose_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _deep_merge(base: dict, new: dict) -> dict:
    out = dict(base)
    for k, v in new.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _human_int(name: str):
    def convert(text: str) -> int | None:
        try:
            return parse_human_int(text, name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    convert.__name__ = "integer"
    return convert


def _state(ns: argparse.Namespace) -> dict:
    return ns.__dict__.setdefault("_tm_state", {"seen": set(), "cli": set(), "phase": "cli"})


class _Action(argparse.Action):
    """Base action: records which options were set (and in which phase: config file or command line)."""

    def _set(self, ns: argparse.Namespace, value: Any, dest: str | None = None) -> None:
        dest = dest or self.dest
        st = _state(ns)
        st["seen"].add(dest)
        if st["phase"] == "cli":
            st["cli"].add(dest)
        setattr(ns, dest, value)


class _Store(_Action):
    def __call__(self, parser, ns, values, option_string=None):
        self._set(ns, values)


class _Flag(_Action):
    """--flag / --no-flag (and the hidden legacy flags, which set another field)."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser, ns, values, option_string=None):
        if self.dest in LEGACY_FLAGS:
            self._set(ns, LEGACY_FLAGS[self.dest][1], LEGACY_FLAGS[self.dest][0])
        else:
            self._set(ns, not option_string.startswith("--no-"))


class _List(_Action):
    """Several values, or a JSON list; repeating the flag adds to it; `--flag+ a,b` appends to the default."""
    elem: type = str
    tm_default: Any = None

    def __call__(self, parser, ns, values, option_string=None):
        append = option_string.endswith("+")
        items: list = []
        for v in values:
            if append:
                items += [p.strip() for p in v.split(",") if p.strip()]
            elif v.lstrip().startswith("["):
                parsed = _loose_json(v)
                if not isinstance(parsed, list):
                    raise argparse.ArgumentError(self, f"invalid JSON list: {v!r}")
                items += [json.dumps(x) if isinstance(x, (dict, list)) else x for x in parsed]
            else:
                items.append(v)
        try:
            items = [self.elem(x) for x in items]
        except (TypeError, ValueError):
            raise argparse.ArgumentError(self, f"invalid {self.elem.__name__} value in {values!r}") from None
        if append:
            base = getattr(ns, self.dest) if hasattr(ns, self.dest) else list(self.tm_default or [])
        else:
            base = getattr(ns, self.dest) if self.dest in _state(ns)["seen"] else []
        self._set(ns, list(base) + items)


class _Json(_Action):
    """A JSON object; several occurrences (and dotted keys, marked by _preprocess) merge into one dict."""

    def __call__(self, parser, ns, values, option_string=None):
        cur = json.loads(json.dumps(getattr(ns, self.dest, None) or {}))  # deep copy
        if values.startswith(_DOTTED):
            spec = json.loads(values[len(_DOTTED):])
            node = cur
            for key in spec["keys"][:-1]:
                if not isinstance(node.get(key), dict):
                    node[key] = {}
                node = node[key]
            last, value = spec["keys"][-1], spec["value"]
            if spec["append"]:
                old = node.get(last, [])
                value = (old if isinstance(old, list) else [old]) + value
            node[last] = value
            return self._set(ns, cur)
        try:
            obj = json.loads(values)
        except ValueError as e:
            raise argparse.ArgumentError(self, f"invalid JSON ({e}): {values!r}") from None
        if obj is not None and not isinstance(obj, dict):
            raise argparse.ArgumentError(self, f"expected a JSON object, got {values!r}")
        self._set(ns, None if obj is None else _deep_merge(cur, obj))


class ServeArgumentParser(argparse.ArgumentParser):
    """argparse with vLLM's conventions (see the module docstring); a parsed Namespace holds only what was set."""

    def __init__(self, prog: str = "tokenmill serve", lang: str | None = None) -> None:
        super().__init__(prog=prog, usage="%(prog)s [model_tag] [options]", add_help=False, allow_abbrev=False,
                         formatter_class=HelpFormatter)
        self.lang = help_language(lang)
        self.specs = option_specs()
        self.groups: dict[str, argparse._ArgumentGroup] = {}
        self.bool_flags: dict[str, tuple[str, str, bool]] = {}  # option -> (positive, negative, is_negative)
        self.json_flags: dict[str, str] = {}  # option or alias -> its long option
        self.long_names: set[str] = set()  # long options without the leading --
        zh = self.lang == "zh"
        for spec in self.specs:
            if spec.group not in self.groups:
                title = GROUP_TITLES_ZH.get(spec.group, spec.group) if zh else spec.group
                cls = next((c for c in PARSER_CLASSES if c.__name__ == spec.group), None)
                first_line = ((cls.__doc__ or "").strip().splitlines() or [""])[0] if cls else ""
                self.groups[spec.group] = self.add_argument_group(title, group_doc(spec.group, zh, first_line))
            self._add(spec, self.groups[spec.group], (HELP_ZH.get(spec.dest) if zh else None) or spec.help)
        for flag in LEGACY_FLAGS:
            self.groups["FrontendConfig"].add_argument("--" + flag.replace("_", "-"), dest=flag, action=_Flag,
                                                       default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            self.long_names.add(flag.replace("_", "-"))

    def _add(self, spec: _Opt, group: argparse._ArgumentGroup, text: str) -> None:
        sep = "" if self.lang == "zh" else " "
        if spec.group == "NotYetSupported":
            text = ui_text(self.lang, "nys") + sep + text
        if spec.default not in (None, "") and spec.group != "General":
            shown = json.dumps(spec.default) if isinstance(spec.default, (list, dict)) else spec.default
            text = text + sep + ui_text(self.lang, "default").format(shown)
        kw: dict[str, Any] = dict(dest=spec.dest, default=argparse.SUPPRESS, help=text.replace("%", "%%"))
        long = "--" + spec.dest.replace("_", "-")
        if spec.dest == "model_tag":
            kw.pop("dest")
            group.add_argument("model_tag", nargs="?", **kw)
            return
        if spec.dest == "help":
            group.add_argument("-h", long, nargs="?", metavar="TOPIC", **kw)
            return
        names = [long, *spec.aliases]
        self.long_names.add(long[2:])
        if spec.kind == "bool":
            neg = "--no-" + long[2:]
            group.add_argument(long, neg, *spec.aliases, action=_Flag, **kw)
            self.long_names.add(neg[2:])
            self.bool_flags.update({name: (long, neg, False) for name in names})
            self.bool_flags[neg] = (long, neg, True)
        elif spec.kind == "list":
            shown = group.add_argument(*names, action=_List, nargs="+", **kw)
            hidden = group.add_argument(long + "+", action=_List, nargs="+", dest=spec.dest,
                                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            for action in (shown, hidden):
                action.elem, action.tm_default = spec.elem, spec.default
            self.long_names.add(long[2:] + "+")
        elif spec.kind == "json":
            group.add_argument(*names, action=_Json, metavar="JSON", **kw)
            self.json_flags.update({name: long for name in names})
        else:
            conv = {"int": int, "float": float, "human_int": _human_int(spec.dest)}.get(spec.kind)
            if conv:
                kw["type"] = conv
            if spec.choices or spec.dest == "help_lang":
                kw["choices"] = spec.choices or ["zh", "en"]
            group.add_argument(*names, action=_Store, **kw)

    # ---- parsing -------------------------------------------------------------------------------------------
    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        self._maybe_help(args)
        args, config_path = self._pop_config(args)
        ns = namespace if namespace is not None else argparse.Namespace()
        st = _state(ns)
        if config_path:
            st["phase"] = "file"
            ns, extra = super().parse_known_args(self._preprocess(self._file_tokens(config_path)), ns)
            if extra:
                self.error(f"config file {config_path}: unexpected entries: {' '.join(extra)}")
            st["phase"], st["seen"] = "cli", set()
        ns, extra = super().parse_known_args(self._preprocess(args), ns)
        self._finish(ns)
        return ns, extra

    def parse_args(self, args=None, namespace=None):
        ns, extra = self.parse_known_args(args, namespace)
        if extra:
            unknown = [e.split("=")[0][2:] for e in extra if e.startswith("--")]
            close = difflib.get_close_matches(unknown[0], sorted(self.long_names), n=3) if unknown else []
            hint = f" (did you mean: {', '.join('--' + c for c in close)}?)" if close else ""
            self.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return ns

    def _pop_config(self, args: list[str]) -> tuple[list[str], str | None]:
        out, paths, i = [], [], 0
        while i < len(args):
            tok = args[i]
            if tok == "--":
                out += args[i:]
                break
            if tok in ("--config", "--config=") or tok.startswith("--config="):
                if "=" not in tok and i + 1 >= len(args):
                    self.error("argument --config: expected a file path")
                paths.append(tok.split("=", 1)[1] if "=" in tok else args[i + 1])
                i += 1 if "=" in tok else 2
                continue
            out.append(tok)
            i += 1
        if len(paths) > 1:
            self.error("--config may be given only once")
        return out, (paths[0] if paths else None)

    def _file_tokens(self, path: str) -> list[str]:
        import yaml
        try:
            with open(path, encoding="utf-8") as fh:
                data = yaml.safe_load(fh)
        except (OSError, yaml.YAMLError) as e:
            self.error(f"cannot read config file {path}: {e}")
        if not isinstance(data, (dict, type(None))):
            self.error(f"config file {path} must hold a mapping of option names to values")
        tokens = []
        for key, value in (data or {}).items():
            name = str(key).lstrip("-").replace("_", "-")
            if name == "config":
                self.error(f"config file {path}: a config file cannot name another config file")
            if name not in self.long_names or name.startswith("no-") or name.endswith("+"):
                close = difflib.get_close_matches(name, sorted(self.long_names), n=3)
                hint = f" (did you mean: {', '.join(close)}?)" if close else ""
                self.error(f"config file {path}: unknown option {key!r}{hint}")
            if value is not None:
                value = json.dumps(value) if isinstance(value, (list, dict, bool)) else value
                tokens.append(f"--{name}={value}")
        return tokens

    def _preprocess(self, tokens: list[str]) -> list[str]:
        """Normalize `--snake_case`, fold `--flag true/false`, turn dotted JSON keys into marked values."""
        out, i = [], 0
        while i < len(tokens):
            tok = tokens[i]
            i += 1
            if tok == "--":
                out += tokens[i - 1:]
                break
            if not tok.startswith("-") or tok == "-" or _is_number(tok):
                out.append(tok)
                continue
            name, eq, val = tok.partition("=")
            dashes = "--" if name.startswith("--") else "-"
            base, dot, path = name[len(dashes):].partition(".")
            if dashes == "--" and base.replace("_", "-") in self.long_names:
                base = base.replace("_", "-")
            flag = dashes + base
            if dot:
                if flag not in self.json_flags:
                    self.error(f"{tok}: dotted keys work only with JSON options, and {flag} is not one")
                if not eq:
                    if i >= len(tokens):
                        self.error(f"argument {name}: expected a value")
                    val, i = tokens[i], i + 1
                append = path.endswith("+")
                keys = (path[:-1] if append else path).split(".")
                if not all(keys):
                    self.error(f"argument {name}: empty key in the dotted path")
                value = [_loose_json(v) for v in val.split(",")] if append else _loose_json(val)
                out += [self.json_flags[flag], _DOTTED + json.dumps({"keys": keys, "append": append,
                                                                     "value": value})]
            elif flag in self.bool_flags:
                pos, neg, negated = self.bool_flags[flag]
                if not eq and i < len(tokens) and tokens[i].lower() in _BOOL_WORDS:
                    val, eq, i = tokens[i], "=", i + 1
                if eq and val.lower() not in _BOOL_WORDS:
                    self.error(f"argument {flag}: expected true or false, got {val!r}")
                out.append((pos if _BOOL_WORDS[val.lower()] != negated else neg) if eq else flag)
            else:
                out.append(flag + eq + val)
        return out

    def _finish(self, ns: argparse.Namespace) -> None:
        """Positional model vs --model, legacy flags, and the not-yet-supported check."""
        st = ns.__dict__.pop("_tm_state", {"cli": set()})
        for key in ("help", "help_lang", "config"):
            ns.__dict__.pop(key, None)
        if hasattr(ns, "model_tag"):
            tag = ns.__dict__.pop("model_tag")
            if "model" in st["cli"] and ns.model != tag:
                self.error(f"the positional model {tag!r} and --model {ns.model!r} differ; give only one")
            ns.model = tag
        if ns.__dict__.pop("_enable_reasoning", False) and not getattr(ns, "reasoning_parser", ""):
            self.error("--enable-reasoning needs --reasoning-parser (tokenmill separates reasoning whenever a "
                       "reasoning parser is set)")
        for spec in self.specs:
            if spec.group != "NotYetSupported" or not hasattr(ns, spec.dest):
                continue
            try:
                check_not_yet_supported(spec.dest, ns.__dict__.pop(spec.dest))
            except ValueError as e:
                self.error(str(e))

    # ---- help ----------------------------------------------------------------------------------------------
    def _maybe_help(self, args: list[str]) -> None:
        """`-h`/`--help[=TOPIC]` anywhere before `--` prints help (in --help-lang's language) and exits."""
        topic, lang, wants = None, None, False
        for i, tok in enumerate(args):
            if tok == "--":
                break
            nxt = args[i + 1] if i + 1 < len(args) else None
            if tok in ("-h", "--help"):
                wants, topic = True, (nxt if nxt and not nxt.startswith("-") else topic)
            elif tok.startswith("--help="):
                wants, topic = True, tok.split("=", 1)[1]
            elif tok in ("--help-lang", "--help_lang"):
                lang = nxt
            elif tok.startswith(("--help-lang=", "--help_lang=")):
                lang = tok.split("=", 1)[1]
        if lang is not None and lang not in ("zh", "en"):
            self.error(f"argument --help-lang: invalid choice: {lang!r} (choose from 'zh', 'en')")
        if wants:
            parser = self if lang in (None, self.lang) else ServeArgumentParser(self.prog, lang)
            text, ok = render_help(parser, topic)
            if not ok:
                self.error(text)
            self._print_message(text, sys.stdout)
            self.exit(0)

    def format_help(self) -> str:
        return render_help(self, None)[0]


def _is_number(tok: str) -> bool:
    try:
        float(tok)
        return True
    except ValueError:
        return False


def make_serve_parser(prog: str = "tokenmill serve", lang: str | None = None) -> ServeArgumentParser:
    """The `tokenmill serve` parser; `lang` ('zh' or 'en') picks the help language (default: from the locale)."""
    return ServeArgumentParser(prog, lang)


def parse_serve_args(argv: list[str], prog: str = "tokenmill serve") -> tuple[dict[str, Any], FrontendConfig]:
    """Parse `tokenmill serve` arguments into (engine kwargs for create_engine_config, FrontendConfig).

    The kwargs hold only what the command line or the --config file set. Bad input raises SystemExit(2).
    """
    parser = make_serve_parser(prog)
    values = vars(parser.parse_args(list(argv)))
    engine_fields = {f.name for cls in CONFIG_CLASSES for f in dataclasses.fields(cls)}
    frontend_fields = {f.name for f in dataclasses.fields(FrontendConfig)}
    try:
        frontend = FrontendConfig(**{k: v for k, v in values.items() if k in frontend_fields})
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    return {k: v for k, v in values.items() if k in engine_fields}, frontend

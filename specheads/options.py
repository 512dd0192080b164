"""The conventions every `specheads` command line follows, defined once.

- `Parser`: every (sub)command's parser. Its --help shows each option's default; options
  are never abbreviated (`--max-new` is an error, not `--max-new-tokens`), so a command
  that works today keeps working when an option is added.
- One name per concept, on every command that has it: `--device` (+ `--enforce-eager`
  where CUDA graphs apply), `--lookup-num-tokens N` (the engine's n-gram lookup drafts),
  `--store DIR` (drafts from a store of the target's replies, `specheads data store`),
  `--output-json PATH` (a JSON report; `-` is stdout), `--input` and `--output` (a
  command's data in and out).
- `add_deprecated_alias`: an old spelling kept working, hidden from --help, with one
  warning on stderr naming the new one.

The device rules themselves (what "auto" means, when CUDA graphs are on) are
specheads/runner.py's; `apply_device_options` applies them to a parsed command line.
"""

from __future__ import annotations

import argparse
import json
import sys

from specheads.runner import DEVICE_HELP, ENFORCE_EAGER_HELP, STORE_OFF

LOOKUP_HELP = ("draft up to N tokens by n-gram lookup in the context (serving/decode/lookup.py), beside the heads "
               "or alone; 0: off")
STORE_HELP = ("draft from the store of the target's replies in DIR (`specheads data store`; serving/decode/store.py), "
              "beside the heads and lookup; the replies served join it as they finish (bounded); 'learn': no built "
              "store, draft from the replies served so far and the prompt")
OUTPUT_JSON_HELP = "write the JSON report to PATH ('-': print it on stdout instead of the text)"


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every option that has a default worth showing: not None,
    False or empty, and not already stated in its help text."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text, default = action.help or "", action.default
        nothing_to_show = default is None or default is False or default is argparse.SUPPRESS or default == []
        if not action.option_strings or nothing_to_show or "default" in text:
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


class Parser(argparse.ArgumentParser):
    """The parser of `specheads` and of each of its subcommands (add_subparsers makes every
    subcommand's parser of the same class): defaults shown, no abbreviations."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


class _DeprecatedAlias(argparse.Action):
    """An old option spelling: stores into the new option's dest and warns once per use."""

    def __init__(self, option_strings, dest, replacement: str, nargs=None, const=None, type=None, metavar=None,
                 append: bool = False):
        super().__init__(option_strings, dest, nargs=nargs, const=const, type=type, metavar=metavar,
                         default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        self.replacement, self.append = replacement, append

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: warning: {option_string} is deprecated; {self.replacement}", file=sys.stderr)
        value = self.const if self.nargs == 0 else values
        if self.append:  # the new option is repeatable: the old spelling adds to the same list
            value = [*(getattr(namespace, self.dest, None) or []), value]
        setattr(namespace, self.dest, value)


def add_deprecated_alias(parser: argparse.ArgumentParser, old: str, dest: str, replacement: str, *,
                         const=None, type=None) -> None:
    """`old` sets `dest` as its replacement does: to `const` when given (a switch), else to its
    value (converted by `type`). `replacement` finishes the warning: "use --new-name"."""
    if const is not None:
        parser.add_argument(old, dest=dest, action=_DeprecatedAlias, replacement=replacement, nargs=0, const=const)
    else:
        parser.add_argument(old, dest=dest, action=_DeprecatedAlias, replacement=replacement, type=type)


def add_renamed_option(parser: argparse.ArgumentParser, new: str, old: str, *, required: bool = False,
                       **kwargs) -> None:
    """`new` (add_argument's `kwargs`) and `old`, its deprecated spelling. A required option
    stays required whichever spelling is given (a required group of the two, which also
    refuses both at once)."""
    container = parser.add_mutually_exclusive_group(required=True) if required else parser
    action = container.add_argument(new, **kwargs)
    container.add_argument(old, dest=action.dest, action=_DeprecatedAlias, replacement=f"use {new}", type=action.type,
                           append=isinstance(action, argparse._AppendAction))


def add_device_options(parser: argparse.ArgumentParser, graphs: bool = True) -> None:
    """--device (default auto) and, for commands that decode with the engine, --enforce-eager
    (dest cuda_graphs: None until apply_device_options decides) and the deprecated --cuda-graphs."""
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)
    if graphs:
        parser.add_argument("--enforce-eager", dest="cuda_graphs", action="store_const", const=False, default=None,
                            help=ENFORCE_EAGER_HELP)
        add_deprecated_alias(parser, "--cuda-graphs", "cuda_graphs", "CUDA graphs are on by default on a CUDA "
                             "device (--enforce-eager turns them off)", const=True)


def apply_device_options(args: argparse.Namespace) -> None:
    """Resolve args.device ("auto" -> cuda or cpu) and, where the command has it,
    args.cuda_graphs (-> a bool), through runner's rules; before any model loads."""
    from specheads.runner import resolve_cuda_graphs, resolve_device

    args.device = resolve_device(args.device)
    if hasattr(args, "cuda_graphs"):
        args.cuda_graphs = resolve_cuda_graphs(args.device, args.cuda_graphs)


def add_lookup_option(parser: argparse.ArgumentParser, default: int | None = None, help_text: str | None = None,
                      old: str | None = None) -> None:
    """--lookup-num-tokens N (dest lookup_num_tokens), and `old` as its deprecated spelling.
    Default None: what `specheads tune` stored in the heads directory."""
    if help_text is None:
        help_text = LOOKUP_HELP + ("" if default is not None else
                                   " (default: what `specheads tune` stored in the heads directory, else off)")
    parser.add_argument("--lookup-num-tokens", type=int, default=default, metavar="N", help=help_text)
    if old is not None:
        add_deprecated_alias(parser, old, "lookup_num_tokens", "use --lookup-num-tokens", type=int)


def add_store_option(parser: argparse.ArgumentParser, help_text: str | None = None) -> None:
    """--store DIR (dest store). Default None: what `specheads tune` stored in the heads directory;
    `--store none` turns that off."""
    parser.add_argument("--store", metavar="DIR|learn", default=None, help=help_text or STORE_HELP + (
        f" (default: what `specheads tune` stored in the heads directory, else off; {STORE_OFF}: off)"))


def add_output_json_option(parser: argparse.ArgumentParser, old_json: str | None = None) -> None:
    """--output-json PATH (dest output_json). `old_json`: what the deprecated --json did here:
    "switch" (print JSON on stdout: --output-json -) or "path" (--output-json PATH)."""
    parser.add_argument("--output-json", metavar="PATH", help=OUTPUT_JSON_HELP)
    if old_json == "switch":
        add_deprecated_alias(parser, "--json", "output_json", "use --output-json -", const="-")
    elif old_json == "path":
        add_deprecated_alias(parser, "--json", "output_json", "use --output-json PATH")


def write_json_report(path: str, report: dict) -> None:
    """--output-json: "-" prints the report on stdout as one line (for a pipe: `| jq`); a path
    gets it indented, written atomically."""
    if path == "-":
        print(json.dumps(report), flush=True)
        return
    from specheads.heads import atomic

    atomic.write_text(path, json.dumps(report, indent=2) + "\n")
    print(f"JSON report: {path}", file=sys.stderr)


def human_output(args: argparse.Namespace):
    """Where a command prints its tables: stderr when its JSON report goes to stdout."""
    return sys.stderr if getattr(args, "output_json", None) == "-" else sys.stdout

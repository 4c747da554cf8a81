"""`python -m commands.config_reference`: the configuration reference (docs/reference/config.md),
generated from the config dataclasses so it cannot drift from them.

    python -m commands.config_reference > docs/reference/config.md
    python -m commands.config_reference --out docs/reference/config.md
    python -m commands.config_reference --check      # exit 1 when the committed page is stale

It walks the sections and fields exactly as `python train.py --help` does
(trainer.config.help_text: section_names(), then dataclasses.fields of each section of a
default Config, types from _field_types, defaults written as TOML by _toml_value), so the page
lists what --help lists, in the same order. Per field: section.field, type, default, the help
text of its metadata, and the parallel layouts that help text names (read from the text only:
whether the field needs, allows or refuses them is what the help says, not this column).
The output is deterministic (no dates, no paths of this machine).
"""
import argparse
import dataclasses
import re
import sys
import types
import typing
from pathlib import Path

from trainer.config import SECTION_DOCS, Config, _field_types, _toml_value, section_names

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = Path("docs/reference/config.md")
REGENERATE = "python -m commands.config_reference --out docs/reference/config.md"

# layout names as the help texts write them, in the order the column lists them
_LAYOUTS = (
    ("dp", r"\bdp\b"), ("tp", r"\btp\b"), ("pp", r"\bpp\b"), ("cp", r"\bcp\b"),
    ("ep", r"\bep\b"), ("etp", r"\betp\b"),
    ("ZeRO", r"\bzero(?![_\w]| bubble)"),          # not the zero-bubble pipeline schedules
    ("parameter server", r"parameter[- ]server|\bps_servers\b"),
)


def layouts_named(help_text: str) -> list:
    """The parallel layouts a field's help text mentions by name (dp, tp, pp, cp, ep, etp,
    ZeRO, parameter server), in that order; what it says about them is in the text."""
    return [name for name, pattern in _LAYOUTS if re.search(pattern, help_text, re.IGNORECASE)]


def type_name(tp) -> str:
    """A field's annotation in words: int, str, float or none, float, str or none, ..."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        names = [type_name(a) for a in typing.get_args(tp)]
        return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    if tp is type(None):
        return "none"
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>|])")


def md_text(text: str) -> str:
    """Plain text for a Markdown table cell: one line, Markdown's special characters escaped
    (`|` would end the cell, `<x>` would be read as HTML, `a*b*c` as emphasis)."""
    return _MD_SPECIAL.sub(r"\\\1", " ".join(text.split()))


def md_code(text: str) -> str:
    """`text` as inline code, or escaped text where a code span could not hold it."""
    return md_text(text) if "`" in text or "|" in text else f"`{text}`"


def rows() -> list:
    """[(section, [(name, type, default, help), ...]), ...] in --help's order."""
    cfg, out = Config(), []
    for section in section_names():
        sec = getattr(cfg, section)
        types_ = _field_types(sec)
        out.append((section, [(f.name, type_name(types_[f.name]), _toml_value(getattr(sec, f.name)),
                               f.metadata.get("help", "")) for f in dataclasses.fields(sec)]))
    return out


def render() -> str:
    sections = rows()
    n_fields = sum(len(fields) for _, fields in sections)
    out = [f"*Generated from the config dataclasses' metadata; do not edit by hand, regenerate "
           f"with `{REGENERATE}`.*",
           "",
           "# Configuration reference",
           "",
           "Every field train.py reads, as `python train.py --help` lists them: "
           f"{len(sections)} sections, {n_fields} fields. Set a field in a TOML file's "
           "`[section]` table (`python train.py --config FILE.toml`) or on the command line as "
           "`section.field=value` (later wins). Defaults are written as TOML values. "
           "*Layouts named* lists the parallel layouts (dp, tp, pp, cp, ep, etp, ZeRO, "
           "parameter server) the field's help text mentions; the help says whether the field "
           "needs, allows or refuses them, and `trainer.config.validate` (with "
           "`ParallelPlan.validate`, parallel/plan.py) checks every combination before a run "
           "starts.",
           "",
           "Sections: " + ", ".join(f"[{s}](#{s})" for s, _ in sections) + ".",
           ""]
    for section, fields in sections:
        out += [f"## {section}", "", md_text(SECTION_DOCS.get(section, "")) + ".", "",
                "| Field | Type | Default | Help | Layouts named |",
                "| --- | --- | --- | --- | --- |"]
        for name, tname, default, help_ in fields:
            out.append(f"| `{section}.{name}` | {md_text(tname)} | {md_code(default)} | "
                       f"{md_text(help_)} | {', '.join(layouts_named(help_))} |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m commands.config_reference",
                                 description="Write the configuration reference (Markdown) "
                                             "generated from the config dataclasses.")
    ap.add_argument("--out", type=Path, help="write it to this file (default: stdout)")
    ap.add_argument("--check", action="store_true",
                    help=f"compare with --out (default {DEFAULT_OUT}) instead of writing; exit 1 "
                         f"when it differs")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        path = args.out or ROOT / DEFAULT_OUT
        if not path.is_file() or path.read_text() != text:
            print(f"{path} is out of date; regenerate it with `{REGENERATE}`", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Bad input, systematically: every config field given a value of the wrong type and one out
of range on the command line (train.py's parsing and validation, in one process) ends in a
ConfigError of one line naming the field -- never another exception (a traceback under
train.py) and never silently taken -- except the fields that name things only a run can check
(paths, names: each refused at run time in one line, tests/unit/test_bad_input_lines.py and
tests/e2e)."""
import dataclasses

from trainer.config import (Config, ConfigError, _field_types, _is_optional, load_config,
                            section_names, validate)

# any string names something here; what it names is checked when the run opens it
FREE_TEXT = {"run.dir", "run.name", "moe.router_replay", "data.source", "data.text_field",
             "data.cache_dir", "checkpoint.init_from"}


def _bad_values(tp) -> list:
    """(kind, command-line text) of a wrong-type and an out-of-range value for a field type."""
    inner = _is_optional(tp)[1]
    return {bool: [("wrong type", "3"), ("out of range", '"maybe"')],
            int: [("wrong type", '"abc"'), ("out of range", "-7")],
            float: [("wrong type", '"abc"'), ("out of range", "-1.5")],
            str: [("wrong type", "[1, 2]"), ("out of range", '"no_such_value_xyz"')]
            }.get(inner, [("wrong type", "{a = 1}"), ("out of range", "-7")])


def _outcome(override: str):
    try:
        validate(load_config(None, [override]), 1)
    except ConfigError as e:
        return "refused", str(e)
    except Exception as e:  # noqa: BLE001 - the failure this test looks for
        return "traceback", f"{type(e).__name__}: {e}"
    return "accepted", ""


def test_every_field_refuses_a_wrong_type_and_an_out_of_range_value_in_one_line():
    cfg, seen, wrong = Config(), 0, []
    for sec in section_names():
        types = _field_types(getattr(cfg, sec))
        for f in dataclasses.fields(getattr(cfg, sec)):
            name = f"{sec}.{f.name}"
            for kind, text in _bad_values(types[f.name]):
                seen += 1
                what, msg = _outcome(f"{name}={text}")
                if what == "refused" and "\n" not in msg and f.name in msg:
                    continue
                if what == "accepted" and kind == "out of range" and name in FREE_TEXT:
                    continue
                wrong.append(f"{name}={text} ({kind}): {what}: {msg[:160]}")
    assert not wrong, f"{len(wrong)} of {seen} bad values not refused in one line:\n" + "\n".join(wrong)
    assert seen > 250  # every section's every field

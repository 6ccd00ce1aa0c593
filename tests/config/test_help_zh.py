"""The Chinese help of `tokenmill serve` matches the parser's flags both ways: every option has a Chinese text, and
no Chinese text is left for an option the parser no longer has."""
from __future__ import annotations

import pytest

from tokenmill.config.args import LEGACY_FLAGS, make_serve_parser
from tokenmill.config.help_zh import GROUP_DOCS_EN, GROUP_DOCS_ZH, GROUP_TITLES_ZH, HELP_ZH


@pytest.fixture(autouse=True)
def english_locale(monkeypatch):
    for var in ("LANGUAGE", "LC_ALL", "LC_MESSAGES", "LANG"):
        monkeypatch.delenv(var, raising=False)


def test_every_option_has_a_chinese_text_and_every_text_an_option():
    options = {spec.dest for spec in make_serve_parser(lang="en").specs}
    missing = sorted(name for name in options if not HELP_ZH.get(name, "").strip())
    stale = sorted(set(HELP_ZH) - options)
    assert not missing, f"add Chinese help to tokenmill/config/help_zh.py for: {missing}"
    assert not stale, f"remove the Chinese help of options the parser no longer has: {stale}"
    assert not set(LEGACY_FLAGS) & set(HELP_ZH)  # hidden spellings have no help in either language


def test_every_group_has_chinese_title_and_description_and_none_is_left_over():
    groups = set(make_serve_parser(lang="zh").groups)
    assert set(GROUP_TITLES_ZH) == groups
    assert set(GROUP_DOCS_ZH) == groups
    assert set(GROUP_DOCS_EN) <= groups


def test_chinese_help_all_shows_every_flag_with_its_chinese_text(capsys):
    parser = make_serve_parser(lang="zh")
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--help=all", "--help-lang", "zh"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    flat = "".join(out.split())  # wrapping breaks lines between CJK characters
    for action in parser._actions:
        if action.help is None or action.help == "==SUPPRESS==" or not action.option_strings:
            continue
        assert action.option_strings[0] in out
        text = HELP_ZH[action.dest]
        assert "".join(text.split()) in flat, action.dest

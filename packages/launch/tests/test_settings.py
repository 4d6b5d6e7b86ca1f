"""The settings table: parsing of every kind, errors that name the fix, caching, the docs."""

from __future__ import annotations

import io

import pytest

from mpx.launch import settings
from mpx.launch.errors import LaunchError, MPXError, SettingError
from mpx.launch.settings import Setting, declare, format_size, parse_size


@pytest.mark.parametrize(
    ("text", "unit", "want"),
    [
        ("4096", "bytes", 4096),
        ("64K", "bytes", 64 << 10),
        ("64k", "bytes", 64 << 10),
        ("1M", "bytes", 1 << 20),
        ("1MiB", "bytes", 1 << 20),
        ("1MB", "bytes", 1 << 20),
        ("2G", "bytes", 2 << 30),
        ("1.5M", "bytes", 3 << 19),
        (" 16 ", "MiB", 16 << 20),
        ("512K", "MiB", 512 << 10),
    ],
)
def test_sizes_accept_suffixes_and_bare_numbers_in_the_unit(
    text: str, unit: str, want: int
) -> None:
    assert parse_size(text, unit) == want


@pytest.mark.parametrize("nbytes", [0, 1, 1000, 4096, 64 << 10, 3 << 19, 16 << 20, 2 << 30])
def test_format_size_reads_back(nbytes: int) -> None:
    assert parse_size(format_size(nbytes)) == nbytes


def _setting(kind: str, default: object, **extra: object) -> Setting[object]:
    # Not declared in the table: a free-standing setting of the kind under test.
    return Setting("MPX_TEST_VALUE", kind, default, "a test value", "launch", **extra)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kind", "text", "want"),
    [
        ("bool", "1", True),
        ("bool", "Off", False),
        ("bool", "yes", True),
        ("int", "12", 12),
        ("float", "0.5", 0.5),
        ("seconds", "30", 30.0),
        ("str", "anything at all", "anything at all"),
    ],
)
def test_each_kind_parses(kind: str, text: str, want: object) -> None:
    assert _setting(kind, None).read({"MPX_TEST_VALUE": text}) == want


@pytest.mark.parametrize(
    ("kind", "text", "form"),
    [
        ("bool", "maybe", "1/0, true/false"),
        ("int", "1M", "an integer"),
        ("seconds", "-3", "positive number of seconds"),
        ("size", "lots", "a size such as 64K, 1M or 2G"),
    ],
)
def test_bad_values_name_variable_value_and_form(kind: str, text: str, form: str) -> None:
    with pytest.raises(SettingError) as info:
        _setting(kind, 0).read({"MPX_TEST_VALUE": text})
    message = str(info.value)
    assert "MPX_TEST_VALUE" in message
    assert repr(text) in message
    assert form in message
    # One taxonomy: a SettingError is an MPXError, and a ValueError for old except clauses.
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, LaunchError)
    assert isinstance(info.value, MPXError)


def test_choices_and_minimum() -> None:
    choice = _setting("choice", "a", choices=("a", "b"))
    assert choice.read({"MPX_TEST_VALUE": "b"}) == "b"
    with pytest.raises(SettingError, match="one of a, b"):
        choice.read({"MPX_TEST_VALUE": "c"})
    size = _setting("size", 4096, minimum=4096, unit="bytes")
    with pytest.raises(SettingError, match="at least 4096"):
        size.read({"MPX_TEST_VALUE": "1K"})


def test_unset_and_empty_give_the_default_and_aliases_are_read() -> None:
    s = _setting("int", 7, aliases=("CGX_TEST_VALUE",))
    assert s.read({}) == 7
    assert s.read({"MPX_TEST_VALUE": "  "}) == 7
    assert s.read({"CGX_TEST_VALUE": "3"}) == 3
    assert s.read({"CGX_TEST_VALUE": "3", "MPX_TEST_VALUE": "4"}) == 4  # the MPX name wins
    with pytest.raises(SettingError, match="CGX_TEST_VALUE='x'"):
        s.read({"CGX_TEST_VALUE": "x"})  # the error names the variable that was read


def test_values_are_cached_until_reload(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPX_GPUS", "none")
    settings.reload()
    assert settings.GPUS.get() == "none"
    monkeypatch.setenv("MPX_GPUS", "auto")
    assert settings.GPUS.get() == "none"  # read once
    settings.reload()
    assert settings.GPUS.get() == "auto"


def test_a_name_is_declared_once() -> None:
    with pytest.raises(SettingError, match="declared twice"):
        declare("MPX_GPUS", "str", "", "again", package="launch")


def test_table_lists_launch_variables_and_check_flags_bad_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    table = settings.markdown_table()
    for name in ("MPX_GPUS", "MPX_LAUNCHER", "MPX_MASTER_ADDR", "MPX_JOB_ID"):
        assert f"`{name}`" in table
    monkeypatch.setenv("MPX_GPUS", "some")
    monkeypatch.setenv("MPX_NO_SUCH_VARIABLE", "1")
    out = io.StringIO()
    assert settings.check_environment(out) == 1
    assert "MPX_GPUS='some'" in out.getvalue()
    assert "MPX_NO_SUCH_VARIABLE is set but no installed mpx package reads it" in out.getvalue()

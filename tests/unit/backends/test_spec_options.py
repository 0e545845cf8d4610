"""Backend spec option values read one way for every backend (spec_options.py)."""

from __future__ import annotations

import pytest

from hicache.backends.registry import open_backend
from hicache.backends.spec_options import flag, integer, number, split_dir_spec
from hicache.testing.conformance import namespace


def test_numbers_in_range_come_back_as_numbers() -> None:
    assert number("2.5", "x", lo=0) == 2.5
    assert number(3, "x", lo=3) == 3.0
    assert integer("7", "x", lo=1) == 7 and isinstance(integer("7", "x", lo=1), int)
    assert integer(8.0, "x", lo=1) == 8


@pytest.mark.parametrize(
    ("value", "options", "message"),
    [
        ("abc", {"lo": 0}, "opt t must be a number, got 'abc'"),
        (None, {"lo": 0}, "opt t must be a number, got None"),
        (True, {"lo": 0}, "opt t must be a number, got True"),
        ("nan", {"lo": 0}, "opt t must be a number, got 'nan'"),
        ("inf", {"lo": 0}, "opt t must be a number, got 'inf'"),
        ("-1", {"lo": 0}, "opt t must be a number >= 0, got '-1'"),
        ("0", {"lo": 0, "open_lo": True}, "opt t must be a number > 0, got '0'"),
        ("1.5", {"lo": 1, "whole": True}, "opt t must be an integer, got '1.5'"),
        ("0", {"lo": 1, "whole": True}, "opt t must be an integer >= 1, got '0'"),
    ],
)
def test_bad_numbers_name_the_option_and_show_the_value(
    value: object, options: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError) as raised:
        number(value, "opt t", **options)  # type: ignore[arg-type]
    assert str(raised.value) == message


def test_flags_take_bools_and_the_usual_words_in_any_case() -> None:
    for yes in (True, "1", "true", "YES", " on "):
        assert flag(yes, "f") is True
    for no in (False, "0", "False", "no", "off", ""):
        assert flag(no, "f") is False
    assert flag("required", "f", yes=frozenset({"required"})) is True
    with pytest.raises(ValueError, match="opt f must be yes or no, got 'maybe'"):
        flag("maybe", "opt f")
    with pytest.raises(ValueError, match="got ''"):
        flag("", "f", no=frozenset({"no"}))  # a caller may refuse the empty value


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nixl:/d?threads=0", "nixl option threads must be an integer >= 1, got '0'"),
        ("nixl:/d?timeout=inf", "nixl option timeout must be a number, got 'inf'"),
        ("hf3fs:/d?entries=x", "hf3fs option entries must be an integer, got 'x'"),
        ("hf3fs:/d?fsync=maybe", "hf3fs option fsync must be yes or no, got 'maybe'"),
        ("mooncake://m:1?lanes=0", "Mooncake option lanes must be an integer >= 1, got '0'"),
        ("mooncake://m:1?retry=0", "Mooncake option retry must be a number > 0, got '0'"),
        ("redis://h?pool=0", "'redis://h?pool=0': option pool must be an integer >= 1, got '0'"),
        ("aibrix:/d?ttl=-5", "aibrix option ttl must be an integer >= 1, got '-5'"),
    ],
)
def test_every_backend_names_a_bad_option_value_the_same_way(spec: str, message: str) -> None:
    """Through the registry, as a user's spec goes (building a backend needs neither its
    library nor its server)."""
    with pytest.raises(ValueError) as raised:
        open_backend(spec, namespace=namespace("spec"))
    assert str(raised.value) == message


def test_keyword_only_names_are_taken_as_keywords_listed_and_refused_in_the_query() -> None:
    split = split_dir_spec(
        "x:/d", "x", known={"a"}, options={"k": 1}, example="x:/d", keyword_only={"k"}
    )
    assert split.values == {"k": 1}
    with pytest.raises(TypeError, match=r"known: \['a', 'k'\]"):
        split_dir_spec(
            "x:/d", "x", known={"a"}, options={"z": 1}, example="x:/d", keyword_only={"k"}
        )
    with pytest.raises(ValueError, match="unknown option 'k'"):
        split_dir_spec("x:/d?k=1", "x", known={"a"}, options={}, example="x:/d", keyword_only={"k"})


def test_a_directory_spec_splits_and_keywords_win() -> None:
    split = split_dir_spec(
        "x:/data/kv?a=1&p.q=2&b=",
        "x",
        known={"a", "b"},
        options={"a": 5},
        example="x:/d",
        passthrough="p.",
    )
    assert (split.root, split.values, split.passed) == ("/data/kv", {"a": 5, "b": ""}, {"q": "2"})


@pytest.mark.parametrize(
    ("spec", "options", "error", "message"),
    [
        ("y:/d", {}, ValueError, "x backend spec must be x:DIR[?options], got 'y:/d'"),
        (7, {}, ValueError, "x backend spec must be x:DIR[?options], got 7"),
        ("x:?a=1", {}, ValueError, "storage spec 'x:' needs a directory, e.g. x:/d"),
        ("x:/d?c=1", {}, ValueError, "x spec 'x:/d?c=1': unknown option 'c'; known: a, p.NAME"),
        ("x:/d", {"c": 1}, TypeError, "unknown x backend options ['c']; known: ['a']"),
    ],
)
def test_a_bad_directory_spec_says_what_is_wrong(
    spec: object, options: dict[str, object], error: type[Exception], message: str
) -> None:
    with pytest.raises(error) as raised:
        split_dir_spec(spec, "x", known={"a"}, options=options, example="x:/d", passthrough="p.")
    assert str(raised.value) == message

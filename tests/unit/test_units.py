"""Keep-alive durations and memory sizes as people and Ollama clients write them."""

from __future__ import annotations

import pytest

from ferrum.models.units import parse_duration, parse_size

GIB = 1024**3


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("300", 300.0),
        ("2.5", 2.5),
        ("0", 0.0),
        ("90s", 90.0),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("1h30m15s", 5415.0),
        ("5m0s", 300.0),
        ("1.5h", 5400.0),
        ("500ms", 0.5),
        ("1m500ms", 60.5),
        (" 10M ", 600.0),  # case and surrounding blanks do not matter
    ],
)
def test_go_style_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("value", [-1, -5, -0.5, "-1", "-300", "-5m", "-1h30m", "-1ms"])
def test_any_negative_duration_means_forever(value: str | float) -> None:
    assert parse_duration(value) == -1.0


def test_numbers_are_seconds_and_zero_is_not_forever() -> None:
    assert parse_duration(0) == 0.0
    assert parse_duration(42) == 42.0
    assert parse_duration(1.25) == 1.25
    assert parse_duration("-0s") == 0.0  # "unload at once", not "keep for good"
    assert isinstance(parse_duration(7), float)


@pytest.mark.parametrize(
    "value",
    ["", " ", "-", "m", "5x", "5 m", "5m junk", "m5", "1h-30m", "+5m", "5mm", "1d",
     ".5s", "five minutes", True, False],
)  # fmt: skip
def test_bad_durations_raise_naming_the_value(value: str | bool) -> None:
    with pytest.raises(ValueError) as info:
        parse_duration(value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", ["nan", "inf", "infinity", float("nan"), float("inf")])
def test_non_finite_durations_are_refused(value: str | float) -> None:
    with pytest.raises(ValueError):
        parse_duration(value)


@pytest.mark.parametrize(
    "value", [1e300, "1e300", 10**400, "9999999h", "99999999999999999999m", 366 * 86400 + 1]
)
def test_durations_longer_than_a_year_are_refused(value: str | float) -> None:
    with pytest.raises(ValueError, match="longer than a year"):
        parse_duration(value)


def test_a_year_is_the_longest_and_any_negative_is_forever() -> None:
    assert parse_duration(366 * 86400) == parse_duration("8784h") == 366 * 86400.0
    assert parse_duration(-(10**400)) == parse_duration(-1e300) == -1.0


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1048576", 1048576),
        ("0", 0),
        ("1b", 1),
        ("1B", 1),
        ("1k", 1024),
        ("1KiB", 1024),
        ("1KB", 1024),  # memory is counted in powers of two, whatever the spelling
        ("512M", 512 * 1024**2),
        ("512MiB", 512 * 1024**2),
        ("2g", 2 * GIB),
        ("8GiB", 8 * GIB),
        ("8 GiB", 8 * GIB),
        (" 8gib ", 8 * GIB),
        ("1.5GiB", 3 * GIB // 2),
        ("1T", 1024**4),
    ],
)
def test_sizes_are_1024_based(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", " ", "GiB", "x", "-1", "-1GiB", "8 GiB free", "8PiB",
                                  "8GiBs", "1.2.3G", "0x10", "eight"])  # fmt: skip
def test_bad_sizes_raise_naming_the_value(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_size(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize("text", ["8i", "8ib"])
def test_a_stray_i_is_not_a_unit(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size(text)

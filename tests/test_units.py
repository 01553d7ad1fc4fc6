import pytest

from colab_kit._units import format_age, format_bytes, parse_duration


@pytest.mark.parametrize("text, seconds", [
    ("90s", 90), ("10min", 600), ("1h", 3600), ("1.5h", 5400), (" 2 minutes ", 120), ("30sec", 30),
])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["10", "ten min", "5 parsecs", "", "0s", "-1h"])
def test_parse_duration_rejects_with_the_accepted_forms(text):
    with pytest.raises(ValueError, match=r"(10min|longer than zero)"):
        parse_duration(text)


def test_formatters():
    assert format_bytes(None) == "n/a"
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(12.7 * 1024**3) == "12.7 GiB"
    assert format_age(42) == "42 s"
    assert format_age(7 * 60) == "7 min"
    assert format_age(3 * 3600) == "3.0 h"

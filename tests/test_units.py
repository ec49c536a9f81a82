"""Parsing bandwidths and durations from config strings, and formatting bytes and seconds for reports."""

import pytest

from fast.errors import ConfigError
from fast.units import format_bytes, format_seconds, parse_bandwidth, parse_duration


@pytest.mark.parametrize(
    "text, bytes_per_second",
    [
        ("10Mbit", 1.25e6),
        ("1Gbit", 1.25e8),
        ("100kbit", 12_500),
        ("100Kbit", 12_500),
        ("10mbit", 1.25e6),
        ("0.5Gbit", 6.25e7),
        ("1e3bit", 125),
        ("8bps", 1),
        ("1Kbps", 125),
        ("10Mbit/s", 1.25e6),
        ("5MB/s", 5e6),
        ("2KB/s", 2000),
        ("2kB/s", 2000),
        ("1GB/s", 1e9),
        ("1MiB/s", 2**20),
        ("1Mibit", 2**20 / 8),
        ("125000", 125_000),
        (" 10 Mbit ", 1.25e6),
        (125_000, 125_000),
        (2.5e6, 2.5e6),
    ],
)
def test_parse_bandwidth_accepts_bits_bytes_and_plain_numbers(text, bytes_per_second):
    assert parse_bandwidth(text) == pytest.approx(bytes_per_second, rel=1e-12)


@pytest.mark.parametrize(
    "text", ["", "fast", "Mbit", "10 parsec", "10MBps", "10mb/s", "-5Mbit", "0Mbit", "0", "inf", True, None]
)
def test_parse_bandwidth_rejects_bad_strings_with_a_hint(text):
    with pytest.raises(ConfigError, match="expected e.g. '10Mbit' or '1Gbit'"):
        parse_bandwidth(text)


@pytest.mark.parametrize(
    "text, seconds",
    [
        ("50ms", 0.05),
        ("200us", 2e-4),
        ("200µs", 2e-4),
        ("1.5s", 1.5),
        ("2min", 120),
        ("2h", 7200),
        ("0.05", 0.05),
        ("0ms", 0.0),
        (0, 0.0),
        (3, 3.0),
    ],
)
def test_parse_duration_accepts_units_and_plain_seconds(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds, rel=1e-12)


@pytest.mark.parametrize("text", ["", "ms", "50 parsec", "1d", "-1s", "1e999s", False, [1]])
def test_parse_duration_rejects_bad_strings_with_a_hint(text):
    with pytest.raises(ConfigError, match="e.g. '50ms', '1s' or '2h'"):
        parse_duration(text)


@pytest.mark.parametrize(
    "nbytes, text",
    [
        (0, "0 B"),
        (512, "512 B"),
        (1500, "1.5 kB"),
        (999_999, "1 MB"),
        (123_456_789, "123 MB"),
        (2.5e9, "2.5 GB"),
        (-1500, "-1.5 kB"),
        (5e15, "5000 TB"),
    ],
)
def test_format_bytes_uses_decimal_units_and_three_digits(nbytes, text):
    assert format_bytes(nbytes) == text


@pytest.mark.parametrize(
    "seconds, text",
    [
        (0, "0 s"),
        (2.5e-4, "250 us"),
        (0.0125, "12.5 ms"),
        (0.9999, "1 s"),
        (3.2, "3.2 s"),
        (59.99, "1 min 00 s"),
        (245, "4 min 05 s"),
        (7380, "2 h 03 min"),
        (-0.5, "-500 ms"),
    ],
)
def test_format_seconds_picks_a_readable_unit(seconds, text):
    assert format_seconds(seconds) == text

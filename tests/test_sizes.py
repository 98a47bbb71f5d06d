"""Sizes as people write them."""

import pytest

from hostagent.units import SizeError, format_size, format_size_exact, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 1024**3),
        ("512MiB", 512 * 1024**2),
        ("1073741824", 1073741824),
        ("1.5GiB", 1536 * 1024**2),
        ("2gib", 2 * 1024**3),
        ("10GB", 10 * 1000**3),
        ("4G", 4 * 1000**3),
        ("4Gi", 4 * 1024**3),
        ("80 GiB", 80 * 1024**3),
        ("1TiB", 1024**4),
        ("100B", 100),
    ],
)
def test_sizes_parse(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["20 GB?", "", "GiB", "-1GiB", "0", "0GiB", "1.5", "12 parsecs", "1e9", "1,024"]
)
def test_bad_sizes_are_refused_with_the_value_named(text):
    with pytest.raises(SizeError) as info:
        parse_size(text)
    assert repr(text) in str(info.value)


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(24 * 1024**3, "24.0 GiB"), (512 * 1024**2, "512.0 MiB"), (100, "100 B"), (None, "-")],
)
def test_sizes_format_for_people(num_bytes, text):
    assert format_size(num_bytes) == text


@pytest.mark.parametrize("text", ["16", " 20 ", "1024"])
def test_a_size_people_type_needs_a_unit(text):
    assert parse_size(text) > 0  # bytes where a plain count is the convention (settings)
    with pytest.raises(SizeError) as info:
        parse_size(text, unit_required=True)
    assert f"write {text.strip()}GiB" in str(info.value)


@pytest.mark.parametrize(
    ("num_bytes", "text"),
    [(16 * 1000**3, "16GB"), (20 * 1024**3, "20GiB"), (1536 * 1024**2, "1536MiB"),
     (1000001, "1000001B"), (1024**4, "1TiB")],
)  # fmt: skip
def test_exact_sizes_read_back_to_the_byte(num_bytes, text):
    assert format_size_exact(num_bytes) == text
    assert parse_size(text, unit_required=True) == num_bytes

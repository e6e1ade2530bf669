import pytest

from memfit.errors import UsageError
from memfit.units import GiB, MiB, format_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [("24GiB", 24 * GiB), ("24GB", 24 * 10**9), ("512 MiB", 512 * MiB), ("1.5GiB", 3 * GiB // 2), (1024, 1024),
     ("100", 100), ("2g", 2 * GiB)],
)
def test_parse_bytes(text, expected):  # noqa: ANN001
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["24 GB?", "-3GiB", "GiB", "", "3 parsecs", 0, -1, True])
def test_parse_bytes_rejects_with_a_useful_message(bad):  # noqa: ANN001
    with pytest.raises(UsageError) as err:
        parse_bytes(bad)
    assert "GiB" in str(err.value)


def test_format_bytes():
    assert format_bytes(3 * GiB) == "3.00 GiB"
    assert format_bytes(1536 * 1024) == "1.50 MiB"
    assert format_bytes(100) == "100 B"
    assert format_bytes(-2 * MiB) == "-2.00 MiB"

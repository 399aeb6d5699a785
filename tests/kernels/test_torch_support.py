"""The supported torch range: older refused with the fix, newer warned about."""

from __future__ import annotations

import warnings

import pytest

from kernels.torch_support import MIN_TORCH, TESTED_MAX, check_torch_version, parse_version


@pytest.mark.parametrize(
    ("version", "parsed"),
    [("2.13.0+cpu", (2, 13)), ("2.11.0a0+git1234", (2, 11)), ("2.6.0", (2, 6)), ("3.0.1", (3, 0))],
)
def test_parse_version(version: str, parsed: tuple[int, int]) -> None:
    assert parse_version(version) == parsed


@pytest.mark.parametrize("version", ["2.11.0+cu130", "2.12.1", "2.13.0+cpu"])
def test_supported_versions_pass_silently(version: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_torch_version(version)


@pytest.mark.parametrize("version", ["2.6.0", "2.10.0+cpu", "1.13.1"])
def test_older_torch_is_refused_with_the_fix(version: str) -> None:
    with pytest.raises(RuntimeError, match=r"torch >= 2\.11.*make setup"):
        check_torch_version(version)


def test_newer_torch_warns() -> None:
    with pytest.warns(UserWarning, match="newer than the newest version"):
        check_torch_version("2.15.0")


def test_installed_torch_is_in_range() -> None:
    import torch

    assert MIN_TORCH <= parse_version(torch.__version__) <= TESTED_MAX

"""The README's Python examples run as written (so they cannot rot)."""

from __future__ import annotations

import os
import re

import pytest

README = os.path.join(os.path.dirname(__file__), "..", "..", "README.md")


def examples():
    text = open(README, encoding="utf-8").read()
    section = text[text.index("### Examples"):]
    section = section[:section.index("### Using the installed library from CMake")]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_the_readme_has_examples():
    assert len(examples()) >= 2


@pytest.mark.parametrize("i", range(len(examples())))
def test_readme_example_runs(i):
    exec(compile(examples()[i], f"README example {i + 1}", "exec"), {})

"""README's two settings tables are the declarations: each row is exactly (variable, meaning,
default) as `art/megatron/settings.py` and `art/trainer_rank/_options.py` declare it, in the
declared order, so a renamed, added or re-documented setting fails here until README follows."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from art.env_vars import EnvTable
from art.megatron.settings import MEGATRON_ENV
from art.trainer_rank._options import TRAINER_RANK_ENV

README = Path(__file__).resolve().parents[1] / "README.md"


def _table_rows(heading: str) -> list[str]:
    """The data rows of the table under the README heading `heading`."""
    section = README.read_text().split(heading, 1)[1].split("\n### ", 1)[0]
    return re.findall(r"^\| `[A-Z0-9_]+` \|.*\|$", section, re.MULTILINE)


@pytest.mark.parametrize("heading,table", [
    ("### `ART_MEGATRON_*`", MEGATRON_ENV),
    ("### `ART_TRAINER_RANK_*`", TRAINER_RANK_ENV),
])
def test_the_readme_table_is_the_declarations(heading: str, table: EnvTable) -> None:
    rows = _table_rows(heading)
    assert rows, f"no table under {heading}"
    declared = table.markdown_rows()
    for row, expected in zip(rows, declared, strict=False):
        assert row == expected, f"README row differs from the declaration:\n{row}\n{expected}"
    assert len(rows) == len(declared), (
        f"README has {len(rows)} rows, the code declares {len(declared)}: "
        f"{sorted(set(declared) ^ set(rows))}")


def test_every_applied_setting_is_documented() -> None:
    for table in (MEGATRON_ENV, TRAINER_RANK_ENV):
        for variable in table.applied_variables():
            assert variable.meaning and variable.default_text, variable.name

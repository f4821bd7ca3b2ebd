"""README's two settings tables name exactly the variables the code reads: every variable the
trainer applies has a row, and every row is a variable the code knows (a renamed or added
setting fails here until README follows)."""

from __future__ import annotations

import re
from pathlib import Path

from art.megatron.settings import _FIELD_TO_VARIABLE
from art.trainer_rank._options import ENV_PREFIX, ENV_VARIABLES

README = Path(__file__).resolve().parents[1] / "README.md"


def _table_variables(heading: str) -> list[str]:
    """The first-column variable names of the table under the README heading `heading`."""
    text = README.read_text()
    section = text.split(heading, 1)[1].split("\n### ", 1)[0]
    return re.findall(r"^\| `([A-Z0-9_]+)` \|", section, re.MULTILINE)


def test_the_trainer_rank_table_is_the_options_the_code_reads():
    rows = _table_variables("### `ART_TRAINER_RANK_*`")
    assert len(rows) == len(set(rows))
    assert set(rows) == {ENV_PREFIX + name for name in ENV_VARIABLES}


def test_the_megatron_table_is_the_settings_the_provider_applies():
    rows = _table_variables("### `ART_MEGATRON_*`")
    assert len(rows) == len(set(rows))
    assert set(rows) == {f"ART_MEGATRON_{name}" for name in _FIELD_TO_VARIABLE.values()}

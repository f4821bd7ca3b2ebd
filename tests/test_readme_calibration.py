"""README's table of calibration matrices is what the matrices' own summaries say: every
`bench/calibration/**/calibration.md` that scripts/calibrate.py wrote has one row, and the row's
cell count and in-band counts (probe and default formulas) are that file's, so a matrix that is
re-measured or re-priced fails here until README follows."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CALIBRATION = ROOT / "bench" / "calibration"
SUMMARY = re.compile(r"^- (probe coefficients|default formulas \(no probe\)): (\d+) of (\d+) "
                     r"cells inside \[1\.00, 1\.05\]", re.MULTILINE)
ROW = re.compile(r"^\| `(bench/calibration[^`]*)` \|(?:[^|]*\|){3} (\d+) \| (\d+)/(\d+) \| "
                 r"(\d+)/(\d+) \|$", re.MULTILINE)


def _summary(md: Path) -> dict[str, tuple[int, int]]:
    found = {kind: (int(inside), int(cells)) for kind, inside, cells in SUMMARY.findall(
        md.read_text())}
    assert set(found) == {"probe coefficients", "default formulas (no probe)"}, md
    return found


def _readme_rows() -> dict[str, tuple[int, tuple[int, int], tuple[int, int]]]:
    section = README.read_text().split("<!-- calibration matrices: start -->", 1)[1]
    section = section.split("<!-- calibration matrices: end -->", 1)[0]
    rows = {}
    for path, cells, p_in, p_cells, d_in, d_cells in ROW.findall(section):
        assert path not in rows, f"{path} is listed twice"
        assert int(p_cells) == int(d_cells) == int(cells), path
        rows[path.rstrip("/")] = (int(cells), (int(p_in), int(p_cells)),
                                  (int(d_in), int(d_cells)))
    return rows


def test_every_matrix_has_a_readme_row_with_its_own_counts() -> None:
    rows = _readme_rows()
    matrices = {str(md.parent.relative_to(ROOT)): md
                for md in sorted(CALIBRATION.rglob("calibration.md"))}
    assert matrices and set(rows) == set(matrices), (
        f"README lists {sorted(set(rows) - set(matrices))} that do not exist and misses "
        f"{sorted(set(matrices) - set(rows))}")
    for path, md in matrices.items():
        summary = _summary(md)
        cells, probe, formulas = rows[path]
        assert probe == summary["probe coefficients"], (path, probe, summary)
        assert formulas == summary["default formulas (no probe)"], (path, formulas, summary)
        assert cells == probe[1], path

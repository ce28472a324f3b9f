"""benchmarks/expert_matmul_cost.py: the fit it reports and the rows it refuses (docs/cluster.md, "Why
chunks cost on this machine")."""

import pytest
from helpers import load_benchmark


def _bench():
    return load_benchmark("expert_matmul_cost")


def test_the_fit_recovers_a_fixed_part_and_a_per_row_part():
    fit = _bench().fit_fixed_and_per_row
    rows = [128, 256, 1024, 4096]
    fixed, per_row = fit(rows, [2.5 + 0.006 * r for r in rows])
    assert fixed == pytest.approx(2.5) and per_row == pytest.approx(0.006)
    # noise that averages out around the line leaves the line
    fixed, per_row = fit([100, 100, 300, 300], [1.9, 2.1, 3.9, 4.1])
    assert fixed == pytest.approx(1.0) and per_row == pytest.approx(0.01)


def test_it_times_the_projection_at_every_row_count(capsys):
    report = _bench().main(
        ["--experts", "2", "--hidden", "16", "--width", "8", "--rows", "4,8,16", "--repeats", "2"]
    )
    assert report["rows"] == [4, 8, 16] and len(report["ms"]) == 3 and all(ms > 0 for ms in report["ms"])
    out = capsys.readouterr().out
    assert "2 experts of 16 x 8" in out and "fit:" in out


@pytest.mark.parametrize("rows", ["64", "1,64"])
def test_too_few_or_too_small_row_counts_are_refused(rows, capsys):
    with pytest.raises(SystemExit):
        _bench().main(["--experts", "2", "--rows", rows])
    assert f"--rows {rows}" in capsys.readouterr().err

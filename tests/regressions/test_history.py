"""Change-point detection (E-divisive means) on series with known steps, and over a store.

The energy statistic is checked against a brute-force computation of its definition;
steps are found at the right index (between revisions when grouped); noise alone
gives no change point; ``layerscope regress history`` names the first revision of a
planted step in a real SQLite store and exits 1 only for a regression.
"""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from layerscope.regressions.history import change_points, energy_statistics
from layerscope.regressions.regress_cli import main as regress_main
from layerscope.regressions.store import ResultStore, RunRecord


def brute_q(x: np.ndarray, tau: int) -> float:
    a, b = x[:tau], x[tau:]
    m, n = len(a), len(b)
    between = sum(abs(p - q) for p in a for q in b)
    wa = sum(abs(p - q) for p, q in itertools.combinations(a, 2))
    wb = sum(abs(p - q) for p, q in itertools.combinations(b, 2))
    return m * n / (m + n) * (2 * between / (m * n) - wa / (m * (m - 1) / 2) - wb / (n * (n - 1) / 2))


def test_energy_statistic_matches_its_definition():
    x = np.random.default_rng(3).normal(size=11)
    taus = np.arange(2, 10)
    np.testing.assert_allclose(energy_statistics(x, taus), [brute_q(x, t) for t in taus], rtol=1e-12)


def test_steps_found_where_they_are():
    rng = np.random.default_rng(1)
    x = np.r_[rng.normal(10.0, 0.3, 25), rng.normal(11.5, 0.3, 25), rng.normal(9.0, 0.3, 25)]
    cps = change_points(x)
    assert [c.index for c in cps] == [25, 50]
    assert all(c.pvalue <= 0.01 for c in cps)


def test_a_small_step_in_noisy_data():
    rng = np.random.default_rng(2)  # a 10% step, noise sd 3%: 30 points a side
    x = np.r_[rng.normal(1.0, 0.03, 30), rng.normal(1.1, 0.03, 30)]
    cps = change_points(x)
    # the step is found and is the strongest; this draw also has three low points at 27..29
    # that pass p <= 0.01 in the left half (multiple tests: see test_no_step_no_change_point)
    assert max(cps, key=lambda c: c.q).index == 30 and len(cps) <= 2


def test_no_step_no_change_point():
    # 20 series of pure noise (normal and heavy-tailed): at p <= 0.01 at most one false alarm in all
    false = 0
    for seed in range(20):
        rng = np.random.default_rng(100 + seed)
        noise = rng.normal(1.0, 0.05, 40) if seed % 2 else 1.0 + 0.02 * rng.standard_t(3, 40)
        false += len(change_points(noise, seed=seed))
    assert false <= 1


def test_constant_series_has_no_change_point():
    assert change_points(np.full(12, 2.5)) == []


def test_splits_only_between_groups():
    rng = np.random.default_rng(4)
    x = np.r_[rng.normal(1.0, 0.02, 13), rng.normal(1.3, 0.02, 17)]  # the step inside group 4 (points 12..14)
    groups = np.repeat(np.arange(10), 3)
    cps = change_points(x, groups)
    assert len(cps) == 1 and cps[0].index in (12, 15)
    assert [c.index for c in change_points(x)] == [13]


def test_bad_input():
    with pytest.raises(ValueError, match="NaN"):
        change_points([1.0, float("nan"), 2.0, 3.0])
    with pytest.raises(ValueError, match="group keys"):
        change_points([1.0, 2.0, 3.0, 4.0], groups=[1, 2])


# ---- over a store -------------------------------------------------------------------------
def _store(path, revs: list[tuple[str, float]], reps: int = 3, seed: int = 0) -> None:
    """One session per consecutive pair of revisions (baseline, candidate), ``reps`` runs each,
    interleaved, as ``layerscope regress`` writes them; TPOT p50 = the revision's level + noise."""
    rng = np.random.default_rng(seed)
    minute = 0
    with ResultStore(path) as db:
        for k in range(1, len(revs)):
            session = f"s{k}"
            for rep in range(1, reps + 1):
                for j, (rev, level) in enumerate((revs[k - 1], revs[k])):
                    minute += 1
                    tpot = level * (1 + rng.normal(0, 0.02))
                    db.add(RunRecord(session=session, suite="smoke", suite_digest="d",
                                     started_at=f"2026-12-01T{minute // 60:02d}:{minute % 60:02d}:00+00:00",
                                     version=rev, version_spec=rev, version_kind="git", git_rev=rev * 5,
                                     git_dirty=None, is_baseline=j == 0, workload="burst", config="default",
                                     repetition=rep, status="ok",
                                     figures={"tpot_p50_s": tpot, "output_tokens_per_s": 1000 / (tpot * 1e3)}))


def test_history_command_names_the_first_revision_of_the_step(tmp_path, capsys):
    db = tmp_path / "results.sqlite"
    revs = [("aaaaaaaa", 0.010), ("bbbbbbbb", 0.010), ("cccccccc", 0.010), ("dddddddd", 0.012),
            ("eeeeeeee", 0.012), ("ffffffff", 0.012)]
    _store(db, revs)
    rc = regress_main(["history", "smoke", "--db", str(db), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1  # a regression among the change points
    assert out["num_revisions"] == 6
    by_metric = {c["metric"]: c for c in out["change_points"]}
    assert set(by_metric) == {"tpot_p50_s", "output_tokens_per_s"}
    c = by_metric["tpot_p50_s"]
    assert c["git_rev"] == "dddddddd" * 5 and c["worse"]
    assert c["before_median"] == pytest.approx(0.010, rel=0.03) and c["after_median"] == pytest.approx(0.012, rel=0.03)
    assert 15 < c["change_pct"] < 25
    assert by_metric["output_tokens_per_s"]["worse"] and by_metric["output_tokens_per_s"]["change_pct"] < -10


def test_history_command_flat_history(tmp_path, capsys):
    db = tmp_path / "results.sqlite"
    _store(db, [(r * 8, 0.010) for r in "abcdef"], seed=1)
    assert regress_main(["history", "smoke", "--db", str(db)]) == 0
    assert "no change point" in capsys.readouterr().out


def test_history_command_errors(tmp_path, capsys):
    assert regress_main(["history", "smoke", "--db", str(tmp_path / "none.sqlite")]) == 2
    assert "no result store" in capsys.readouterr().err
    db = tmp_path / "results.sqlite"
    _store(db, [("aaaaaaaa", 0.01), ("bbbbbbbb", 0.01)])
    assert regress_main(["history", "nosuch", "--db", str(db)]) == 2
    assert "suites there: smoke" in capsys.readouterr().err
    assert regress_main(["history", "smoke", "--db", str(db), "--metric", "speed"]) == 2
    assert "unknown metric" in capsys.readouterr().err
    assert regress_main(["smoke", "extra"]) == 2


def test_history_orders_revisions_by_commit_when_they_are_commits(tmp_path):
    """Measured newest-first (as a bisect does: GOOD vs BAD before the middle), the step
    still sits at the commit that made it."""
    import subprocess

    from layerscope.regressions.history import history_series, revision_order, suite_change_points

    repo = tmp_path / "repo"
    repo.mkdir()
    shas = []
    for i in range(6):
        (repo / "f").write_text(str(i))
        subprocess.run(["git", "-C", str(repo), "init", "-q"] if i == 0 else ["true"], check=True)
        subprocess.run(["git", "-C", str(repo), "add", "f"], check=True)
        subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", str(i)],
                       check=True)
        shas.append(subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                                   check=True).stdout.strip())
    level = {s: (0.010 if i < 3 else 0.013) for i, s in enumerate(shas)}
    measured = [shas[0], shas[5], shas[2], shas[3], shas[1], shas[4]]  # not commit order
    db = tmp_path / "results.sqlite"
    rng = np.random.default_rng(5)
    with ResultStore(db) as store:
        for k, sha in enumerate(measured):
            for rep in range(4):
                store.add(RunRecord(session=f"s{k}", suite="s", suite_digest="d",
                                    started_at=f"2026-12-01T10:{k:02d}:{rep:02d}+00:00", version=sha[:12],
                                    version_spec=sha, version_kind="git", git_rev=sha, git_dirty=None,
                                    is_baseline=False, workload="w", config="c", repetition=rep + 1, status="ok",
                                    figures={"tpot_p50_s": level[sha] * (1 + rng.normal(0, 0.01))}))
        runs = store.history(suite="s")
    order = revision_order(repo, runs["git_rev"].tolist())
    assert order is not None and sorted(shas, key=order.get) == shas
    assert history_series(runs, "tpot_p50_s", order)["git_rev"].drop_duplicates().tolist() == shas
    cps = suite_change_points(runs, ["tpot_p50_s"], order=order)
    assert [c.git_rev for c in cps] == [shas[3]]
    assert revision_order(repo, [shas[0], "f" * 40]) is None  # not a commit here: measured order

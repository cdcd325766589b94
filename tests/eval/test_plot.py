from fuzzyspec.eval.plot import pareto_front, plot_curve


def test_pareto_front():
    points = [(10, 0.5), (20, 0.45), (15, 0.40), (30, 0.30), (25, 0.30), (5, 0.55)]
    assert pareto_front(points) == [5, 0, 1, 3]
    # lower is better (NLL): the fastest point with the lowest value dominates
    assert pareto_front([(10, 1.0), (20, 0.9), (30, 1.2)], higher_is_better=False) == [1, 2]


def test_plot_writes_a_png(tmp_path):
    rows = [{"rule": "ar", "draft": "ar", "divergence": None, "threshold": None, "tokens_per_s": 40.0,
             "accuracy": 0.5},
            {"rule": "sd", "draft": "default", "divergence": None, "threshold": None, "tokens_per_s": 42.0,
             "accuracy": 0.5}]
    rows += [{"rule": "fsd", "draft": "default", "divergence": "js", "threshold": t, "tokens_per_s": 40 + 50 * t,
              "accuracy": 0.5 - t / 4} for t in (0.1, 0.3, 0.5)]
    path = tmp_path / "curve.png"
    plot_curve(rows, path, "accuracy", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000

"""The accuracy-speed picture: a task's metric against tokens/s, one point per sweep row."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

LABELS = {"accuracy": "accuracy", "pass@1": "pass@1", "nll": "target NLL per token (lower is better)"}


def pareto_front(points: list[tuple[float, float]], higher_is_better: bool = True) -> list[int]:
    """Indices of the points no other point beats on both speed (x, higher is better) and quality (y),
    sorted by speed."""
    sign = 1 if higher_is_better else -1
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            ox >= x and sign * oy >= sign * y and (ox > x or sign * oy > sign * y)
            for j, (ox, oy) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def plot_curve(rows: list[dict], path: str | Path, metric: str, higher_is_better: bool = True,
               title: str = "") -> None:
    """Draw ``metric`` against tokens/s: AR and SD as reference markers, each fuzzy family as a line
    through its thresholds (labelled with T), and the Pareto front ringed and joined by a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r.get(metric) is not None]
    if not rows:
        return
    figure, axes = plt.subplots(figsize=(7.5, 5), dpi=120)
    families: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        if row["rule"] == "ar":
            axes.scatter(row["tokens_per_s"], row[metric], marker="s", s=70, color="black", zorder=3, label="AR")
        elif row["rule"] == "sd":
            axes.scatter(row["tokens_per_s"], row[metric], marker="D", s=60, zorder=3,
                         label=f"SD ({row['draft']})")
        else:
            families[f"{row['rule'].upper()} {row['divergence']} ({row['draft']})"].append(row)
    for name, members in families.items():
        members.sort(key=lambda r: r["threshold"])
        line, = axes.plot([r["tokens_per_s"] for r in members], [r[metric] for r in members], marker="o",
                          zorder=2, label=name)
        for r in members:
            axes.annotate(f"T={r['threshold']:.3g}", (r["tokens_per_s"], r[metric]), textcoords="offset points",
                          xytext=(4, 4), fontsize=7, color=line.get_color())
    points = [(r["tokens_per_s"], r[metric]) for r in rows]
    front = [points[i] for i in pareto_front(points, higher_is_better)]
    if len(front) > 1:
        axes.plot([x for x, _ in front], [y for _, y in front], linestyle="--", color="gray", linewidth=1,
                  zorder=1, label="Pareto front")
    axes.scatter([x for x, _ in front], [y for _, y in front], s=160, facecolors="none", edgecolors="gray",
                 zorder=1)
    axes.set_xlabel("tokens/s")
    axes.set_ylabel(LABELS.get(metric, metric))
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, loc="best")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)

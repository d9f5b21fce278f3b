"""The README's figure: decode tokens/s of a whole paged model against the batch size, from the side-by-side engine
runs recorded in bench/RESULTS.md (their figures in ``bench/data/readme_decode.json``).

    python -m bench.readme_plot            # writes bench/plots/readme_decode.png
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "readme_decode.json"
OUT = HERE / "plots" / "readme_decode.png"


def draw(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = data["batches"]
    panels = data["panels"]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 3.6), sharey=True)
    for ax, panel in zip(axes, panels.values()):
        runs = panel["runs"]
        width = 0.8 / len(runs)
        for i, (name, values) in enumerate(runs.items()):
            xs = [b + (i - (len(runs) - 1) / 2) * width for b in range(len(batches))]
            ax.bar(xs, values, width, label=name)
        ax.set_yscale("log")
        ax.set_xticks(range(len(batches)), [str(b) for b in batches])
        ax.set_xlabel("requests decoding together")
        ax.set_title(panel["title"], fontsize=10)
        ax.legend(fontsize=7, loc="upper left")
    axes[0].set_ylabel("decode tokens/s (log scale)")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> None:
    draw(json.loads(DATA.read_text()), OUT)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()

"""The benchmark as a picture: decode ms/step per row and engine (floor marked), end-to-end images/s."""

from __future__ import annotations

import math


def draw(decode: list, end_to_end: list | None, path: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..files import save_figure

    rows = list(dict.fromkeys(m.row for m in decode))
    floors = {"floor probe": ("fp32 weights read once", "dashed"),
              "int8 floor probe": ("int8 weights read once", "dotted")}
    engines = [e for e in dict.fromkeys(m.engine for m in decode) if e not in floors]
    value = {(m.row, m.engine): m.ms_per_step for m in decode if not m.error}
    panels = 2 if end_to_end else 1
    fig, axes = plt.subplots(1, panels, figsize=(7 * panels + 3, 5), squeeze=False,
                             gridspec_kw={"width_ratios": [2, 1][:panels]})
    ax = axes[0][0]
    width = 0.8 / len(engines)
    colors = plt.get_cmap("tab20" if len(engines) > 10 else "tab10")
    for i, engine in enumerate(engines):
        heights = [value.get((row, engine), math.nan) for row in rows]
        xs = [r + (i - (len(engines) - 1) / 2) * width for r in range(len(rows))]
        ax.bar(xs, heights, width, label=engine, color=colors(i % colors.N))
    for name, (what, style) in floors.items():
        for r, row in enumerate(rows):
            floor = value.get((row, name))
            if floor:
                ax.hlines(floor, r - 0.45, r + 0.45, colors="black", linestyles=style,
                          label=f"{name} ({what})" if r == 0 else None)
    ax.set_xticks(range(len(rows)), rows)
    ax.set_ylabel("ms per decode step (lower is better)")
    ax.set_yscale("log")
    ax.set_title("Decode step, ViT-B/16 + GPT-2 small")
    ax.legend(fontsize=7, ncol=2)
    if end_to_end:
        ax = axes[0][1]
        names = [r.engine for r in end_to_end]
        ax.barh(range(len(names)), [r.images_per_s for r in end_to_end], color=colors(0))
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("images/s (higher is better)")
        ax.set_title(f"Captioning {end_to_end[0].images} images end to end")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
    plt.close(fig)

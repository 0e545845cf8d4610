"""`hicache sweep`'s plot (matplotlib): hit rate per tier against the L1 size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hicache.cli.sweep.grid import fmt_tokens

__all__ = ["plot"]


def plot(rows: list[dict[str, Any]], path: Path, *, title: str, by_ratio: bool = True) -> None:
    """Stacked L1/L2/L3 hit rates against the L1 size: one panel per (L2 size, L3); L2 sizes
    are multiples of L1 (`by_ratio`) or token counts."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    def host_key(row: dict[str, Any]) -> tuple[str, float]:
        if by_ratio:
            return ("x", round(row["host_tokens"] / row["device_tokens"], 2))
        return ("abs", row["host_tokens"])

    hosts = sorted({host_key(r) for r in rows}, key=lambda k: k[1])
    stores = list(dict.fromkeys(r["storage"] for r in rows))  # as the grid gave them
    bound = rows[0]["bound_hit_rate"]
    fig, axes = plt.subplots(
        len(stores),
        len(hosts),
        squeeze=False,
        sharex=True,
        sharey=True,
        figsize=(4.2 * len(hosts) + 0.8, 3.4 * len(stores) + 0.9),
    )
    colors = {"device": "#1f77b4", "host": "#ff7f0e", "storage": "#2ca02c"}
    labels = {
        "device": "from L1 (device)",
        "host": "from L2 (host)",
        "storage": "from L3 (storage)",
    }
    xs_all = sorted({r["device_tokens"] for r in rows})
    for i, store in enumerate(stores):
        for j, hk in enumerate(hosts):
            ax = axes[i][j]
            pts = sorted(
                (r for r in rows if r["storage"] == store and host_key(r) == hk),
                key=lambda r: r["device_tokens"],
            )
            if not pts:
                ax.set_visible(False)
                continue
            x = [r["device_tokens"] for r in pts]
            layers = [[r[f"{t}_hit_rate"] for r in pts] for t in ("device", "host", "storage")]
            ax.stackplot(
                x,
                *layers,
                colors=[colors[t] for t in colors],
                labels=[labels[t] for t in labels],
                alpha=0.75,
            )
            ax.plot(x, [r["hit_rate"] for r in pts], "k.-", lw=1, label="total hit rate")
            ax.axhline(
                bound, color="k", ls="--", lw=1, label=f"bound (unlimited capacity) {bound:.3f}"
            )
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(FixedLocator(xs_all))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: fmt_tokens(v)))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.tick_params(axis="x", labelrotation=45)
            ax.set_ylim(0, max(1.05 * bound, 0.05))
            ax.grid(True, alpha=0.3)
            l2 = f"L2 = {hk[1]:g} x L1" if hk[0] == "x" else f"L2 = {fmt_tokens(hk[1])} tokens"
            l3 = {"inf": "L3 unbounded", "0": "no L3"}.get(store, f"L3 capped at {store}")
            if pts[0].get("store_policy"):
                l3 += f" ({pts[0]['store_policy']})"
            ax.set_title(f"{l2}, {l3}", fontsize=10)
            if i == len(stores) - 1:
                ax.set_xlabel("L1 (device) capacity, tokens")
            if j == 0:
                ax.set_ylabel("token hit rate")
    handles, names = next(
        ax for row in axes for ax in row if ax.get_visible()
    ).get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=5, fontsize=9, frameon=False)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)

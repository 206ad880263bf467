"""Render each rank's attention mask as dtcp's schedule computes it, coloured by block pattern.

    python docs/render_masks.py                       # writes docs/images/window_masks.png (needs matplotlib)
    python docs/render_masks.py --ascii               # prints the same pictures as text

Rows: the rank's queries; columns: all keys of the sequence (global positions). Each visible
(query, key) pair is drawn in the colour of the kernel call that computes it; blank pairs are
never computed. The pictures come from `dtcp.plan.ring_plans`, the plans the ring runs.
"""

from __future__ import annotations

import argparse
import os

import dtcp
from dtcp.plan import AttnMask, ring_plans, segments_from_cu_seqlens

PATTERNS = ["diagonal (local window)", "full", "window edge (lower-left masked)", "upper-right only", "document piece"]
CHARS = {None: ".", 0: "D", 1: "F", 2: "E", 3: "U", 4: "d"}


def classify(step, task, local_len, rank, docs):
    if docs:
        return 4 if step.src != rank else 0
    if step.src == rank:
        return 0
    if task.is_full:
        return 1
    if task.q_len == local_len and task.k_len == local_len:
        return 2
    return 3


def grids(world_size, local_len, window, cu=None):
    """Per rank: a (local_len x seq_len) grid of pattern ids (None = not computed)."""
    seq_len = world_size * local_len
    segments = segments_from_cu_seqlens(tuple(cu), seq_len) if cu else None
    layout = dtcp.Contiguous()
    plans = ring_plans(layout, local_len, world_size, True, AttnMask.make(True, window, segments))
    out = []
    for rank, plan in enumerate(plans):
        g = [[None] * seq_len for _ in range(local_len)]
        for step in plan.steps:
            k0 = step.src * local_len
            for t in step.tasks:
                kind = classify(step, t, local_len, rank, segments is not None)
                for i in range(t.q_len):
                    for j in range(t.k_len):
                        if t.visible(i, j):
                            g[t.q_start + i][k0 + t.k_start + j] = kind
        out.append((rank, plan.num_rounds, g))
    return out


CASES = [
    ("contiguous, N=5, M=8, causal window 20: C = ceil(20/8) = 3 rounds", 5, 8, (20, 0), None),
    ("causal window 10, documents [0, 5, 19, 20, 40]", 5, 8, (10, 0), [0, 5, 19, 20, 40]),
]


def ascii_art():
    for title, n, m, window, cu in CASES:
        print(title)
        for rank, rounds, g in grids(n, m, window, cu):
            print(f"rank {rank} ({rounds} rounds)")
            for row in g:
                line = "".join(CHARS[c] for c in row)
                print("  " + " ".join(line[i:i + m] for i in range(0, len(line), m)))
        print()
    print("D diagonal (local window)  F full  E window edge (lower-left masked)  U upper-right only  d document piece")


def png(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    colours = ["#1f77b4", "#2ca02c", "#ff7f0e", "#d62728", "#9467bd"]
    cmap = ListedColormap(["#ffffff"] + colours)
    fig, axes = plt.subplots(len(CASES), max(c[1] for c in CASES), figsize=(17, 1.7 * len(CASES) + 0.9), squeeze=False)
    for row, (title, n, m, window, cu) in enumerate(CASES):
        for rank, rounds, g in grids(n, m, window, cu):
            ax = axes[row][rank]
            ax.imshow([[0 if c is None else c + 1 for c in r] for r in g], cmap=cmap, vmin=0, vmax=len(colours),
                      interpolation="nearest", aspect="equal")
            for b in range(1, n):
                ax.axvline(b * m - 0.5, color="black", lw=0.6)
            ax.set_title(f"rank {rank}: {rounds} round(s)", fontsize=9)
            ax.set_xticks([b * m for b in range(n)])
            ax.set_yticks([])
        axes[row][0].set_ylabel("window %d%s" % (window[0], " + docs" if cu else ""), fontsize=8)
    fig.legend(handles=[Patch(color=c, label=l) for c, l in zip(colours, PATTERNS)], loc="lower center", ncol=5, fontsize=8)
    fig.suptitle("queries of each rank (rows) x all keys (columns); colour = kernel call that computes the pair", fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--ascii", action="store_true")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "images", "window_masks.png"))
    a = p.parse_args()
    ascii_art() if a.ascii else png(a.out)

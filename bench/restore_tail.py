"""The distribution of many restores (issue 35): every phase of every restore, p50 / p90 / p99 / max, and a plot.

    python bench/restore_tail.py RESTORES.json [--png FILE.png] [--out FILE.json]

RESTORES.json is what `bench/e2e_serve.py` leaves after each restore (`restores-<mode>.json`: the cold run, the
capture's phases and event loops, and each restore's row) or its `serve.json`. Every number a restore row holds in
seconds (`*_s`: Docker-to-first-token, create/start, worker start, CRIU, CUDA, hydration, port accepted,
request-to-first-token, completion) is summarised over the restores; the table is Markdown (bench/README.md).
With `--png`, one picture (matplotlib, installed where the plot is drawn): the cumulative distribution of
Docker-to-first-token beside each phase's spread, restore by restore.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._common import percentile, table

HEADLINE = "first_token_s"  # Docker-to-first-token


def restores_of(document: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """(the path's mode, its restore rows) from a `restores-<mode>.json` or the first path of a `serve.json`."""
    if "restores" in document:
        return str(document.get("mode", "?")), list(document["restores"])
    first = document["results"][0]
    return str(first["mode"]), list(first["restores"])


def phases(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Each `*_s` number every row has, in the rows' first order of keys, Docker-to-first-token first."""
    keys = [k for k, v in rows[0].items() if k.endswith("_s") and isinstance(v, (int, float))] if rows else []
    keys = [HEADLINE, *(k for k in keys if k != HEADLINE)] if HEADLINE in keys else keys
    return {k: [float(r[k]) for r in rows if isinstance(r.get(k), (int, float))] for k in keys}


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    found = []
    for name, values in phases(rows).items():
        if values:
            found.append({"phase": name, "n": len(values), "p50": percentile(values, 50),
                          "p90": percentile(values, 90), "p99": percentile(values, 99), "max": max(values),
                          "mean": statistics.fmean(values)})
    return found


def plot(mode: str, rows: list[dict[str, Any]], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spread = phases(rows)
    figure, (cdf, phase) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [1, 1.6]})
    firsts = sorted(spread.get(HEADLINE, []))
    cdf.step(firsts, [(i + 1) / len(firsts) for i in range(len(firsts))], where="post")
    for q in (50, 99):
        cdf.axvline(percentile(firsts, q), linestyle=":", color="grey")
        cdf.annotate(f"p{q} {percentile(firsts, q):.2f} s", (percentile(firsts, q), 0.05 if q == 50 else 0.15),
                     xytext=(4, 0), textcoords="offset points")
    cdf.set(title=f"{mode}: Docker-to-first-token, {len(firsts)} restores", xlabel="seconds",
            ylabel="fraction of restores")
    names = [k for k in spread if k != HEADLINE and spread[k]]
    phase.boxplot([spread[k] for k in names], orientation="horizontal", whis=(0, 100))
    phase.set_yticks(range(1, len(names) + 1), [k.removesuffix("_s").replace("_", " ") for k in names])
    phase.set(title="each phase (whiskers: min and max)", xlabel="seconds")
    figure.tight_layout()
    figure.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("restores", type=Path)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    document = json.loads(args.restores.read_text())
    mode, rows = restores_of(document)
    found = summary(rows)
    # e2e_serve.py's rows compare the completion, e2e_modes.py's the tokens and first-step logits
    identical = sum(bool(r.get("identical") or (r.get("identical_tokens") and r.get("identical_first_logits")))
                    for r in rows)
    print(f"{mode}: {len(rows)} restores, {identical} completions identical to the cold one")
    print(table(["phase (s)", "n", "p50", "p90", "p99", "max", "mean"],
                [[f["phase"], f["n"], *(f"{f[k]:.3f}" for k in ("p50", "p90", "p99", "max", "mean"))]
                 for f in found]))
    if args.out:
        args.out.write_text(json.dumps({"mode": mode, "restores": len(rows), "identical": identical,
                                        "summary": found}, indent=1) + "\n")
    if args.png:
        plot(mode, rows, args.png)


if __name__ == "__main__":
    main()

"""`--report DIR` of `specrt bench` and `specrt tune`: the measurements as pictures.

One folder: `index.html` (images embedded, readable offline), the PNGs beside it and `report.json`, the
numbers every picture is drawn from. What decides whether speculation pays on a machine is drawn next to
what the drafts achieved: the cost of a target pass by width (`cost curve`), and from it, with the same
cost model `draft_len="auto"` plans with (policy.Controller), the tokens a round of k drafts must emit to
beat plain decoding (`break-even`).
"""
from __future__ import annotations

import base64
import html
import json
import os
import platform
import shlex
import statistics
import time
from pathlib import Path

import numpy as np

from specrt import __version__
from specrt.decoding.policy import Controller, CostModel
from specrt.errors import ConfigError

FILES = ("index.html", "report.json", "speed.png", "acceptance.png", "costs.png", "prompts.png", "batch.png")
LOOKUP = ("ngram", "suffix")  # drafters whose proposals cost no model pass


def require(out: Path) -> None:
    """Fail before any measuring: matplotlib missing, or `out` not a folder that can be written."""
    try:
        import matplotlib  # noqa: F401  (optional: the `plots` extra)
    except ImportError:
        raise ConfigError("--report needs matplotlib: pip install 'specrt[plots]'") from None
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--report {out}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--report {out}: cannot create the folder ({e.strerror})") from None
    if not os.access(out, os.W_OK):
        raise ConfigError(f"--report {out}: the folder is not writable")


def header(pair, command: list[str]) -> dict:
    """Where and on what the numbers were measured."""
    m = pair.manifest
    kernel = getattr(pair.target, "kernel", None)
    return {
        "machine": _cpu(), "platform": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cpus",
        "pair": str(pair.dir), "target": m.target.source, "draft": m.draft.source if m.draft is not None else None,
        "precision": m.target.precision, "device": pair.device,
        "kernel": kernel.describe() if kernel is not None else f"onnxruntime ({pair.device})",
        "command": shlex.join(command),
        "date": time.strftime("%Y-%m-%d %H:%M"), "specrt": __version__,
    }


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model", "Hardware")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def break_even(costs: dict, max_k: int) -> list[dict]:
    """Per draft length k: the tokens a round must emit to match plain decoding's tokens per second
    (`tokens`: its predicted cost over a one-token pass's), and the per-token acceptance that gets there
    when every draft is accepted with the same chance given the ones before it (`acceptance`), for a
    model draft (its passes counted) and a lookup draft (free). None where k drafts cannot pay."""
    model = CostModel(draft_s=costs.get("draft_s"), target_s=dict(costs["target_s"]))
    c1 = model.target(1)
    out = []
    for k in range(1, max_k + 1):
        row = {"k": k}
        for kind, free in (("model", False), ("lookup", True)):
            if not free and model.draft_s is None:
                row[kind] = None
                continue
            ctl = Controller(k, model, free_draft=free)
            need = ctl.cost(k) / c1
            row[kind] = {"tokens": need, "acceptance": _solve(lambda a: _emitted(k, a), need)}
        out.append(row)
    return out


def _emitted(k: int, a: float) -> float:
    return sum(a ** i for i in range(k + 1))


def _solve(f, target: float) -> float | None:
    """The a in [0, 1] with f(a) = target for an increasing f (bisection); None above f(1)."""
    if f(1.0) < target:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return hi


def per_prompt(bench: dict) -> dict:
    """Per setting label: [{prompt, class, speedup}], each the median over repeats of the prompt's tokens/s
    against target-only's on the same prompt in the same repeat."""
    base = next((r for r in bench["rows"] if r["draft_len"] == 0), None)
    if base is None:
        return {}
    rate = {(x["repeat"], x["prompt"]): x["new_tokens"] / x["wall_s"] for x in base["runs"] if x["wall_s"] > 0}
    out = {}
    for row in bench["rows"]:
        if row is base:
            continue
        ratios, kinds = {}, {}
        for x in row["runs"]:
            b = rate.get((x["repeat"], x["prompt"]))
            if b and x["wall_s"] > 0:
                ratios.setdefault(x["prompt"], []).append(x["new_tokens"] / x["wall_s"] / b)
                kinds[x["prompt"]] = x["class"]
        out[label(row)] = [{"prompt": p, "class": kinds[p], "speedup": statistics.median(v)} for p, v in ratios.items()]
    return out


def label(row: dict) -> str:
    if row["draft_len"] == 0:
        return "target only"
    stop = f" stop {row['confidence_stop']:g}" if row.get("confidence_stop") else ""
    return f"{row['drafter']} {row['draft_len']}{stop}"


def write_report(out: Path, head: dict, costs: dict, max_k: int, bench: dict | None = None,
                 batch: dict | None = None, chosen: str | None = None) -> Path:
    """Draw the pictures and write `out`/index.html, the PNGs and report.json; returns index.html's path."""
    costs = {**costs, **{key: {int(w): s for w, s in costs[key].items()} for key in ("target_s", "batch_s") if costs.get(key)}}
    data = {"header": head, "costs": costs, "break_even": break_even(costs, max_k), "bench": bench, "batch": batch,
            "per_prompt": per_prompt(bench) if bench else {}, "chosen": chosen}
    for name in FILES:  # an earlier report's pictures must not pass for this one's
        (out / name).unlink(missing_ok=True)
    figures = []
    if bench:
        figures += [("speed.png", _speed(bench), "Tokens per second per setting"),
                    ("acceptance.png", _acceptance(bench, data["break_even"]), "Acceptance per draft position")]
    figures.append(("costs.png", _costs(costs, data["break_even"], bench, max_k), "This machine's cost curve"))
    if data["per_prompt"]:
        figures.append(("prompts.png", _prompts(data["per_prompt"]), "Speedup per prompt"))
    if batch:
        figures.append(("batch.png", _batch(batch), "Throughput by batch size"))
    for name, fig, _ in figures:
        fig.savefig(out / name, dpi=110)
    import matplotlib.pyplot as plt  # optional: the `plots` extra

    plt.close("all")
    (out / "report.json").write_text(json.dumps(data, indent=1))
    page = out / "index.html"
    page.write_text(_html(data, [(name, title) for name, _, title in figures], out))
    return page


def _pyplot():
    import matplotlib  # optional: the `plots` extra

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _speed(bench: dict):
    plt = _pyplot()
    rows = bench["rows"]
    classes = list(rows[0]["tokens_per_s_by_class"])
    with_classes = len(classes) > 1 and rows[0].get("speedup_by_class")
    fig, axes = plt.subplots(1, 2 if with_classes else 1, figsize=(12 if with_classes else 7, 0.45 * len(rows) + 1.6),
                             squeeze=False, gridspec_kw={"width_ratios": [3, 2]} if with_classes else None)
    ax = axes[0][0]
    names = [label(r) for r in rows]
    best = max(rows, key=lambda r: r["tokens_per_s"])
    colors = ["#999999" if r["draft_len"] == 0 else ("#d62728" if r is best else "#1f77b4") for r in rows]
    ax.barh(names, [r["tokens_per_s"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        if r["speedup"] is not None:
            ax.text(r["tokens_per_s"], i, f" {r['speedup']:.2f}x", va="center", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (median over repeats); label: speedup over target-only in the same repeat")
    ax.margins(x=0.15)
    ax.set_title(f"fastest: {label(best)}" + (" (red)" if best["draft_len"] != 0 else ""))
    if with_classes:
        ax = axes[0][1]
        grid = np.array([[r["speedup_by_class"][c] for c in classes] for r in rows])
        span = max(abs(grid - 1).max(), 0.05)
        ax.imshow(grid, cmap="RdBu", vmin=1 - span, vmax=1 + span, aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8,
                    color="white" if abs(v - 1) > 0.6 * span else "black")
        ax.set_xticks(range(len(classes)), classes)
        ax.set_yticks(range(len(rows)), names)
        ax.set_title("speedup by prompt class (blue: faster)")
    fig.tight_layout()
    return fig


def _acceptance(bench: dict, even: list[dict]):
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator  # optional: the `plots` extra

    drafters = [d for d in dict.fromkeys(r["drafter"] for r in bench["rows"] if r["draft_len"] != 0)]
    fig, axes = plt.subplots(1, max(len(drafters), 1), figsize=(4.5 * max(len(drafters), 1), 3.6), squeeze=False)
    cmap = plt.get_cmap("viridis")
    for ax, d in zip(axes[0], drafters):
        rows = [r for r in bench["rows"] if r["drafter"] == d and r["draft_len"] != 0 and r["accepted_per_position"]]
        kind = "lookup" if d in LOOKUP else "model"
        unpaid = []
        for i, r in enumerate(rows):
            color = cmap(i / max(len(rows) - 1, 1))
            pos = r["accepted_per_position"]
            ax.plot(range(1, len(pos) + 1), pos, "o-", color=color, label=label(r))
            k = r["draft_len"]
            be = even[k - 1][kind] if isinstance(k, int) and k <= len(even) else None
            if be and be["acceptance"] is not None:  # a uniform acceptance at exactly break-even
                ax.plot(range(1, k + 1), [be["acceptance"] ** (j + 1) for j in range(k)], "_--", ms=14, color=color,
                        alpha=0.7)
            elif be:
                unpaid.append(str(k))
        if unpaid:
            ax.text(0.02, 0.04, f"k = {', '.join(unpaid)}: no acceptance pays here", transform=ax.transAxes, fontsize=8)
        ax.set_ylim(0, 1.02)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("draft position")
        ax.set_title(d)
        ax.grid(alpha=0.3)
        if rows:
            ax.legend(fontsize=8)
    axes[0][0].set_ylabel("share of drafted tokens accepted")
    fig.suptitle("solid: measured; dashed: the break-even of the same length (above it, drafting pays)", fontsize=9)
    fig.tight_layout()
    return fig


def _costs(costs: dict, even: list[dict], bench: dict | None, max_k: int):
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    widths = sorted(int(w) for w in costs["target_s"])
    ms = [costs["target_s"][w] * 1000 for w in widths]
    a.plot(widths, ms, "o-", label="target pass, one sequence of W tokens")
    for w, v in zip(widths, ms):
        a.annotate(f"{v / ms[0]:.2f}x", (w, v), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    if costs.get("batch_s"):
        sizes = sorted(int(s) for s in costs["batch_s"])
        a.plot(sizes, [costs["batch_s"][s] * 1000 for s in sizes], "s--", label="target pass, W rows of one token")
    if costs.get("draft_s"):
        a.axhline(costs["draft_s"] * 1000, color="gray", ls=":", label="draft pass, one token")
    a.set_xlabel(f"tokens in the pass (W), after {costs['past']} tokens" if costs.get("past") else "tokens in the pass (W)")
    a.set_ylabel("ms (median)")
    a.set_ylim(bottom=0)
    a.set_title("what a wider pass costs on this machine")
    a.legend(fontsize=8)
    a.grid(alpha=0.3)
    ks = [e["k"] for e in even]
    for kind, style in (("model", "o-"), ("lookup", "s-")):
        if even and even[0][kind]:
            b.plot(ks, [e[kind]["tokens"] for e in even], style, label=f"break-even, {kind} draft")
    b.axhline(1, color="gray", lw=0.8)
    for r in (bench or {}).get("rows", []):
        if isinstance(r["draft_len"], int) and r["draft_len"] > 0:
            b.plot(r["draft_len"], r["tokens_per_round"], "x", ms=9,
                   color="black" if r["drafter"] == "model" else "#d62728")
    b.plot([], [], "x", color="black", label="measured: model")
    b.plot([], [], "x", color="#d62728", label="measured: lookup / hybrid")
    b.set_xlabel("draft length k")
    b.set_ylabel("tokens per round (target pass)")
    b.set_xticks(range(1, max_k + 1))
    b.set_title("a k-draft round pays above its break-even")
    b.legend(fontsize=8)
    b.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _prompts(points: dict):
    plt = _pyplot()

    names = list(points)
    classes = sorted({p["class"] for v in points.values() for p in v})
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names) + 2), 4))
    rng = np.random.default_rng(0)  # jitter only: the dots of one setting side by side
    for ci, c in enumerate(classes):
        xs, ys = [], []
        for i, n in enumerate(names):
            v = [p["speedup"] for p in points[n] if p["class"] == c]
            xs += list(i + (ci - (len(classes) - 1) / 2) * 0.15 + rng.uniform(-0.05, 0.05, len(v)))
            ys += v
        ax.scatter(xs, ys, s=18, label=c, alpha=0.8)
    ax.axhline(1, color="gray", lw=0.8)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
    ax.set_ylabel("speedup over target-only (per prompt)")
    ax.set_title("one dot per prompt: where a setting wins and where it loses")
    ax.legend(fontsize=8, title="class")
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    return fig


def _batch(batch: dict):
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for k, tree in dict.fromkeys((r["draft_len"], r.get("tree", "off")) for r in batch["rows"]):
        rows = sorted((r for r in batch["rows"] if (r["draft_len"], r.get("tree", "off")) == (k, tree)),
                      key=lambda r: r["batch_size"])
        ax.plot([r["batch_size"] for r in rows], [r["tokens_per_s"] for r in rows], "o-",
                label="target only" if k == 0 else f"{batch['drafter']} {k}" + (", trees" if tree == "auto" else ""))
        for r in rows:
            if r["speedup"] is not None:
                ax.annotate(f"{r['speedup']:.2f}x", (r["batch_size"], r["tokens_per_s"]), textcoords="offset points",
                            xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("batch size")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_xticks(batch["batch_sizes"])
    ax.set_ylim(bottom=0)
    ax.set_title("throughput by batch size (label: over batch 1 target-only)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _html(data: dict, figures: list[tuple[str, str]], out: Path) -> str:
    esc = html.escape
    h = data["header"]
    rows = "".join(f"<tr><th>{esc(k)}</th><td>{esc(str(v))}</td></tr>" for k, v in h.items() if v is not None)
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'><title>specrt report: {esc(Path(h['pair']).name)}</title>",
             "<style>body{font-family:sans-serif;max-width:1250px;margin:1em auto;padding:0 1em;color:#222}"
             "table{border-collapse:collapse;font-size:14px}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}"
             "img{max-width:100%;border:1px solid #eee}p.how{color:#444;max-width:900px}</style></head><body>",
             "<h1>specrt report</h1>", f"<table>{rows}</table>", _verdict(data)]
    how = {
        "speed.png": "Each bar is one setting's tokens per second over all prompts; its label, the speedup over target-only "
                     "measured in the same repeat. The grid splits the speedup by prompt class.",
        "acceptance.png": "How often a drafted token at each position is accepted. A dashed line is what a draft of the "
                          "same length must reach on this machine to break even, from the cost curve below: where the "
                          "solid line stays above its dashed line, that length pays.",
        "costs.png": "Left: what a target pass costs as it gets wider (label: against one token). The flatter this curve, "
                     "the longer a draft can be. Right: the tokens a round of k drafts must emit per target pass to match "
                     "plain decoding (the cost model draft_len auto plans with); a cross above its line wins.",
        "prompts.png": "Each dot is one prompt's speedup (median over repeats); below 1, drafting slowed that prompt down.",
        "batch.png": "Aggregate tokens per second of a whole job by batch size (every prompt decoded, slots refilled).",
    }
    for name, title in figures:
        png = base64.b64encode((out / name).read_bytes()).decode()
        parts.append(f"<h2>{esc(title)}</h2><p class='how'>{esc(how[name])}</p>"
                     f"<img src='data:image/png;base64,{png}' alt='{esc(title)}'><p><a href='{name}'>{name}</a></p>")
    parts.append(_tables(data))
    parts.append("<p>The numbers behind every picture: <a href='report.json'>report.json</a>.</p></body></html>")
    return "\n".join(parts)


def _verdict(data: dict) -> str:
    esc = html.escape
    lines = []
    if data["bench"]:
        rows = data["bench"]["rows"]
        best = max(rows, key=lambda r: r["tokens_per_s"])
        sp = f", {best['speedup']:.2f}x target-only" if best.get("speedup") else ""
        lines.append(f"Fastest here: <b>{esc(label(best))}</b> at {best['tokens_per_s']:.1f} tokens/s{sp}.")
        for d in dict.fromkeys(r["drafter"] for r in rows if r["draft_len"] != 0):
            mine = max((r for r in rows if r["drafter"] == d and r["draft_len"] != 0), key=lambda r: r["tokens_per_s"])
            if mine.get("speedup") is not None:
                lines.append(f"Best of {esc(d)}: {esc(label(mine))}, {mine['speedup']:.2f}x.")
    if data["batch"]:
        b = data["batch"]
        lines.append(f"Batched: fastest at batch size {b['best_batch_size']}, draft length {b['best_draft_len']}.")
    if data["chosen"]:
        lines.append(f"Stored by tune: {esc(data['chosen'])}.")
    t = data["costs"]["target_s"]
    widths = sorted(int(w) for w in t)
    if len(widths) > 1:
        w = widths[-1]
        lines.append(f"A {w}-token target pass costs {t[w] / t[1]:.2f}x a one-token pass on this machine.")
    return "<p>" + "<br>".join(lines) + "</p>"


def _tables(data: dict) -> str:
    out = ["<h2>Break-even by draft length</h2><table><tr><th>k</th><th>model draft: tokens per pass</th>"
           "<th>acceptance</th><th>lookup draft: tokens per pass</th><th>acceptance</th></tr>"]
    for e in data["break_even"]:
        cells = []
        for kind in ("model", "lookup"):
            v = e[kind]
            cells += (["-", "-"] if v is None else
                      [f"{v['tokens']:.2f}", "cannot pay" if v["acceptance"] is None else f"{v['acceptance']:.2f}"])
        out.append(f"<tr><td>{e['k']}</td>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out.append("</table>")
    if data["bench"]:
        out.append("<h2>Settings</h2><table><tr><th>setting</th><th>tokens/s</th><th>speedup</th><th>accepted</th>"
                   "<th>tokens per round</th><th>TTFT ms</th><th>ITL ms</th></tr>")
        for r in data["bench"]["rows"]:
            sp = f"{r['speedup']:.2f}x" if r["speedup"] is not None else "-"
            out.append(f"<tr><td>{html.escape(label(r))}</td><td>{r['tokens_per_s']:.2f}</td><td>{sp}</td>"
                       f"<td>{r['acceptance_rate']:.0%}</td><td>{r['tokens_per_round']:.2f}</td>"
                       f"<td>{r['ttft_ms']:.1f}</td><td>{r['itl_ms']:.1f}</td></tr>")
        out.append("</table>")
    return "\n".join(out)

"""`specrt check`: is a pair lossless on this machine (apps/check.py)."""
from __future__ import annotations

import json
from pathlib import Path

import click

from specrt.cli.common import device_option, draft_len_value, errors, load_pair
from specrt.config import TREES


@click.command()
@click.argument("pair_dir", type=click.Path(path_type=Path))
@click.option("--prompts", type=click.Path(path_type=Path), default=None,
              help="JSONL prompts in the bench format (default: a few built-in short prompts).")
@click.option("--max-new-tokens", type=int, default=48, show_default=True, help="Tokens per greedy comparison.")
@click.option("--draft-len", default="4", show_default=True, callback=draft_len_value,
              help="Draft length of the speculative run, or 'auto' (the policy chooses; with --tree auto its rounds "
                   "may verify trees).")
@click.option("--tree", type=click.Choice(TREES), default="auto", show_default=True,
              help="auto: speculative rounds at draft length auto may verify trees where the target takes them; off: chains.")
@click.option("--samples", type=int, default=400, show_default=True,
              help="Sampled generations for the statistical test (0 = skip it).")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
@device_option
@errors
def check(pair_dir, device, prompts, max_new_tokens, draft_len, tree, samples, limit, as_json):
    """Check losslessness on this machine: speculative == target-only, greedy and sampled, and a sampling test.

    Per prompt, speculative and target-only decoding run side by side, greedy and sampled with coupling
    (where a seed's sample is the target-only one token for token); where they differ, the target's logit
    margin between the two tokens says whether numerics explain it (a near-tie) or not (BUG). Then the second token of SAMPLES speculative samples (temperature 1)
    is tested against its exact distribution under the target (chi-square, fails below p = 1e-4).
    Exit code 1 if anything failed, 0 if all is well, 2 on bad input.
    """
    from specrt.errors import ConfigError
    from specrt.apps import check as chk
    from specrt.apps.bench import read_prompts

    if draft_len != "auto" and draft_len < 1:
        raise ConfigError(f"--draft-len must be >= 1 (0 would compare target-only with itself), got {draft_len}")
    if samples < 0:
        raise ConfigError(f"--samples must be >= 0, got {samples}")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be >= 1, got {limit}")
    with load_pair(pair_dir, device) as pair:
        plist = read_prompts(prompts, pair, limit) if prompts is not None else chk.builtin_prompts(pair, limit)
        res = chk.check_pair(pair, plist, max_new_tokens, draft_len, samples,
                             on_event=None if as_json else lambda kind, d: click.echo(_line(kind, d)), tree=tree)
    out = {"pair": str(pair_dir), **res}
    if as_json:
        click.echo(json.dumps(out, indent=2))
    else:
        bugs = sum(r["verdict"] == "BUG" or r["sampled"]["verdict"] == "BUG" for r in out["prompts"])
        sampling_failed = out["sampling"] is not None and not out["sampling"]["ok"]
        problems = ([f"{bugs} prompt(s) differ beyond numerical noise"] if bugs else []) + (
            ["the sampling test failed"] if sampling_failed else [])
        click.echo("check passed" if out["ok"] else "check FAILED: " + "; ".join(problems))
    if not out["ok"]:
        raise SystemExit(1)


def _verdict(d: dict) -> str:
    if d["verdict"] == "equal":
        return f"equal ({d['tokens']} tokens)"
    margin = "unknown" if d["margin"] is None else f"{d['margin']:.3g}"
    return f"differs at token {d['index']}, target logit margin {margin}: {d['verdict']}"


def _line(kind: str, d: dict) -> str:
    """One line of the text report per check_pair event."""
    from specrt.apps.check import P_MIN

    if kind == "start":
        s = d["sampled_with"]
        return (f"speculative (drafter {d['drafter']}, draft_len {d['draft_len']}, tree {d['tree']}) vs target-only, {d['max_new_tokens']} "
                f"tokens, greedy and sampled with coupling (temperature {s['temperature']}, top_p {s['top_p']}, seed = "
                f"the prompt's place); near-tie threshold {d['threshold']} ({d['numerics']})")
    if kind == "prompt":
        trees = d["tree_rounds"] + d["sampled"]["tree_rounds"]
        return (f"prompt {d['id']}: greedy {_verdict(d)}; sampled {_verdict(d['sampled'])}"
                + (f" ({trees} rounds verified trees)" if trees else ""))
    if kind == "sampling":
        return (f"sampling: {d['samples']} speculative samples of prompt {d['prompt']} (temperature 1, drafter "
                f"{d['drafter']}, draft_len {d['draft_len']}), second token vs the target's exact distribution ...")
    return (f"sampling: chi-square {d['chi2']:.2f} on {d['dof']} dof, p = {d['p_value']:.3g} "
            f"({d['first_tokens']} first tokens, {d['mass_covered']:.1%} of the mass): "
            + ("ok" if d["ok"] else f"FAILED (p < {P_MIN})"))

"""`python -m ict_jax.analyze --workdir W [--step S]`: the token-level view of a run.

Writes `W/analysis/step_<S>.html` (open it in a browser) and `W/analysis/step_<S>.png`: the
completions the trainer logged with per-token statistics at step S (`tokens/<step>.jsonl`, written at
checkpoint steps; default the latest), token by token, coloured by ICT's JS score (switchable to
entropy and to the sampled token's probability), ICT's selected tokens boxed, the stop token and
the tokens after the final box marked (where a collapsing run's selection goes), and the paper-style
statistics of the selected tokens: their mean probability, their share of high- and low-entropy
tokens (above / below the median entropy of the step's logged tokens) and where in the response
they sit (fifths of the response length), and their shares of stop and post-answer tokens.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from ict_jax import token_view

LOG2 = float(np.log(2.0))


def selection_stats(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
  """Statistics of the selected tokens against all tokens of `rows` (token_view rows)."""
  prob = np.concatenate([r["prob"] for r in rows]) if rows else np.zeros(0)
  ent = np.concatenate([r["entropy"] for r in rows]) if rows else np.zeros(0)
  js = np.concatenate([r["js"] for r in rows]) if rows else np.zeros(0)
  sel = np.concatenate([np.asarray(r["selected"], bool) for r in rows]) if rows else np.zeros(0, bool)
  rel = (
      np.concatenate([(np.arange(len(r["prob"])) + 0.5) / max(len(r["prob"]), 1) for r in rows])
      if rows
      else np.zeros(0)
  )
  first = np.concatenate([np.arange(len(r["prob"])) == 0 for r in rows]) if rows else np.zeros(0, bool)
  # stop token / after the final box (token_view rows from before these marks have neither)
  flag = lambda key: (  # noqa: E731
      np.concatenate([np.asarray(r.get(key, [False] * len(r["prob"])), bool) for r in rows])
      if rows
      else np.zeros(0, bool)
  )
  stop, post = flag("stop"), flag("post_answer")
  median = float(np.median(ent)) if ent.size else 0.0
  fifths = np.minimum((rel * 5).astype(int), 4)

  def mean(x):
    return float(np.mean(x)) if np.size(x) else float("nan")

  n_sel = int(sel.sum())
  return {
      "tokens": int(sel.size),
      "selected": n_sel,
      "mean_prob_selected": mean(prob[sel]),
      "mean_prob_all": mean(prob),
      "mean_js_selected": mean(js[sel]),
      "mean_js_unselected": mean(js[~sel]),
      "entropy_median": median,
      "high_entropy_share": mean(ent[sel] > median),
      "low_entropy_share": mean(ent[sel] <= median),
      "position_fifths_selected": [int(np.sum(sel & (fifths == k))) for k in range(5)],
      "position_fifths_all": [int(np.sum(fifths == k)) for k in range(5)],
      "mean_relative_position_selected": mean(rel[sel]),
      "first_token_selected_share": mean(sel[first]),
      "mean_js_first_token": mean(js[first]),
      "mean_js_later_tokens": mean(js[~first]),
      "stop_share_selected": mean(stop[sel]),
      "stop_share_all": mean(stop),
      "stop_selected_rate": mean(sel[stop]),
      "post_answer_share_selected": mean(post[sel]),
      "post_answer_share_all": mean(post),
  }


# The view's own style, every rule under `.ictv`, so that the fragment can sit in a notebook cell
# without restyling the notebook. The colour switch is CSS only (hidden radio inputs, each token
# carrying its three colours as custom properties), so it works where scripts do not run (a notebook
# output, an untrusted notebook, the screenshot); inline colours of the JS score and the selected
# tokens' box remain where the <style> is stripped.
_CSS = """
.ictv{font-family:system-ui,sans-serif;color:#222;background:#fff;max-width:1100px;padding:4px 0}
.ictv .note{color:#666;font-size:13px;margin-bottom:10px}
.ictv .controls{margin:8px 0 14px;font-size:14px;display:flex;align-items:center;gap:8px;flex-wrap:wrap}
.ictv input.key{display:none}
.ictv label{cursor:pointer;padding:1px 8px;border:1px solid #bbb;border-radius:10px}
.ictv input.k-js:checked~.controls label.k-js,.ictv input.k-entropy:checked~.controls label.k-entropy,
.ictv input.k-prob:checked~.controls label.k-prob{background:#222;color:#fff;border-color:#222}
.ictv .lmax{display:none}
.ictv input.k-js:checked~.controls .lmax.k-js,.ictv input.k-entropy:checked~.controls .lmax.k-entropy,
.ictv input.k-prob:checked~.controls .lmax.k-prob{display:inline}
.ictv .row{display:flex;align-items:baseline;gap:10px;margin:3px 0;font-family:ui-monospace,monospace;font-size:15px}
.ictv .meta{width:150px;flex:none;color:#555;font-size:12px;text-align:right}
.ictv .ok{color:#137333;font-weight:600} .ictv .bad{color:#b3261e} .ictv .none{color:#888;font-style:italic}
.ictv .tok{display:inline-block;padding:2px 1px;margin:0 1px;border-radius:3px;border:2px solid transparent;white-space:pre;
  background:var(--js)!important}
.ictv input.k-entropy:checked~.rows .tok{background:var(--entropy)!important}
.ictv input.k-prob:checked~.rows .tok{background:var(--prob)!important}
.ictv .tok.sel{border-color:#111;font-weight:700}
.ictv .tok.stop{outline:2px dashed #1a73e8;outline-offset:1px}
.ictv .tok.post{text-decoration:underline wavy #e37400}
.ictv .frag{color:#999}
.ictv .legend{display:inline-flex;align-items:center;gap:8px;font-size:12px;color:#555;margin-left:6px}
.ictv .bar{width:180px;height:12px;border-radius:3px;background:linear-gradient(90deg,#fff,rgb(200,40,40))}
.ictv table{border-collapse:collapse;font-size:14px;margin-top:8px}
.ictv td,.ictv th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left}
.ictv .grid{display:grid;grid-template-columns:1fr 1fr;gap:24px;margin-top:18px}
.ictv .hist{display:flex;align-items:flex-end;gap:6px;height:90px}
.ictv .hist div{width:34px;background:#444;text-align:center;color:#fff;font-size:11px}
.ictv .group{margin-top:10px;font-size:13px;color:#444}
"""

_PAGE_CSS = """
body{margin:24px} h1{font-family:system-ui,sans-serif;font-size:20px;margin:0 0 4px;color:#222}
.sub{font-family:system-ui,sans-serif;color:#666;font-size:13px}
"""

KEYS = (("js", "JS to the group mean"), ("entropy", "entropy"), ("prob", "probability"))


def colour(v: float) -> str:
  """White (0) to red (1), `v` clipped to [0, 1]."""
  t = min(max(float(v), 0.0), 1.0)
  return f"rgb({round(255 - t * 55)},{round(255 - t * 215)},{round(255 - t * 215)})"


def _token_span(t: str, j: float, h: float, p: float, s: bool, hmax: float, stop=False, post=False) -> str:
  cj, ch, cp = colour(j / LOG2), colour(h / hmax), colour(p)
  box = ";border-color:#111" if s else ""
  # A token holding only the first bytes of a character has no text of its own (the character
  # shows whole at the token that completes it), nor has an id past the tokenizer's vocabulary (an
  # embedding padding row): a grey dot keeps its box visible.
  text, frag = (
      (html.escape(t), "")
      if t
      else (
          '<span class="frag">·</span>',
          " | no text: first bytes of a character a later token completes, or an embedding padding row",
      )
  )
  cls = "tok" + (" sel" if s else "") + (" stop" if stop else "") + (" post" if post else "")
  marks = (" | selected" if s else "") + (" | stop token" if stop else "") + (" | after the answer" if post else "")
  return (
      f'<span class="{cls}" style="background:{cj}{box};--js:{cj};--entropy:{ch};--prob:{cp}" '
      f'data-js="{j:.6f}" data-entropy="{h:.6f}" data-prob="{p:.6f}" title="JS {j:.3g} | entropy {h:.3f} | '
      f'p {p:.3f}{marks}{frag}">{text}</span>'
  )


def render_fragment(rows: Sequence[dict[str, Any]], stats: dict[str, Any] | None = None, uid: str | None = None) -> str:
  """The token view of `rows` (token_view rows) as one self-contained `<div class="ictv">`: its
  scoped style, the colour switch, the completions grouped by prompt (selected tokens boxed) and the
  selected tokens' statistics (`selection_stats(rows)` unless given). The page of
  `python -m ict_jax.analyze` and the notebook's `IPython.display.HTML` both show this."""
  import uuid

  stats = selection_stats(rows) if stats is None else stats
  uid = uid or "ictv-" + uuid.uuid4().hex[:8]  # the radio group's name: one per view on a page
  hmax = max([max(r["entropy"], default=0.0) for r in rows] + [1e-6])
  lines = []
  previous_prompt = None
  for r in rows:
    if r["prompt"] != previous_prompt:
      lines.append(
          f'<div class="group">prompt <b>{html.escape(r["prompt"])}</b> &nbsp; gold '
          f'<b>{html.escape(r["gold"])}</b></div>'
      )
      previous_prompt = r["prompt"]
    none = [False] * len(r["tokens"])
    toks = "".join(
        _token_span(t, j, h, p, s, hmax, e, a)
        for t, j, h, p, s, e, a in zip(
            r["tokens"],
            r["js"],
            r["entropy"],
            r["prob"],
            r["selected"],
            r.get("stop", none),
            r.get("post_answer", none),
        )
    )
    ok = r["reward"] > 0
    if not r["tokens"]:  # a completion masked out of the loss (loss.mask_truncated_completions)
      toks = '<span class="none">truncated at rollout.max_new_tokens: no tokens trained</span>'
    lines.append(
        f'<div class="row"><div class="meta"><span class="{"ok" if ok else "bad"}">'
        f'{"correct" if ok else "wrong"}</span> A={r["advantage"]:+.2f}</div><div>{toks}</div></div>'
    )
  fifth_sel, fifth_all = stats["position_fifths_selected"], stats["position_fifths_all"]
  top = max(fifth_sel + [1])
  hist = "".join(
      f'<div style="height:{14 + 72 * c / top:.0f}px" title="{c} of {a} tokens">{c}</div>'
      for c, a in zip(fifth_sel, fifth_all)
  )
  f = lambda v: "–" if v != v else f"{v:.3f}"  # noqa: E731 (nan -> dash)
  g = lambda v: "–" if v != v else f"{v:.3g}"  # noqa: E731 (JS: 3 significant digits, small on weak policies)
  warm = any(r.get("dense_warmup") for r in rows)
  warm_note = " &middot; this step is in ICT's dense warm-up: every token trained" if warm else ""
  table = f"""
<table>
<tr><th></th><th>selected</th><th>all tokens</th></tr>
<tr><td>tokens</td><td>{stats['selected']}</td><td>{stats['tokens']}</td></tr>
<tr><td>mean probability of the sampled token</td><td>{f(stats['mean_prob_selected'])}</td><td>{f(stats['mean_prob_all'])}</td></tr>
<tr><td>mean JS score</td><td>{g(stats['mean_js_selected'])}</td><td>{g(stats['mean_js_unselected'])} (unselected)</td></tr>
<tr><td>high-entropy share (H &gt; median {stats['entropy_median']:.3f})</td><td>{f(stats['high_entropy_share'])}</td><td>0.5 by definition</td></tr>
<tr><td>low-entropy share</td><td>{f(stats['low_entropy_share'])}</td><td></td></tr>
<tr><td>mean relative position in the response</td><td>{f(stats['mean_relative_position_selected'])}</td><td>0.5</td></tr>
<tr><td>stop-token share (selected: {f(stats['stop_selected_rate'])} of the stop tokens)</td><td>{f(stats['stop_share_selected'])}</td><td>{f(stats['stop_share_all'])}</td></tr>
<tr><td>post-answer share (tokens after the final box)</td><td>{f(stats['post_answer_share_selected'])}</td><td>{f(stats['post_answer_share_all'])}</td></tr>
<tr><td>first tokens selected / mean JS of first vs later tokens</td><td>{f(stats['first_token_selected_share'])}</td><td>{g(stats['mean_js_first_token'])} vs {g(stats['mean_js_later_tokens'])}</td></tr>
</table>"""
  inputs = "".join(
      f'<input type="radio" class="key k-{k}" id="{uid}-{k}" name="{uid}" value="{k}"{" checked" if k == "js" else ""}>'
      for k, _ in KEYS
  )
  labels = "".join(f'<label class="k-{k}" for="{uid}-{k}">{name}</label>' for k, name in KEYS)
  maxima = "".join(
      f'<span class="lmax k-{k}">{m:.3f}</span>' for k, m in (("js", LOG2), ("entropy", hmax), ("prob", 1.0))
  )
  return f"""<div class="ictv" id="{uid}"><style>{_CSS}</style>
<div class="note">{len(rows)} completions in groups of one prompt &middot; colour = the token's score;
<b style="border:2px solid #111;padding:0 3px">boxed</b> = selected by ICT (top share of each response by
score); <span style="outline:2px dashed #1a73e8">dashed</span> = the stop token;
<span style="text-decoration:underline wavy #e37400">wavy</span> = after the final box{warm_note}.
Hover a token for its values.</div>
{inputs}<div class="controls">colour by: {labels}
<span class="legend">0 <span class="bar"></span> {maxima}</span></div>
<div class="rows">{''.join(lines)}</div>
<div class="grid"><div><b>Selected tokens</b>{table}</div>
<div><b>Where the selected tokens sit</b> (fifths of the response, first to last)<div class="hist">{hist}</div></div></div>
</div>"""


def render_html(step: int, rows: Sequence[dict[str, Any]], stats: dict[str, Any], title: str) -> str:
  """The whole page: a heading, then `render_fragment`."""
  return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{_PAGE_CSS}</style></head><body>
<h1>ICT token view, step {step}</h1>
<div class="sub">{html.escape(title)}</div>
{render_fragment(rows, stats, uid="ictv")}
</body></html>
"""


def summary(step: int, stats: dict[str, Any]) -> str:
  """One line: how many tokens were selected, their mean probability and high-entropy share."""
  return (
      f"step {step}: {stats['selected']} of {stats['tokens']} tokens selected; mean p selected "
      f"{stats['mean_prob_selected']:.3f} (all {stats['mean_prob_all']:.3f}); high-entropy share "
      f"{stats['high_entropy_share']:.2f}"
  )


def screenshot(html_path: str, png_path: str, width: int = 1150, height: int = 900) -> str | None:
  """A PNG of the page from headless Chromium; None (no PNG) when no Chromium is installed."""
  import shutil
  import subprocess

  exe = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
  if exe is None:
    return None
  subprocess.run(
      [
          exe,
          "--headless",
          "--no-sandbox",
          "--disable-gpu",
          "--hide-scrollbars",
          f"--window-size={width},{height}",
          f"--screenshot={os.path.abspath(png_path)}",
          "file://" + os.path.abspath(html_path),
      ],
      check=True,
      capture_output=True,
      timeout=120,
  )
  return png_path


def analyze(workdir: str, step: int | None = None, out_dir: str | None = None, png: bool = True) -> dict[str, Any]:
  """Write the page (and the PNG when Chromium is there) -> {"step", "html", "png", "stats"}.

  `workdir` and `out_dir` may be gs:// URLs: the files go through epath; Chromium renders the
  page from a local copy and its PNG is copied up."""
  from etils import epath

  from ict_jax import storage

  storage.check_backend(workdir, "--workdir")
  step, rows = token_view.load(workdir, step)
  stats = selection_stats(rows)
  out = epath.Path(out_dir or os.path.join(os.fspath(workdir), "analysis"))
  storage.check_backend(out, "--out")
  out.mkdir(parents=True, exist_ok=True)
  title = os.fspath(workdir) if storage.is_url(workdir) else os.path.abspath(workdir)
  text = render_html(step, rows, stats, title)
  page = out / f"step_{step}.html"
  page.write_text(text)
  (out / f"step_{step}.json").write_text(json.dumps(stats, indent=2))
  image = None
  if png:
    with tempfile.TemporaryDirectory(prefix="ict_jax_analyze_") as tmp:
      local_page = os.path.join(tmp, page.name)
      with open(local_page, "w") as f:
        f.write(text)
      local_png = screenshot(local_page, os.path.join(tmp, f"step_{step}.png"))
      if local_png is not None:
        image = out / f"step_{step}.png"
        image.write_bytes(Path(local_png).read_bytes())
  return {"step": step, "html": os.fspath(page), "png": None if image is None else os.fspath(image), "stats": stats}


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(prog="python -m ict_jax.analyze", description=__doc__.split("\n")[0])
  ap.add_argument("--workdir", required=True, help="a training run's directory")
  ap.add_argument("--step", type=int, default=None, help="a step with token statistics (default: latest)")
  ap.add_argument("--out", default=None, help="output directory (default: WORKDIR/analysis)")
  ap.add_argument("--no-png", action="store_true", help="skip the Chromium screenshot")
  args = ap.parse_args(argv)
  try:
    res = analyze(args.workdir, args.step, args.out, png=not args.no_png)
  except (FileNotFoundError, KeyError, ValueError) as e:
    print(f"ict_jax.analyze: error: {e.args[0] if e.args else e}", file=sys.stderr)
    sys.exit(2)
  s = res["stats"]
  print(summary(res["step"], s))
  print(res["html"])
  if res["png"]:
    print(res["png"])


if __name__ == "__main__":
  main()

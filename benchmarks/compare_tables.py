"""benchmarks/compare_methods.py's bookkeeping, no model and no run: variants, pass@k summaries with paired
differences and their standard errors, the ICT paper's signature of the selected tokens, the test
problems that no RL run solves, and the markdown tables.

`python benchmarks/compare_methods.py --report` rebuilds every table from the runs' files, or from a
setting's `results.json` when the runs are not there (a checkout of the committed sweep).
"""

from __future__ import annotations

import glob
import json
import math
import os

import numpy as np

from ict_jax.eval.passk import pass_at_k_curve
from ict_jax.grpo import SELECTED_NORMS
from ict_jax.selection import REFERENCES

METHODS = ("grpo", "entropy", "stapo", "ict")
NAMES = {"grpo": "GRPO", "entropy": "20-Entropy", "stapo": "STAPO", "ict": "ICT", "warm-start": "warm-start (no RL)"}
BASELINE = "warm-start"  # the shared warm-start itself, evaluated with each seed's key
REFERENCE = "grpo"  # the paired differences are each variant minus GRPO on the same seeds
# variant keys: ICT's ablations (config ict.*) and the loss's normalisation (loss.*), any method
ABLATION_KEYS = {"score": str, "keep": str, "top_fraction": float, "reference": str}
LOSS_KEYS = {"selected_norm": str}
KS = (1, 4, 16, 64)
SHOWN_KS = (4, 1, 16, 64)  # pass@4, the paper's metric, first
PAIRED_KS = (4, 1, 64)  # the paired differences (mean ± standard error) the tables show
# the ICT paper's signature of the selected tokens (train-step metrics, `selection.signature_metrics`)
# and the paper's values: mean probability ~0.18, half of them above the median entropy
SIGNATURE = {"selected_prob": ("selected p", 0.18), "selected_high_entropy": ("share above median H", 0.5)}


def parse_variant(variant: str) -> dict:
  """ "ict" / "grpo" / ... -> {"method": ...}; "score=kl+top_fraction=0.2" -> ICT with those keys;
  "entropy+selected_norm=response" -> that method with those keys (ICT's keys need method ict)."""
  if variant in METHODS:
    return {"method": variant}
  parts = variant.split("+")
  out = {"method": parts.pop(0) if parts[0] in METHODS else "ict"}
  for part in parts:
    key, sep, value = part.partition("=")
    keys = {**LOSS_KEYS, **(ABLATION_KEYS if out["method"] == "ict" else {})}
    if not sep or key not in keys:
      raise ValueError(
          f"bad variant {variant!r}: expected a method {METHODS}, optionally followed by +key=value with key "
          f"in {sorted(LOSS_KEYS)} (any method) or {sorted(ABLATION_KEYS)} (ict)"
      )
    out[key] = keys[key](value)
  if out.get("selected_norm", "selected") not in SELECTED_NORMS:
    raise ValueError(f"bad variant {variant!r}: selected_norm must be one of {sorted(SELECTED_NORMS)}")
  if out.get("reference", "active_mean") not in REFERENCES:
    raise ValueError(f"bad variant {variant!r}: reference must be one of {sorted(REFERENCES)}")
  return out


def variant_name(variant: str) -> str:
  """The table's name: "GRPO", "ICT score=kl", "20-Entropy selected_norm=response"."""
  if variant in NAMES:
    return NAMES[variant]
  method = parse_variant(variant)["method"]
  rest = variant[len(method) + 1 :] if variant.startswith(method + "+") else variant
  return f"{NAMES[method]} {rest}"


def js_reference(variant: str) -> str:
  """The ICT JS reference reading a variant ran with (ict.reference); "–" for other methods."""
  if variant == BASELINE:
    return "–"
  v = parse_variant(variant)
  return v.get("reference", "active_mean") if v["method"] == "ict" else "–"


def signature(history: list[dict]) -> dict[str, dict]:
  """{metric: {"mean": over the run's steps, "last10": over its last 10% (at least one step)}} of
  the `SIGNATURE` metrics in a run's metrics log (NaN steps, with no selected token, skipped); a
  log from before the metrics existed gives {}."""
  out = {}
  for key in SIGNATURE:
    values = np.array([h.get(key, np.nan) for h in history], dtype=np.float64)
    if not len(values) or np.isnan(values).all():
      continue
    tail = values[-max(1, math.ceil(len(values) / 10)) :]
    out[key] = {
        "mean": float(np.nanmean(values)),
        "last10": float(np.nanmean(tail)) if not np.isnan(tail).all() else float("nan"),
    }
  return out


def _stats(v: np.ndarray) -> dict:
  return {
      "mean": float(v.mean()),
      "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
      "min": float(v.min()),
      "max": float(v.max()),
  }


def paired(a, b) -> dict:
  """Paired differences a - b (one per seed): mean, std (ddof 1; 0 for one pair), the standard error
  std / sqrt(n) (NaN for one pair: no spread to estimate), n, and how many are below 0."""
  d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
  std = float(d.std(ddof=1)) if len(d) > 1 else 0.0
  se = std / math.sqrt(len(d)) if len(d) > 1 else float("nan")
  return {"mean": float(d.mean()), "std": std, "se": se, "n": len(d), "below": int((d < 0).sum())}


def _signature_row(validation, variant: str, lr) -> dict:
  """{metric: {"mean": stats over seeds, "last10": stats over seeds}, "seeds": [...]} of the runs of
  `variant` at `lr` that logged the signature ({} when none did: runs from before the metrics)."""
  runs = {
      r["seed"]: r["signature"] for r in validation if r["variant"] == variant and r["lr"] == lr and r.get("signature")
  }
  if not runs:
    return {}
  seeds = sorted(runs)
  out: dict = {"seeds": seeds}
  for key in SIGNATURE:
    have = [sd for sd in seeds if key in runs[sd]]
    if have:
      out[key] = {part: _stats(np.array([runs[sd][key][part] for sd in have])) for part in ("mean", "last10")}
  return out


def summarize(tests: list[dict], chosen: dict[str, float], validation: list[dict] = ()) -> dict[str, dict]:
  """Per variant, from the test records at its chosen lr (BASELINE: lr None): the seeds, pass@k
  for k = 1..n per seed, mean / std / min / max of pass@k at `KS`, the paired differences variant
  minus GRPO (`diff@k`) and minus the warm-start (`gain@k`) on the seeds both have (mean, std,
  standard error, n), and from the validation records (the runs' result.json) at that lr the
  signature metrics (`signature`, absent for runs from before them)."""
  by: dict[str, dict[int, np.ndarray]] = {}
  for r in tests:
    if r["lr"] == chosen.get(r["variant"]):
      by.setdefault(r["variant"], {})[r["seed"]] = pass_at_k_curve(r["counts"], r["n"])
  out = {}
  for variant, runs in by.items():
    seeds = sorted(runs)
    n = min(len(runs[sd]) for sd in seeds)
    row = {"lr": chosen.get(variant), "seeds": seeds, "curve": [runs[sd][:n].tolist() for sd in seeds]}
    for k in (k for k in KS if k <= n):
      row[f"pass@{k}"] = _stats(np.array([runs[sd][k - 1] for sd in seeds]))
      for name, ref in ((f"diff@{k}", REFERENCE), (f"gain@{k}", BASELINE)):
        common = sorted(set(runs) & set(by.get(ref, {}))) if variant != ref else []
        if common:
          row[name] = paired([runs[sd][k - 1] for sd in common], [by[ref][sd][k - 1] for sd in common])
    sig = _signature_row(validation, variant, row["lr"]) if variant != BASELINE else {}
    if sig:
      row["signature"] = sig
    out[variant] = row
  return out


def order(names) -> list[str]:
  first = [v for v in (BASELINE, *METHODS) if v in names]
  return first + sorted(v for v in names if v not in first)


def _paired_cell(d: dict | None) -> str:
  if d is None:
    return "–"
  se = d.get("se", float("nan"))
  spread = f" ± {100 * se:.1f}" if se == se else ""  # NaN: one pair, no spread to show
  return f"{100 * d['mean']:+.1f}{spread} (n={d['n']}, {d['below']} below)"


def _signature_cell(sig: dict, key: str, scale: float) -> str:
  if key not in sig:
    return "–"
  m, last = sig[key]["mean"], sig[key]["last10"]
  return f"{scale * m['mean']:.2f} ± {scale * m['std']:.2f} (last 10%: {scale * last['mean']:.2f})"


def table(summary: dict[str, dict], validation: list[dict] = ()) -> str:
  """Markdown, values in percent: the test table (warm-start, methods, ablations; pass@4 first; the
  paired differences as mean ± standard error over seeds, with how many seeds are below 0; the
  signature metrics, "–" for runs from before them), then the validation grid the lrs were chosen
  on (mean validation pass@1 over the seeds; * the choice)."""
  ks = [k for k in SHOWN_KS if any(f"pass@{k}" in row for row in summary.values())]
  pks = [k for k in PAIRED_KS if k in ks]
  head = ["variant", "lr", "seeds"] + [f"pass@{k} mean ± std [min, max]" for k in ks]
  head += [f"pass@{k} − GRPO (paired, ± SE)" for k in pks] + [f"pass@{k} − warm-start (paired, ± SE)" for k in pks]
  head += [f"{SIGNATURE['selected_prob'][0]} (paper ~{SIGNATURE['selected_prob'][1]:g})"]
  head += [f"{SIGNATURE['selected_high_entropy'][0]}, % (paper ~{100 * SIGNATURE['selected_high_entropy'][1]:g}%)"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for v in order(summary):
    row = summary[v]
    lr = "–" if row["lr"] is None else f"{row['lr']:g}"
    cells = [variant_name(v), lr, str(len(row["seeds"]))]
    for k in ks:
      p = row[f"pass@{k}"]
      cells.append(f"{100 * p['mean']:.1f} ± {100 * p['std']:.1f} [{100 * p['min']:.1f}, {100 * p['max']:.1f}]")
    cells += [_paired_cell(row.get(name)) for name in [f"diff@{k}" for k in pks] + [f"gain@{k}" for k in pks]]
    sig = row.get("signature", {})
    cells += [_signature_cell(sig, "selected_prob", 1.0), _signature_cell(sig, "selected_high_entropy", 100.0)]
    lines.append("| " + " | ".join(cells) + " |")
  lines += signature_table(summary)
  if validation:
    chosen = {v: row["lr"] for v, row in summary.items()}
    lines += [""] + validation_table(validation, chosen)
  return "\n".join(lines) + "\n"


def validation_table(validation: list[dict], chosen: dict, lrs=None) -> list[str]:
  """The validation grid the lrs were chosen on, markdown lines: per variant and lr the mean over
  seeds of validation pass@4 and pass@1 where the runs were validated again (records with "val",
  compare_methods.validate_one), else pass@1 of their last periodic eval; * the chosen lr."""
  validated = all("val" in r for r in validation)
  metrics = ("pass@4", "pass@1") if validated else ("pass@1",)
  lrs = sorted(lrs or {r["lr"] for r in validation})  # the grid's lrs, "–" where no run is there
  lines = [f"Validation {' / '.join(metrics)} (%, mean over seeds; * the chosen lr):", ""]
  lines += ["| variant | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |", "|" + "---|" * (len(lrs) + 1)]
  for v in order({r["variant"] for r in validation}):
    cells = [variant_name(v)]
    for lr in lrs:
      runs = [r for r in validation if r["variant"] == v and r["lr"] == lr]
      if not runs:
        cells.append("–")
        continue
      means = [100 * np.mean([val_metric(r, m) for r in runs]) for m in metrics]
      mark = "*" if chosen.get(v) == lr else ""
      cells.append(" / ".join(f"{x:.1f}" for x in means) + f"{mark} (n={len(runs)})")
    lines.append("| " + " | ".join(cells) + " |")
  return lines


def signature_table(summary: dict[str, dict]) -> list[str]:
  """The paper's signature per method and per ICT JS reference reading (ict.reference), markdown
  lines; empty when no run logged it."""
  rows = [v for v in order(summary) if summary[v].get("signature")]
  if not rows:
    return []
  p, h = SIGNATURE["selected_prob"], SIGNATURE["selected_high_entropy"]
  lines = ["", "The selected tokens' signature (mean over each run's steps, then mean ± std over seeds):", ""]
  lines += [
      f"| variant | JS reference | seeds | {p[0]} (paper ~{p[1]:g}) | {h[0]}, % (paper ~{100 * h[1]:g}%) |",
      "|---|---|---|---|---|",
  ]
  for v in rows:
    sig = summary[v]["signature"]
    cells = [variant_name(v), js_reference(v), str(len(sig["seeds"]))]
    cells += [_signature_cell(sig, "selected_prob", 1.0), _signature_cell(sig, "selected_high_entropy", 100.0)]
    lines.append("| " + " | ".join(cells) + " |")
  return lines


# ----------------------------------------------------------------------------- a capped test set
def unsolved_problems(tests: list[dict], exclude=(BASELINE,)) -> list[int]:
  """The indices of the test problems that every RL run scores 0 on (every record whose variant is
  not in `exclude`, whatever its lr), over the problems all of them have; [] without RL records."""
  rl = [r for r in tests if r["variant"] not in exclude]
  if not rl:
    return []
  n = min(len(r["counts"]) for r in rl)
  return [i for i in range(n) if all(r["counts"][i] == 0 for r in rl)]


def without_problems(tests: list[dict], drop) -> list[dict]:
  """The test records with the problems `drop` (indices) taken out of their counts."""
  drop = set(drop)
  return [{**r, "counts": [c for i, c in enumerate(r["counts"]) if i not in drop]} for r in tests]


def unsolved_report(tests: list[dict], chosen: dict, texts=None, k: int = 64) -> str:
  """Markdown: the problems no RL run solves (with their text when `texts`, index -> str, is
  given), the cap they put on pass@k for every method, and pass@k on the other problems per
  variant (mean ± std over seeds, paired difference to GRPO ± SE); k at most the samples n."""
  bad = unsolved_problems(tests)
  rl = [r for r in tests if r["variant"] != BASELINE]
  if not bad or not rl:
    return f"Every test problem is solved by at least one RL run ({len(rl)} runs).\n"
  total, k = min(len(r["counts"]) for r in rl), min(k, min(r["n"] for r in rl))
  lines = [
      f"{len(bad)} of {total} test problems are solved by no RL run ({len(rl)} runs, 0 of "
      f"{rl[0]['n']} samples each), so pass@{k} is at most {100 * (total - len(bad)) / total:.1f}% for every "
      "method:",
      "",
  ]
  base = {r["seed"]: r["counts"] for r in tests if r["variant"] == BASELINE}
  for i in bad:
    text = f" {texts(i)}" if texts is not None else ""
    warm = f" (warm-start: {', '.join(str(c[i]) for _, c in sorted(base.items()))} correct)" if base else ""
    lines.append(f"- test problem {i}:{text}{warm}")
  if len(bad) == total:
    return "\n".join(lines) + "\n"
  rest = summarize(without_problems(tests, bad), chosen)
  lines += [
      "",
      f"pass@{k} on the other {total - len(bad)} problems (%, mean ± std over seeds; − GRPO paired ± SE):",
      "",
  ]
  for v in order(rest):
    p = rest[v].get(f"pass@{k}")
    if p is not None:
      diff = rest[v].get(f"diff@{k}")
      extra = "" if diff is None else f", − GRPO {_paired_cell(diff)}"
      lines.append(f"- {variant_name(v)}: {100 * p['mean']:.1f} ± {100 * p['std']:.1f}{extra}")
  return "\n".join(lines) + "\n"


def val_metric(record: dict, metric: str) -> float:
  """A validation record's `metric`: "pass@1" from the run's last periodic eval unless the record
  was validated again (`validate_one`, "val"), which any other metric needs."""
  if "val" in record:
    return record["val"][metric]
  if metric == "pass@1":
    return record["val_pass@1"]
  raise ValueError(
      f"{record['variant']} lr {record['lr']:g} seed {record['seed']}: no validation {metric} (validate_one)"
  )


def select_lrs(validation: list[dict], lrs, seeds, metric: str = "pass@1") -> dict[str, float]:
  """{variant: the lr of `lrs` with the highest validation `metric` averaged over `seeds`} from
  validation records ({"variant", "lr", "seed", "val_pass@1"} or "val": {metric: ...}); ties go to
  the first lr in `lrs`. Every (variant, lr, seed) must be there."""
  table = {(r["variant"], r["lr"], r["seed"]): val_metric(r, metric) for r in validation}
  out = {}
  for variant in dict.fromkeys(r["variant"] for r in validation):
    means = []
    for lr in lrs:
      missing = [sd for sd in seeds if (variant, lr, sd) not in table]
      if missing:
        raise ValueError(f"select_lrs: {variant} at lr {lr:g} has no validation result for seeds {missing}")
      means.append(np.mean([table[variant, lr, sd] for sd in seeds]))
    out[variant] = lrs[int(np.argmax(means))]
  return out


def validation_report(out: str, lrs, seeds, variants, select_by: str) -> dict:
  """A validation-only sweep's report from the runs under `out`/runs (else `out`/validation.json's
  records): validation.md (the grid, the choice over each variant's complete lrs, the grid points
  still missing, the runs' wall time) and validation.json (the choice and the records without
  their curves). A run counts once validated for `select_by`."""
  records = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(out, "runs", "*", "result.json")))]
  saved = os.path.join(out, "validation.json")
  if not records and os.path.exists(saved):  # a checkout of the committed grid: its saved records
    records = json.load(open(saved))["validation"]
  keep = lambda r: r["variant"] in variants and r["lr"] in lrs and r["seed"] in seeds  # noqa: E731
  records = [{k: v for k, v in r.items() if k != "curves"} for r in records if keep(r)]
  records = [r for r in records if select_by == "pass@1" or "val" in r]
  have = {(r["variant"], r["lr"], r["seed"]) for r in records}
  missing = [(v, lr, sd) for v in variants for lr in lrs for sd in seeds if (v, lr, sd) not in have]
  chosen = {}
  for v in variants:
    complete = [lr for lr in lrs if all((v, lr, sd) in have for sd in seeds)]
    if complete:
      chosen.update(select_lrs([r for r in records if r["variant"] == v], complete, seeds, select_by))
  md = f"Learning rates chosen by validation {select_by} over seeds {', '.join(map(str, seeds))}.\n\n"
  md += "\n".join(validation_table(records, chosen, lrs)) + "\n\n"
  edge = [v for v in chosen if chosen[v] in (min(lrs), max(lrs))]
  md += f"Chosen at the grid's edge (extend the grid): {', '.join(map(variant_name, edge)) or 'none'}.\n"
  if missing:
    md += "Not run yet (chosen over the complete lrs only): "
    md += ", ".join(f"{variant_name(v)} lr {lr:g} seed {sd}" for v, lr, sd in missing) + ".\n"
  md += f"RL wall time: {sum(r['train_s'] for r in records) / 3600:.2f} h over {len(records)} runs.\n"
  with open(os.path.join(out, "validation.md"), "w") as f:
    f.write(md)
  with open(saved, "w") as f:
    json.dump({"chosen_lr": chosen, "select_by": select_by, "missing": missing, "validation": records}, f)
  print(f"## {out}\n\n{md}", flush=True)
  return {"chosen_lr": chosen, "edge": edge, "missing": missing}

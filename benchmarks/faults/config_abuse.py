"""CLI config abuse (an unknown key, a wrong type, out-of-range values, a mesh that does not divide
the devices): one stderr line, exit != 0, nothing compiled, no checkpoint written."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.faults.harness import Run, row
from benchmarks.faults.registry import Context, scenario

CONFIG_FAULTS = {  # name -> (flags, devices, needle)
    "unknown key": (["--config.train.stepz=3"], 1, "stepz"),
    "wrong type": (["--config.train.steps=abc"], 1, "steps"),
    "negative steps": (["--config.train.steps=-5"], 1, "config.train.steps: expected > 0"),
    "mesh 3 on 8 devices": (["--config.mesh.fsdp=3"], 8, "mesh"),
    "top_fraction 1.5": (["--config.ict.top_fraction=1.5"], 1, "config.ict.top_fraction"),
    "top_fraction 0": (["--config.ict.top_fraction=0"], 1, "config.ict.top_fraction"),
}


def config_abuse(root, *, names=None) -> dict:
  root = Path(root)
  cases = []
  for name in names or CONFIG_FAULTS:
    flags, devices, needle = CONFIG_FAULTS[name]
    workdir = root / ("cfg_" + re.sub(r"\W+", "_", name))
    r = Run(workdir, flags, root / "logs", name=workdir.name, devices=devices, extra_env={"JAX_LOG_COMPILES": "1"})
    rc = r.wait()
    lines = r.error_lines()
    compiled = any("Compiling" in l or "Finished XLA compilation" in l for l in lines)
    ok = rc != 0 and len(lines) == 1 and needle in lines[0] and not compiled and not (workdir / "checkpoints").exists()
    cases.append(
        {
            "name": name,
            "rc": rc,
            "lines": lines[:3],
            "seconds": round(r.seconds, 1),
            "compiled": compiled,
            "checkpoints": (workdir / "checkpoints").exists(),
            "ok": ok,
        }
    )
  return row(
      "config abuse (CLI)",
      ", ".join(c["name"] for c in cases),
      "one stderr line naming the key, exit != 0, no compilation (JAX_LOG_COMPILES=1), no checkpoints/",
      "; ".join(
          f"{c['name']}: rc {c['rc']}, {len(c['lines'])} line(s) in {c['seconds']} s, compiled "
          f"{c['compiled']}, checkpoints/ {c['checkpoints']}"
          for c in cases
      ),
      all(c["ok"] for c in cases),
      cases=cases,
  )


@scenario("config")
def _run(ctx: Context) -> dict:
  return config_abuse(ctx.root)

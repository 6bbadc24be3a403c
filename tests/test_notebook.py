"""notebooks/inspect_checkpoint.ipynb runs top to bottom in a fresh kernel without an error,
and draws its pictures (PNG outputs), the treescope tree and the token-level view (HTML outputs)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "notebooks" / "inspect_checkpoint.ipynb"


def test_notebook_executes(tmp_path, monkeypatch):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  # The kernel inherits this environment: 4 simulated CPU devices as the notebook itself would
  # choose (not the suite's 8), the repository importable, temp files under tmp_path.
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f]
  monkeypatch.setenv("XLA_FLAGS", " ".join(flags + ["--xla_force_host_platform_device_count=4"]))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
  monkeypatch.setenv("TMPDIR", str(tmp_path))
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  client = nbclient.NotebookClient(
      nb,
      timeout=600,
      kernel_name="python3",
      allow_errors=False,
      resources={"metadata": {"path": str(REPO / "notebooks")}},
  )
  client.execute()  # raises CellExecutionError naming the cell on any error
  outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
  assert not [o for o in outputs if o.get("output_type") == "error"]
  pngs = [o for o in outputs if "image/png" in o.get("data", {})]
  assert len(pngs) >= 5, f"expected >= 5 figures, got {len(pngs)}"
  htmls = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})]
  htmls = ["".join(h) if isinstance(h, list) else h for h in htmls]
  assert any("treescope" in h for h in htmls), "no treescope rendering"
  # the token-level view of sampled groups: coloured tokens, ICT's selected ones boxed, the statistics
  views = [h for h in htmls if 'class="ictv"' in h]
  assert len(views) == 1, "no token-level view"
  assert views[0].count('class="tok') >= 3 * 4 and 'class="tok sel"' in views[0]  # 3 groups of 4
  for needle in ('value="entropy"', 'value="prob"', "mean probability of the sampled token", "high-entropy share"):
    assert needle in views[0]
  text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
  assert "trained 4 steps" in text and "layers/attn/q_proj/kernel" in text
  assert "model.safetensors" in text and "config.json" in text
  assert re.search(r"step 4: [1-9]\d* of \d+ tokens selected; mean p selected", text), "no token statistics"
  assert re.search(r"logged at step 4 -> \S+step_4\.html", text)

"""Start-up code of the processes benchmarks/faults runs with phase markers: `Run(markers=True)`
puts this folder first on their PYTHONPATH (the repository follows it), so Python imports this
file before anything else (benchmarks/faults/markers.py)."""

from benchmarks.faults import markers

markers.install()

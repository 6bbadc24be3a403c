"""Fault injection for the training program, end to end: one Markdown row per fault, then JSON.

    python -m benchmarks.faults                          # every fault; 10 kills; 200-step soak
    python -m benchmarks.faults --only kill,sigterm --kills 3 --json out.json

(from the repository root). Faults (each through `python -m ict_jax.train`, a fresh process per
run, 1 CPU device), one module each, registered by name (registry.py) in the table's order (cli.py):
  config     config_abuse.py: CLI config abuse: one line, exit != 0, nothing compiled, no
             checkpoint written.
  hf         model_folders.py: bad --init_from_hf folders: one `error:` line naming the file (and
             tensor), exit != 0.
  data       data_files.py: bad GSM8K files in data.manual_dir through the trainer: bad rows skipped
             and logged with file:row; an empty file is one error naming it.
  rewards    rewards.py: hostile completions through RewardPool workers: reward 0, bounded time
             and memory.
  nonfinite  nonfinite.py: NaN advantages (-> NaN gradients) at one step and +inf activations
             feeding the LM head (-> non-finite logits) at another: both updates are skipped and
             counted, the parameters stay unchanged at those steps and finite throughout, training
             goes on.
  ckpt       checkpoint.py: a data file of the newest checkpoint truncated: the re-run warns naming
             it, resumes from the previous one, equals the uninterrupted run, and leaves a readable
             newest step.
  sigterm    sigterm.py: SIGTERM during a step (the step finishes, is saved, exit 0 within
             train.sigterm_grace_s) and during sampling when the step would not fit in the grace
             period (the step is dropped, the last completed state saved, exit 0 in time); the
             continued runs equal an uninterrupted one.
  kill       kill.py: SIGKILL during sampling, during the train step and during an async checkpoint
             save, `--kills` times in one run directory; each time the same command is re-run.
             Checked: it resumes from the newest complete checkpoint, at most checkpoint_every
             steps are lost, and the final metrics log equals an uninterrupted run's step by step.
  soak       soak.py: --soak-steps steps, checkpoints every 10, keep 3: disk, host memory (RSS) and
             open file descriptors of the trainer sampled over time.

harness.py runs the CLI (`Run`) and reads what a run left behind. Phases are hit through the
trainer's own seam, a hook: markers.py's `MarkerHook`, added to the killed runs' command line with
`--hooks` (`Run(markers=True)`), appends `{"t", "event"}` lines to $ICT_FAULTS_MARKERS at the
rollout, the update and each checkpoint save (optionally sleeping, $ICT_FAULTS_SLEEP="sample=2,step=8");
nonfinite.py injects its faults with a hook too. Nothing patches the product's modules.
`tests/test_faults.py` runs the same functions with small settings.

A new fault: a module with its function returning `harness.row(...)`, registered with
`@registry.scenario("name")`, and a place in cli.py's MODULES (the table's order).
"""

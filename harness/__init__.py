"""The harness below the entry points in `experiments/` and `comparisons/`.

    harness.config     typed dataclass configs as command lines (one --flag per field)
    harness.adapter    ONE adapter for every implementation: build it, step it, read its metrics
    harness.runner     the interleaved runner: warm-up, rounds, medians, CPU, memory, one JSON
    harness.measure    what a step costs beside time: CPU per thread group, peak resident memory
    harness.results    result JSON: write atomically, read back (version checked), environment
    harness.compare    deviation measures and bounds of the equivalence checks
    harness.calibrate  the emulated cluster's "matched" link rate (one calibration run)

Entry points import the harness, never each other; the library (`portddp/`) never
imports it. The harness is not installed: it lives in the source checkout beside
`experiments/` and `comparisons/` and is run from the repository root
(`python -m experiments.bench`); the `portddp` command puts the checkout on the
path for the subcommands that need it.
"""

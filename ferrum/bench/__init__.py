"""`ferrum bench`: reproducible side-by-side benchmarks (see docs/benchmarks.md).

command.py     flags, plan, estimate; the `ferrum bench` entry (cli.py calls `run`)
settings.py    FULL and QUICK presets: workload sizes, rounds, hygiene thresholds
harness.py     rounds x workloads x arms, one server at a time, retries when disturbed
arms.py        server command lines (ferrum, llama-server in two builds, llama-cpp-python, url)
workloads.py   sweep, burst, multiturn, noisy, fairness over HTTP -> raw samples + round metrics
engine_loop.py ferrum's in-process decode loop vs llama-batched-bench
client.py      one streamed /v1/completions request, timed per chunk; token counting
prompts.py     raw Gemma-formatted prompt text, seeded per round
machine.py     CPU accounting: quiet-machine wait, foreign CPU share
stats.py       percentiles, spreads, paired ratios, verdicts (pure)
report.py      metric catalogue, summary rows, Markdown tables (pure)
output.py      results.json, results.md; plots.py: PNGs; progress.py: the bar
"""

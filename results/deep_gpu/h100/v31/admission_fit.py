"""How many steps a continuous batch loses per admission, fitted to v31's measured rows a step.

A model of the batcher's 16 rows decoding 160 prompts: each row takes the next waiting prompt when its own ends,
after ``lag`` empty steps (the admission), and the run lasts until the last row ends (the drain). A prompt costs
the baseline one step a token and ppd its own step count; both come from the server run's records in
``load.json.gz`` (the 4- and 16-client levels: every prompt both methods answered, greedy, 256 tokens at most).
The mean rows a step it gives for each lag are set against what ``continuous_b16_static.json`` measured.

    python results/deep_gpu/h100/v31/admission_fit.py
"""

import gzip
import json
import random
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS, PROMPTS, SAMPLES = 16, 160, 20


def rows_a_step(costs: list[float], rows: int, lag: int) -> float:
    """Busy row-steps over the run's steps when each prompt takes the row that frees first, ``lag`` steps late."""
    free = [0.0] * rows
    for cost in costs:
        i = min(range(rows), key=free.__getitem__)
        free[i] += (lag if free[i] else 0) + cost
    return sum(costs) / max(free)


def main() -> None:
    run = json.load(gzip.open(HERE / "load.json.gz"))
    answers = {}
    for r in run["records"]:
        if not r["warmup"] and not r["error"] and r["clients"] in (4, 16):
            answers.setdefault((r["prompt_index"], r["method"]), r)
    prompts = [(answers[i, "baseline"]["completion_tokens"], r["steps"])
               for (i, method), r in answers.items() if method == "ppd" and (i, "baseline") in answers]
    measured = {r["variant"]: r["mean_rows"]
                for r in json.loads((HERE / "continuous_b16_static.json").read_text())["rows"]}
    print(f"{len(prompts)} prompts; measured rows a step: baseline {measured['baseline']:.2f}, "
          f"ppd {measured['ppd']:.2f}")
    rng = random.Random(0)
    draws = [[rng.choice(prompts) for _ in range(PROMPTS)] for _ in range(SAMPLES)]
    print("| steps lost per admission | baseline rows a step | ppd rows a step | ppd / baseline |")
    print("|---|---|---|---|")
    for lag in (0, 2, 4, 6, 8, 10, 12):
        base = statistics.mean(rows_a_step([p[0] for p in d], ROWS, lag) for d in draws)
        ppd = statistics.mean(rows_a_step([p[1] for p in d], ROWS, lag) for d in draws)
        print(f"| {lag} | {base:.2f} | {ppd:.2f} | {ppd / base:.3f} |")


if __name__ == "__main__":
    main()

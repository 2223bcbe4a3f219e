"""PPD_COMPILE_CACHE: a second process with an empty Inductor cache (a fresh machine) finds the steps the first
compiled (over two warm-ups, the decoder's and the continuous batcher's, two files), decodes the same tokens and
writes nothing new; an unreadable file in the folder is skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from ppd.compile_cache import SUFFIX

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json
from torch._dynamo.utils import counters
from tests.conftest import random_prompt_tokens, tiny_model
from ppd.decoder import Decoder
from ppd.serving.batcher import BatcherConfig, ContinuousBatcher

model = tiny_model("llama")
decoder = Decoder(model, random_prompt_tokens(model, n=3, v=1, seed=1, deep=True, rank=2))
decoder.warmup(batch_sizes=[1], capture="compile")
# The server's warm-up, its baseline lane: the one-row step for batches of 2 compiles, a second file
ContinuousBatcher(decoder, BatcherConfig(max_batch=2, capture="compile")).warmup(methods=("baseline",))
compiled, found = counters["inductor"]["fxgraph_cache_miss"], counters["inductor"]["fxgraph_cache_hit"]
out = [decoder.generate(ids, max_new_tokens=16, capture="compile") for ids in ([5, 9, 2, 7, 7, 1], [3, 8])]
print(json.dumps({"tokens": [o.token_ids for o in out], "compiled": compiled, "found": found}))
"""


def _run(cache: Path, inductor: Path) -> dict:
    env = {**os.environ, "PPD_COMPILE_CACHE": str(cache), "TORCHINDUCTOR_CACHE_DIR": str(inductor),
           "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]) | {"log": done.stderr}


def test_a_fresh_process_finds_the_steps_another_compiled(tmp_path):
    cache = tmp_path / "compiled"
    first = _run(cache, tmp_path / "inductor-1")
    files = sorted(cache.glob(f"*{SUFFIX}"))
    assert first["compiled"] > 0 and len(files) == 2
    (cache / f"cut-short{SUFFIX}").write_bytes(b"not an artifact file")
    second = _run(cache, tmp_path / "inductor-2")  # an empty Inductor cache, as on another machine
    assert second["tokens"] == first["tokens"]
    assert second["compiled"] == 0 and second["found"] >= first["compiled"]  # the warm-ups compiled nothing
    assert sorted(cache.glob(f"*{SUFFIX}")) == sorted([*files, cache / f"cut-short{SUFFIX}"])  # nothing new
    assert "cut-short" in second["log"] and "not loaded" in second["log"]

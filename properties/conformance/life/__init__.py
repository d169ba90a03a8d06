"""The request's life over HTTP, black box: many at once, cut, resumed, preempted (§4.7-§4.10).

The other recipes send one request at a time and judge what comes back. These judge what happens
around a request while it runs, on a forced checkpoint (so every answer is known exactly):

- `exchange.py`: requests sent side by side (no retries: a failed connection is a finding), each
  with its raw answer and its timings, and the engine's own gauges (/metrics, /slots) sampled while
  they run;
- `recipes.py`: the cases' recipes: batch exactness (every answer under load equals its answer
  alone), one terminal under load, preemption (the same, on a server with a KV budget too small for
  the load; no preemption counted means n/a), a disconnect that frees its place, an abort that stops
  the work, and SSE ids with Last-Event-ID resumption;
- `failover.py`: the gateway case: one of a gateway's workers fails mid-answer (run where the caller
  can make a worker fail: `failover.stopping`).

Each recipe names the model-checked property it approximates (`MODEL_CHECKED`): the black box shows
one run of the property the checker proves for every interleaving of the tables (`decodespec check`).
"""

from .failover import worker_failure
from .recipes import MODEL_CHECKED
from .recipes import RECIPES as _RECIPES

RECIPES = {**_RECIPES, "worker_failure": worker_failure}

__all__ = ["MODEL_CHECKED", "RECIPES"]

import os

import torch

# The suite runs on 2 cores, often beside multi-process tests: one thread per process keeps
# timings steady and avoids oversubscription.
torch.set_num_threads(1)

# The transformers models the multi-process tests build in their ranks, imported once in
# graphpar.launch's fork server instead of in every rank (about 2.5 s of CPU each).
os.environ.setdefault("GRAPHPAR_LAUNCH_PRELOAD", ",".join(
    f"transformers.models.{name}.modeling_{name}"
    for name in ("llama", "gpt2", "mixtral", "qwen2_moe", "olmoe", "bert")))

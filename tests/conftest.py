import torch

# The suite runs on 2 cores, often beside multi-process tests: one thread per process keeps
# timings steady and avoids oversubscription.
torch.set_num_threads(1)

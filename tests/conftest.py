import os

# Two cores on CI: keep torch from oversubscribing when tests spawn worker processes.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

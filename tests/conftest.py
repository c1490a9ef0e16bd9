import os

# Keep test processes from fighting over the 2 cores of CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

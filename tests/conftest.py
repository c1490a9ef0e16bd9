import os

# Keep test processes from fighting over the 2 cores of CI machines.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The README's first command as a session fixture (one server for every test using it).
from tests.readme_server import readme_server  # noqa: F401

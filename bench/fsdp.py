"""fshard fsdp vs native PyTorch on the same model and run; see bench/data_parallel.py."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from data_parallel import main  # noqa: E402

if __name__ == "__main__":
    main("fsdp")

"""``python -m tests.conformance.fuzz --seeds 0:10000 [--jobs N]`` (see ``run.py``).

The package is imported as ``fuzz`` with ``tests/conformance`` on the path, as pytest
imports it: the rank task is sent to the ranks by that name, and ``conf_compare`` /
``conf_ops_fshard`` are top-level modules there.
"""

import os
import sys

if __name__ == "__main__":  # not when the ranks' forkserver imports the main module again
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fuzz.run import main

    sys.exit(main())

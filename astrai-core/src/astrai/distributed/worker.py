"""``python -m astrai.distributed.worker SPEC``: one tensor-parallel worker rank (see ``launch.worker_main``).

``SPEC`` is the JSON that rank 0 passes (``launch.load_tensor_parallel``).
"""

from __future__ import annotations

import json
import sys

from astrai.distributed.launch import worker_main

if __name__ == "__main__":
    sys.exit(worker_main(json.loads(sys.argv[1])))

"""``python -m astrai.distributed.worker SPEC``: one tensor-parallel worker rank (see ``launch.worker_main``).

``SPEC`` is the JSON that rank 0 passes (``launch.load_tensor_parallel``).

The worker leaves through ``os._exit`` once its loop and process group are done: about one exit
in eight (4 ranks on 2 cores), a native thread of torch's was still joinable when the interpreter
tore down, and the worker died of SIGABRT ("terminate called without an active exception", no
Python frame) after a clean ``STOP``. Nothing is left to finalize by then but its logs and streams.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from astrai.distributed.launch import worker_main

if __name__ == "__main__":
    code = worker_main(json.loads(sys.argv[1]))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
